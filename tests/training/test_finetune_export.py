"""``dikkat export RUN --gguf/--lora-gguf`` of a fine-tune of a GGUF model: the merged file, read
back by dikkat, is the run's model with its adapters (llama.cpp's q/k row order put back), and
llama.cpp's adapter file adds the same update to each weight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import dikkat
from dikkat.training.config import TrainConfig
from dikkat.training.finetune import FinetuneSpec, finetune, load_finetuned
from dikkat.training.lora import LoraConfig
from helpers import run_cli

sys.path.insert(0, str(Path(__file__).parents[1] / "pretrained"))
from tiny_gguf import LAYERS, tiny_llama_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fine-tune of the tiny Llama GGUF (Q4_1, Q8_0 and F32 matrices) on plain text."""
    folder = tmp_path_factory.mktemp("tuned")
    tiny_llama_file(folder / "base.gguf")
    lines = [json.dumps({"text": f"The number {n} is {'even' if n % 2 == 0 else 'odd'}."})
             for n in range(40)]  # fmt: skip
    (folder / "text.jsonl").write_text("\n".join(lines) + "\n")
    spec = FinetuneSpec(str(folder / "base.gguf"), str(folder / "text.jsonl"), seq_len=64,
                        lora=LoraConfig(rank=4, alpha=8.0, targets=ALL))  # fmt: skip
    config = TrainConfig(steps=3, batch_size=2, lr=5e-2, warmup=1, weight_decay=0.0,
                         eval_every=0, log_every=1, eval_batches=1)  # fmt: skip
    finetune(spec, config, folder / "run", progress=False)
    return folder / "run"


def test_the_merged_file_is_the_tuned_model(run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "merged.gguf"
    code, said, err = run_cli(["export", str(run), "--gguf", str(out), "--type", "F32"], capsys)
    assert code == 0 and "merged" in said, err
    tuned = load_finetuned(run).model
    merged = dikkat.pretrained.load(out, weights="fp32").model
    base = dikkat.pretrained.load(run.parent / "base.gguf", weights="fp32").model
    ids = torch.randint(0, tuned.config.vocab_size, (2, 16), generator=torch.Generator())
    with torch.no_grad():
        want, got, before = tuned(ids), merged(ids), base(ids)
    # the packed base rounds its input to 16 bits per block: the tuned model's numbers to that
    assert (got - want).abs().max() < 2e-3 * want.abs().max()
    assert (before - want).abs().max() > 50 * (got - want).abs().max()  # the update is there


def test_own_types_and_the_adapter_file(run: Path, tmp_path: Path, capsys) -> None:
    """Merged in the base's own types, each changed matrix is requantised near W + ΔW; the
    adapter file holds A and B (rows in the file's order) whose product is the same ΔW."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    merged, lora = tmp_path / "m.gguf", tmp_path / "l.gguf"
    argv = ["export", str(run), "--gguf", str(merged), "--lora-gguf", str(lora)]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "exists; add --overwrite" in err
    f32 = tmp_path / "f32.gguf"
    assert run_cli(["export", str(run), "--gguf", str(f32), "--type", "F32"], capsys)[0] == 0

    def tensors(path: Path) -> dict:
        return {t.name: t for t in GGUFReader(path).tensors}

    base, own, exact, adapter = (tensors(p) for p in (run.parent / "base.gguf", merged, f32,
                                                       lora))  # fmt: skip
    reader = GGUFReader(lora)
    alpha = float(reader.fields["adapter.lora.alpha"].parts[-1][0])
    for i in range(LAYERS):
        for name in ("attn_q", "attn_k", "ffn_down"):
            key = f"blk.{i}.{name}.weight"
            assert own[key].tensor_type == base[key].tensor_type
            a = torch.from_numpy(dequantize(adapter[key + ".lora_a"].data, 0).copy())
            b = torch.from_numpy(dequantize(adapter[key + ".lora_b"].data, 0).copy())
            w = torch.from_numpy(dequantize(base[key].data, base[key].tensor_type).copy())
            w_exact = torch.from_numpy(dequantize(exact[key].data, 0).copy())
            torch.testing.assert_close(w + alpha / a.shape[0] * b @ a, w_exact, atol=1e-5, rtol=0)
            w_own = torch.from_numpy(dequantize(own[key].data, own[key].tensor_type).copy())
            # within one 4-bit step of the tensor's range (a bound on every block's own step)
            assert (w_own - w_exact).abs().max() <= (w_exact.max() - w_exact.min()) / 15


def test_refusals(run: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["export", str(run)], capsys)
    assert code == 2 and "give --gguf OUT, --lora-gguf OUT or both" in err
    code, _, err = run_cli(["export", str(run), "--gguf", str(tmp_path / "x.gguf"), "--dtype",
                            "f16"], capsys)  # fmt: skip
    assert code == 2 and "--dtype is a GPT's" in err
