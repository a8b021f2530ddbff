import json
import re
import subprocess
import sys
from pathlib import Path

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
    for section in ("§2", "§3", "§4", "§13"):
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
        (["generate", "/nonexistent/dir", "x"], "/nonexistent/dir does not exist"),
        (["generate", "--hf-gpt2", "/nonexistent/dir", "x"], "no config.json"),
        (["generate", "x"], "give one of a CHECKPOINT directory, --hf-gpt2 PATH or --model"),
        (["generate", "ckpt", "x", "--top-p", "1.5"], "expected a number in (0, 1]"),
        (["generate", "ckpt", "x", "--temperature", "-1"], "expected a number ≥ 0"),
        (["generate", "ckpt", "x", "-n", "0"], "expected a positive integer"),
        (["generate", "ckpt", "x", "--lookup", "0"], "expected a positive integer, got 0"),
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


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    import json as _json

    from dikkat.tasks import TaskSpec
    from dikkat.training.trainer import TrainConfig, train

    text = tmp_path_factory.mktemp("text") / "corpus.txt"
    text.write_text(Path(_json.__file__).read_text())
    out = tmp_path_factory.mktemp("mlm") / "run"
    spec = TaskSpec(
        task="mlm",
        seq_len=32,
        data=str(text),
        model_overrides={"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 32},
    )
    train(spec, TrainConfig(steps=3, batch_size=4, warmup=1, eval_every=0), out, progress=False)
    return out


def test_fill_mask_fills_every_mask_with_ranked_guesses(mlm_run, tiny_checkpoint, capsys):
    code = main(["fill-mask", str(mlm_run), "def f([MASK]): return [MASK]", "--top-k", "3"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    text, guesses = "\n".join(out[:-2]), out[-2:]  # a guess may be a newline byte
    assert "[MASK]" not in text and text.startswith("def f(") and "): return " in text
    assert [line.split(":")[0] for line in guesses] == ["[MASK] 1", "[MASK] 2"]
    for line in guesses:
        probs = [float(p) for p in re.findall(r" (\d\.\d{3})(?:   |$)", line)]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1.0
    assert main(["fill-mask", str(mlm_run), "no mask here"]) == 2
    assert "has no [MASK]" in capsys.readouterr().err
    path, _ = tiny_checkpoint
    assert main(["fill-mask", str(path), "a [MASK]"]) == 2  # a GPT, not a BERT
    assert f"{path} holds a saved GPT, not a masked-LM BERT" in capsys.readouterr().err


def test_device_is_checked_in_one_line(tiny_checkpoint, capsys):
    import torch

    path, _ = tiny_checkpoint
    assert main(["generate", str(path), "ab", "-n", "2", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["generate", str(path), "ab", "--device", "nope"]) == 2
    assert "--device 'nope' is not a device torch knows" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", str(path), "ab", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_generate_without_a_prompt_says_so(tiny_checkpoint, capsys):
    path, _ = tiny_checkpoint
    assert main(["generate", str(path)]) == 2
    assert "no prompt given" in capsys.readouterr().err


def test_every_help_example_is_a_valid_command_line():
    """Each command's examples (shown by its --help and by dikkat --help) parse as written."""
    import shlex

    from dikkat.cli import build_parser
    from dikkat.cli.common import iter_commands

    parser = build_parser()
    commands = dict(iter_commands(parser))
    assert {
        "train",
        "generate",
        "detect",
        "bench",
        "bench attention",
        "bench cost",
    } <= commands.keys()
    examples = [(name, cmd) for name, sub in commands.items() for cmd, _ in sub.dikkat_examples]
    assert len(examples) >= 20
    for name, example in examples:
        assert example.startswith(f"dikkat {name}"), example
        args = parser.parse_args(shlex.split(example)[1:])
        assert args.command is not None, example


def test_python_dash_m_dikkat_is_the_command():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "dikkat", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: dikkat")


def test_generate_with_int8_weights_prints_the_int8_greedy_tokens(
    tiny_checkpoint, capsys, monkeypatch
):
    from dikkat.weights import InferenceLinear

    path, model = tiny_checkpoint
    seen = []  # the format every linear layer of the loaded model's copy multiplied in
    forward = InferenceLinear.forward
    monkeypatch.setattr(
        InferenceLinear, "forward", lambda m, x: seen.append(m.weights_format) or forward(m, x)
    )
    assert main(["generate", str(path), "def f(", "-n", "12", "--weights", "int8"]) == 0
    monkeypatch.undo()
    assert seen and set(seen) == {"int8"}
    out = capsys.readouterr().out
    expected = model.generate([list(b"def f(")], 12, weights="int8")[0]
    assert out.rstrip("\n") == bytes(expected).decode("utf-8", errors="replace")


def test_generate_with_lookup_prints_the_greedy_tokens_and_its_counts(tiny_checkpoint, capsys):
    from dikkat.generation import LookupStats, lookup_generate

    path, model = tiny_checkpoint
    assert main(["generate", str(path), "def f(", "-n", "20", "--lookup", "4"]) == 0
    captured = capsys.readouterr()
    expected = model.generate([list(b"def f(")], 20)[0]
    assert captured.out.rstrip("\n") == bytes(expected).decode("utf-8", errors="replace")
    stats = LookupStats()
    assert lookup_generate(model.eval(), [list(b"def f(")], 20, k=4, stats=stats) == [expected]
    assert stats.calls < 20  # guesses were accepted: the counts below are not plain greedy's
    assert captured.err.strip() == (
        f"lookup: 20 tokens in {stats.calls} model calls ({stats.tokens_per_call:.2f} a call); "
        f"{stats.accepted} of {stats.drafted} guessed tokens accepted"
    )


def test_generate_lookup_refuses_to_sample(tiny_checkpoint, capsys):
    path, _ = tiny_checkpoint
    assert main(["generate", str(path), "ab", "--lookup", "2", "--temperature", "0.8"]) == 2
    err = capsys.readouterr().err
    assert "--lookup decodes greedily; it cannot sample at --temperature 0.8" in err
    assert err.strip().count("\n") == 0


# what `dikkat --help` must not load: each command imports them inside its function
HEAVY_FOR_HELP = (
    "dikkat.training",
    "dikkat.serving",
    "dikkat.pretrained",
    "dikkat.maps",
    "dikkat.hf",
    "dikkat.distributed",
    "fastapi",
    "uvicorn",
    "transformers",
    "matplotlib",
    "scipy",
    "jinja2",
)


def test_help_of_dikkat_and_of_every_command_loads_nothing_heavy():
    """``dikkat --help`` and ``dikkat COMMAND --help`` for every command, in one fresh process:
    each prints its usage and exits 0, and none of them imports training, the server, the
    pretrained models, the maps or the plotting and optional libraries."""
    code = """
import contextlib, io, json, sys
from dikkat.cli import build_parser, main
from dikkat.cli.common import iter_commands

codes, usages = {}, {}
for argv in [[], *[name.split() for name, _ in iter_commands(build_parser())]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            codes[" ".join(argv)] = e.code
    usages[" ".join(argv)] = out.getvalue().startswith("usage: dikkat")
print(json.dumps({"codes": codes, "usages": usages, "modules": list(sys.modules)}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {"", "train", "serve", "show", "audit", "bench attention"} <= out["codes"].keys()
    assert set(out["codes"].values()) == {0} and all(out["usages"].values()), out
    heavy = sorted(m for m in HEAVY_FOR_HELP if m in out["modules"])
    assert not heavy, heavy
