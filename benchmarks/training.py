"""Training throughput: dikkat's GPT against Hugging Face GPT-2 and nanoGPT's model.

    python benchmarks/training.py [--nanogpt DIR] [--steps 4]

GPT-2-small shape (12 layers, 12 heads, width 768, vocabulary 50257), batch 4 × 256 tokens,
AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices), gradient clipping at 1.0, fp32
and bf16 autocast. Every model runs the same loop: its own training loss over all positions,
backward, clip, step — each through its own code path: dikkat's ``GPT.loss`` with
``dikkat.training``'s optimizer, nanoGPT's ``model(x, targets)`` with its
``configure_optimizers``, and Hugging Face's logits with a plain cross-entropy (and dikkat's
optimizer: HF has none of its own). nanoGPT is not a package: pass ``--nanogpt DIR``, a folder
holding its ``model.py`` (a checkout of karpathy/nanoGPT); without it that row is skipped.
Also the demo's own figures: ``--demo`` runs ``dikkat demo`` and reports its loss and time.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import save_json
from dikkat.models import GPT, GPTConfig
from dikkat.training.trainer import TrainConfig, make_optimizer

B, T, V = 4, 256, 50257


def build_dikkat() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = GPT(GPTConfig.preset("gpt2-small"))
    opt = make_optimizer(model, TrainConfig(lr=6e-4, beta2=0.95, weight_decay=0.1))
    return model, opt, model.loss


def build_hf() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = make_optimizer(model, TrainConfig(lr=6e-4, beta2=0.95, weight_decay=0.1))

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())

    return model, opt, loss


def build_nanogpt(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    spec = importlib.util.spec_from_file_location("nanogpt_model", path / "model.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{path} has no model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = mod
    spec.loader.exec_module(mod)
    model = mod.GPT(mod.GPTConfig(block_size=1024, vocab_size=V, dropout=0.0, bias=True))
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)[1]  # (logits, loss) when given targets

    return model, opt, loss


def one_step(model, opt, loss_of, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> float:
    """Seconds for forward, loss, backward, clipping and the optimizer step."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_of(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0


def interleaved(builders: dict, steps: int, bf16: bool) -> dict[str, float]:
    """Median seconds per step of each model, their steps taken in turns (A, B, C, A, B, C, …)
    so that a slow spell of this shared machine falls on every model alike."""
    built = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        built[name] = build()
        built[name][0].train()
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in built}
    for i in range(steps + 1):
        x = torch.randint(0, V, (B, T), generator=g)
        y = torch.randint(0, V, (B, T), generator=g)
        for name, (model, opt, loss_of) in built.items():
            t = one_step(model, opt, loss_of, x, y, bf16)
            if i > 0:  # the first step of each is a warm-up
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, help="folder with nanoGPT's model.py")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model and dtype")
    args = parser.parse_args(argv)
    builders = {"dikkat": build_dikkat, "HF GPT2LMHeadModel": build_hf}
    if args.nanogpt is not None:
        builders["nanoGPT"] = lambda: build_nanogpt(args.nanogpt)
    print(f"GPT-2 small, batch {B} × {T}, AdamW, median of {args.steps} interleaved steps")
    per = {dt: interleaved(builders, args.steps, dt == "bf16") for dt in ("fp32", "bf16")}
    rows = [{"model": n, **{dt: B * T / per[dt][n] for dt in per}} for n in builders]
    print(f"{'model':<22}{'fp32 tok/s':>12}{'bf16 tok/s':>12}")
    for r in rows:
        print(f"{r['model']:<22}{r['fp32']:>12.0f}{r['bf16']:>12.0f}")
    ours = rows[0]
    for r in rows[1:]:
        print(
            f"dikkat / {r['model']}: fp32 ×{ours['fp32'] / r['fp32']:.2f}, "
            f"bf16 ×{ours['bf16'] / r['bf16']:.2f}"
        )
    path = save_json("training", {"batch": [B, T], "steps": args.steps, "rows": rows})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
