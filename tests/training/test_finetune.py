"""``dikkat finetune`` and dikkat.training.finetune: a run that learns (SmolLM2), resumes exactly,
saves an adapter PEFT loads, and chats with its result; the mechanics on a tiny Llama folder."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

import dikkat
from dikkat.training.config import TrainConfig
from dikkat.training.finetune import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FinetuneSpec,
    finetune,
    load_finetuned,
    resume_finetune,
)
from dikkat.training.lora import LoraConfig
from dikkat.training.sft_data import read_examples, split_examples
from helpers import run_cli

sys.path.insert(0, str(Path(__file__).parents[1] / "pretrained"))
from tiny_hf import save_tiny

pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    cons, vowels = "bdfgklmnprstvz", "aeiou"
    return [
        "".join(rng.choice(cons) + rng.choice(vowels) for _ in range(rng.randint(2, 3)))
        for _ in range(n)
    ]


def _tag_chats(path: Path, n: int, seed: int = 0) -> Path:
    """Chats that ask for a made-up word in a house format: ``<tag>word</tag>``, an answer no
    base model gives unasked."""
    with path.open("w") as f:
        for w in _words(n, seed):
            messages = [
                {"role": "system", "content": "Answer in the house format."},
                {"role": "user", "content": f"Label: {w}"},
                {"role": "assistant", "content": f"<tag>{w}</tag>"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder with a chat template, and chats for it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny("llama", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHATML}))
    _tag_chats(folder / "chats.jsonl", 40)
    return folder


def _spec(tiny: Path, **options: object) -> FinetuneSpec:
    lora = LoraConfig(rank=4, alpha=8.0, targets=ALL)
    return FinetuneSpec(str(tiny), str(tiny / "chats.jsonl"), **{"seq_len": 128, "lora": lora,
                                                                 **options})  # fmt: skip


def _config(steps: int, **options: object) -> TrainConfig:
    settings = dict(batch_size=2, lr=1e-2, warmup=1, weight_decay=0.0, eval_every=2,
                    log_every=1, save_every=2, eval_batches=1)  # fmt: skip
    return TrainConfig(steps=steps, **{**settings, **options})  # type: ignore[arg-type]


def test_learns_a_format_the_base_model_lacks(tmp_path: Path) -> None:
    """SmolLM2, eight steps of LoRA on chats that answer in a made-up format: the held-out
    chats' greedy answers go from the base model's to ≥ 90 % exactly right."""
    data = _tag_chats(tmp_path / "tags.jsonl", 240)
    spec = FinetuneSpec("smollm2", str(data), seq_len=256, lora=LoraConfig(targets=ALL))
    config = TrainConfig(steps=8, batch_size=2, lr=2e-3, warmup=2, weight_decay=0.0,
                         eval_every=0, log_every=2, eval_batches=1)  # fmt: skip
    result = finetune(spec, config, tmp_path / "run", progress=False)
    assert result.val_loss < 0.5

    base = dikkat.pretrained.load("smollm2")
    _, held = split_examples(read_examples(data, base), spec.eval_fraction, config.seed)
    chats = [json.loads(line) for line in data.read_text().splitlines()]
    held_chats = [chats[e.line - 1]["messages"] for e in held[:16]]  # type: ignore[operator]
    assert len(held_chats) >= 10

    def accuracy(lm: dikkat.pretrained.Pretrained) -> float:
        right = [lm.chat(m[:2], 12, temperature=0).strip() == m[2]["content"] for m in held_chats]
        return sum(right) / len(right)

    before = accuracy(base)
    after = accuracy(load_finetuned(tmp_path / "run"))
    assert before < 0.5 and after >= 0.9, (before, after)


def test_resume_is_exact(tiny: Path, tmp_path: Path) -> None:
    """Stopped at step 2 and resumed, a run ends with the adapter and the logged losses of the
    run that went straight through."""
    straight = finetune(_spec(tiny), _config(4), tmp_path / "a", progress=False)
    from dikkat.training.finetune import finetuner

    stopped = finetuner(_spec(tiny), _config(4), tmp_path / "b")
    stopped.train(progress=False, until=2)
    del stopped
    resumed = resume_finetune(tmp_path / "b").train(progress=False)
    assert resumed.train_loss == straight.train_loss
    assert resumed.val_loss == straight.val_loss
    logs = [(tmp_path / r / "log.jsonl").read_text().splitlines() for r in "ab"]
    losses = [[json.loads(x).get("loss") for x in log] for log in logs]
    assert losses[0] == losses[1]
    from safetensors.torch import load_file

    weights = [load_file(dikkat.runs.checkpoint_dir(tmp_path / r) / ADAPTER_WEIGHTS) for r in "ab"]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_peft_loads_the_adapter(tiny: Path, tmp_path: Path) -> None:
    """The checkpoint's adapter, loaded by PEFT onto the same HF folder, gives dikkat's logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    finetune(_spec(tiny), _config(3), tmp_path / "run", progress=False)
    folder = dikkat.runs.checkpoint_dir(tmp_path / "run")
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in folder.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, folder).eval()
    ours = load_finetuned(tmp_path / "run")
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    b = next(p for n, p in theirs.named_parameters() if "lora_B" in n)
    assert b.abs().sum() > 0  # trained: not PEFT's zero start


def test_checkpointing_changes_no_number(tiny: Path) -> None:
    """Recomputing the blocks' activations in the backward gives the same loss and gradients."""
    from dikkat.training.finetune import FinetuneTask

    grads = []
    for checkpointing in (False, True):
        lm = dikkat.pretrained.load(tiny)
        task = FinetuneTask(_spec(tiny, checkpointing=checkpointing), lm, seed=0)
        with torch.no_grad():
            for s in task.sites:
                s.layer.lora_B[s.name].fill_(0.01)
        lm.model.train()
        loss, _ = task.loss(lm.model, task.rows_batch("train", torch.tensor([0, 1])))
        loss.backward()
        grads.append([p.grad.clone() for p in lm.model.parameters() if p.requires_grad])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_command_line_trains_chats_and_refuses(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tiny), "--data", str(tiny / "chats.jsonl"), "--out",
            str(out), "--steps", "2", "--seq-len", "128", "--no-progress"]  # fmt: skip
    code, said, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "adapters (q_proj, v_proj; rank 8)" in said and "held-out loss" in said
    assert (out / "loss.png").is_file() and (out / "log.jsonl").is_file()
    # a run in the way is refused; --resume extends it; --overwrite with --resume is refused
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "already holds a training run" in err
    code, said, err = run_cli(["finetune", "--out", str(out), "--resume", "--steps", "3",
                               "--no-progress"], capsys)  # fmt: skip
    assert code == 0 and "resuming" in said, err
    code, _, err = run_cli(["finetune", "--out", str(out), "--resume", "--overwrite"], capsys)
    assert code == 2 and "--overwrite would replace it" in err
    code, _, err = run_cli(["finetune", "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and "needs --model and --data" in err
    # the run is a model to chat with
    code, said, err = run_cli(["chat", str(out), "-m", "Label: bodami", "-n", "4"], capsys)
    assert code == 0, err
    lm = load_finetuned(out)
    messages = [{"role": "user", "content": "Label: bodami"}]
    assert said == lm.chat(messages, 4, repetition_penalty=1.1) + "\n"


def test_the_server_answers_with_the_adapters(tiny: Path, tmp_path: Path) -> None:
    """A fine-tune served (the engine's paged cache, the OpenAI client) answers as the run's
    model does: the adapters are in every product the engine makes."""
    pytest.importorskip("openai")
    sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
    from live_server import openai_client, serving_model

    finetune(_spec(tiny), _config(2), tmp_path / "run", progress=False)
    lm = load_finetuned(tmp_path / "run")
    messages = [{"role": "user", "content": "Label: bodami"}]
    want = lm.chat(messages, 6, temperature=0)
    with serving_model(lm, "tuned") as url:
        got = openai_client(url).chat.completions.create(
            model="tuned",
            messages=messages,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
    assert got.choices[0].message.content == want


@pytest.mark.parametrize(
    ("flags", "native"),
    [("fpu avx512f avx512_bf16 avx512_vnni", True), ("fpu avx512f avx512_vnni", False),
     ("avx512_bf16 amx_bf16 amx_tile amx_int8", False), (None, False)],
)  # fmt: skip
def test_bf16_is_the_default_where_the_cpu_has_it_natively(tmp_path: Path, flags, native) -> None:
    """AVX512-BF16 without AMX (whose tile loads fault on one VM): bf16 autocast by default."""
    from dikkat.training.config import native_bf16

    cpuinfo = tmp_path / "cpuinfo"
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert native_bf16(str(cpuinfo)) is native


def test_what_a_fine_tune_refuses_before_loading(tiny: Path, tmp_path: Path) -> None:
    from dikkat.training.finetune import finetuner

    with pytest.raises(ValueError, match="is not a file"):
        finetuner(FinetuneSpec(str(tiny), str(tmp_path / "none.jsonl")), _config(1), None)
    with pytest.raises(TypeError, match="lora must be a LoraConfig, got str"):
        FinetuneSpec(str(tiny), "x.jsonl", lora="q_proj")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eval_fraction"):
        FinetuneSpec(str(tiny), "x.jsonl", eval_fraction=1.0)
