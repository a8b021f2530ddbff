"""What nothing-lost costs: saving a run's checkpoint, and loading with and without verification.

    python benchmarks/checkpoint.py [--preset gpt2-small] [--repeats 3]

A GPT of the preset's shape (randomly initialised, fp32) and its AdamW state after one step are
committed as one run checkpoint (every file flushed with fsync, then the pointer renamed), then
loaded back with ``GPT.load(run, verify=True)`` and ``verify=False`` side by side; also the plain
SHA-256 throughput of the weights file. The verified load reads the weights twice (the hash,
then safetensors); the difference of the two loads is the cost of the check.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import save_json
from dikkat.files import sha256
from dikkat.models import GPT, GPTConfig
from dikkat.runs import checkpoint_dir
from dikkat.text import ByteTokenizer
from dikkat.training.checkpoint import write_checkpoint
from dikkat.training.trainer import TrainConfig, make_optimizer


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset))
    optimizer = make_optimizer(model, TrainConfig())
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    model.loss(x, x).backward()
    optimizer.step()  # the moments exist: the state is twice the weights
    root = Path(tempfile.mkdtemp(prefix="dikkat-bench-ckpt-"))
    run = root / "run"
    state = {"step": 1, "optimizer": optimizer.state_dict(), "history": []}

    def commit() -> None:
        write_checkpoint(
            run, model=model, tokenizer=ByteTokenizer(), meta={"task": {}, "train": {}},
            state=state, made_by="benchmark",
        )  # fmt: skip

    try:
        save_s = median_time(commit, args.repeats)
        folder = checkpoint_dir(run)
        weights = folder / "model.safetensors"
        total = sum(p.stat().st_size for p in folder.iterdir())
        weights_bytes = weights.stat().st_size
        sha_s = median_time(lambda: sha256(weights), args.repeats)
        # interleaved, so that both see the same page cache and machine load
        verified, unverified = [], []
        for _ in range(args.repeats):
            for verify, times in ((True, verified), (False, unverified)):
                t0 = time.perf_counter()
                GPT.load(run, verify=verify)
                times.append(time.perf_counter() - t0)
        load_v, load_u = statistics.median(verified), statistics.median(unverified)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mb = weights_bytes / 1e6
    rows = {
        "checkpoint_mb": total / 1e6,
        "weights_mb": mb,
        "commit_s": save_s,
        "sha256_gb_per_s": weights_bytes / sha_s / 1e9,
        "load_verified_s": load_v,
        "load_unverified_s": load_u,
    }
    print(f"{args.preset}: checkpoint {total / 1e6:,.0f} MB (weights {mb:,.0f} MB)")
    print(f"  commit (write, fsync, rename)   {save_s:6.2f} s")
    print(f"  SHA-256 of the weights          {sha_s:6.2f} s ({rows['sha256_gb_per_s']:.2f} GB/s)")
    print(f"  GPT.load, verify=True           {load_v:6.2f} s")
    print(f"  GPT.load, verify=False          {load_u:6.2f} s   (check: {load_v - load_u:+.2f} s)")
    save_json("checkpoint", {"preset": args.preset, **rows})
    return rows


if __name__ == "__main__":
    main()
