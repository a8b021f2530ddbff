import subprocess
import sys

import pytest

from dikkat import __version__
from dikkat.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_demo_prints_each_seed_number_beside_the_seed(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for section in ("S2", "S3", "S4", "S13"):
        assert section in out
    assert "(0.67, 0.33)" in out.split("A's weights")[1].splitlines()[0]
    assert "(0.36, 0.64)" in out.split("B's weights")[1].splitlines()[0]
    assert "0.31 0.69" in out


def test_bad_argument_is_one_line_not_a_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "dikkat.cli", "demo", "--d-k", "x"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("dikkat: error:")
    assert "Traceback" not in r.stderr


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out
