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


def test_seeds_prints_each_seed_number_beside_the_seed(capsys):
    assert main(["seeds"]) == 0
    out = capsys.readouterr().out
    for section in ("S2", "S3", "S4", "S13"):
        assert section in out
    assert "(0.67, 0.33)" in out.split("A's weights")[1].splitlines()[0]
    assert "(0.36, 0.64)" in out.split("B's weights")[1].splitlines()[0]
    assert "0.31 0.69" in out


def test_bad_argument_is_one_line_not_a_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "dikkat.cli", "seeds", "--d-k", "x"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("dikkat: error:")
    assert "Traceback" not in r.stderr


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    import torch

    from dikkat.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", max_len=64))
    path = tmp_path_factory.mktemp("ckpt")
    model.save(path)
    return path, model


def test_generate_streams_the_models_greedy_tokens(tiny_checkpoint, capsys):
    path, model = tiny_checkpoint
    assert main(["generate", str(path), "def f(", "-n", "12"]) == 0
    out = capsys.readouterr().out
    # the CLI prints what the model's own greedy generation decodes to (bytes tokenizer)
    expected = model.generate([list(b"def f(")], 12)[0]
    text = bytes(expected).decode("utf-8", errors="replace")
    assert out.rstrip("\n") == text


def test_generate_with_a_local_hf_gpt2_directory(tmp_path, capsys):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    # no tokenizer files: an error, not byte ids fed to a model of another vocabulary
    assert main(["generate", "--hf-gpt2", str(tmp_path), "ab", "-n", "5"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    from dikkat.text import ByteTokenizer

    ByteTokenizer().save(tmp_path)  # this tiny model's 256 ids are bytes
    assert main(["generate", "--hf-gpt2", str(tmp_path), "ab", "-n", "5"]) == 0
    out = capsys.readouterr().out
    hf_ids = hf.generate(
        torch.tensor([list(b"ab")]), max_new_tokens=5, do_sample=False, pad_token_id=0
    )[0].tolist()
    assert out.rstrip("\n") == bytes(hf_ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "/nonexistent/dir", "x"], "no config.json"),
        (["generate", "--hf-gpt2", "/nonexistent/dir", "x"], "no config.json"),
        (["generate", "x"], "either a CHECKPOINT"),
        (["generate", "ckpt", "x", "--top-p", "1.5"], "expected a number in (0, 1]"),
        (["generate", "ckpt", "x", "--temperature", "-1"], "expected a number ≥ 0"),
        (["generate", "ckpt", "x", "-n", "0"], "expected a positive integer"),
    ],
)
def test_generate_bad_arguments_give_one_clear_line(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.strip().count("\n") == 0


def test_generate_refuses_mismatched_folders(tiny_checkpoint, tmp_path, capsys):
    path, _ = tiny_checkpoint
    assert main(["generate", "--hf-gpt2", str(path), "x"]) == 2  # a dikkat model, not HF's
    assert "is not a Hugging Face model" in capsys.readouterr().err
    from dikkat.models import GPT, GPTConfig

    GPT(GPTConfig.preset("tiny", vocab_size=300)).save(tmp_path / "bpe")
    assert main(["generate", str(tmp_path / "bpe"), "x"]) == 2  # 300 ids cannot be bytes
    assert "has no tokenizer" in capsys.readouterr().err


def test_similar_ranks_the_paraphrase_first(capsys):
    assert (
        main(
            [
                "similar",
                "a cat sleeps on the sofa",
                "the stock market fell",
                "a kitten naps on the couch",
                "rain is expected tomorrow",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("a kitten naps on the couch")
    scores = [float(line.split()[0]) for line in lines]
    assert scores == sorted(scores, reverse=True)


def test_embed_prints_unit_vectors(capsys):
    import json
    import math

    assert main(["embed", "hello world", "attention"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [len(r) for r in rows] == [384, 384]
    for r in rows:
        assert math.isclose(math.sqrt(sum(x * x for x in r)), 1.0, abs_tol=1e-4)
