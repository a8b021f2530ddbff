"""``dikkat serve`` that cannot serve says why in one line, exits 2 and leaves nothing running: a
port out of range, a port in use, an address not this machine's, an API key no client can send,
a malformed allowed origin (real processes, each with a time bound); and however serving ends,
the engine's thread ends with it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dikkat.cli import main
from dikkat.models import GPT, GPTConfig

BOUND = 60  # seconds a refused `dikkat serve` may take to end (it loads no model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny GPT saved as ``dikkat train`` saves one."""
    path = tmp_path_factory.mktemp("serve") / "tiny"
    GPT(GPTConfig(vocab_size=256, max_len=64, d_model=32, n_layers=2, n_heads=2)).save(path)
    return str(path)


def test_a_port_in_use_is_one_line_exit_2_and_the_process_gone(checkpoint):
    """A real process: it ends (within the bound), before the model loads."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = ["serve", checkpoint, "--port", str(port)]
        run = subprocess.run(
            [sys.executable, "-m", "dikkat.cli", *argv], capture_output=True, text=True,
            timeout=BOUND,
        )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert lines == [f"dikkat: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "99999"], "argument --port: expected a port in [0, 65535], got 99999"),
        (["--port", "-1"], "argument --port: expected a port in [0, 65535], got -1"),
        (["--host", "192.0.2.1", "--port", "0"], "cannot listen on 192.0.2.1:0: "),
        (["--host", "::99", "--port", "0"], "cannot listen on [::99]:0: "),
        (["--api-key", "cl\u00e9"], "the API key must be printable ASCII"),
        (["--api-key", "two words"], "the API key must be printable ASCII"),
        (["--allowed-origins", "localhost:3000"], "allowed origin 'localhost:3000'"),
        (["--allowed-hosts", "http://x"], "allowed host 'http://x'"),
    ],
)
def test_serve_that_cannot_serve_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    try:
        code = main(["serve", str(tmp_path / "never-read"), *argv])
    except SystemExit as e:  # argparse's refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("dikkat: error: "), err
    assert words in err


def test_serving_that_fails_leaves_no_thread_running(checkpoint, monkeypatch):
    """Whatever ends the server (here a failure in uvicorn's loop), the engine's loop is stopped
    and its thread let go, so that the process can exit."""
    import uvicorn

    def broken(self: Any) -> None:
        raise RuntimeError("the server's loop broke")

    monkeypatch.setattr(uvicorn.Server, "main_loop", broken)
    with pytest.raises(RuntimeError, match="loop broke"):
        main(["serve", checkpoint, "--port", "0", "--log-level", "warning"])
    deadline = time.monotonic() + 20
    while any(t.name.startswith("dikkat-torch") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.02)


def test_serve_takes_its_safety_flags(checkpoint, monkeypatch):
    from dikkat.cli import serve

    apps: list[Any] = []
    monkeypatch.setattr(serve, "run_server", lambda app, sockets, level: apps.append(app))
    hosts, origins = ["--allowed-hosts", "my.box, Other.Box"], ["--allowed-origins", "http://a.b:3"]
    argv = ["serve", checkpoint, "--port", "0", "--max-body-mb", "0.5", *hosts, *origins]
    assert main(argv) == 0
    (app,) = apps
    assert app.state.limits.max_body_bytes == 2**19
    guard = app.user_middleware[0].kwargs["access"]
    assert guard.hosts == {"127.0.0.1", "my.box", "other.box"}
    assert guard.origins == {"http://a.b:3"}
