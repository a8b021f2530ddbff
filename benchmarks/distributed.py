"""Ring attention on CPU processes: time and bytes sent, against one process's tiled attention;
and data-parallel training throughput, 1 process against 2.

    python benchmarks/distributed.py [--sizes 8192 16384] [--worlds 1 2] [--repeats 1]
                                     [--train-steps 40] [--train-batch 16]

Causal attention, B = 1, H = 8 query heads, G = 2 key/value heads, D = 64, fp32, as
:func:`dikkat.distributed.ring_attention` over W processes (``torch.multiprocessing.spawn``,
gloo over ``tcp://127.0.0.1``, one torch thread each, zigzag layout: docs/distributed.md) and
as ``dikkat.attention(..., backend="tiled")`` in this process with 1 and 2 threads. Each is
timed forward and forward + backward (``out.backward(dout)``): the median of ``--repeats``
calls, after one warm-up forward (the forward + backward calls follow it unwarmed, which keeps a
default run near 3 minutes on 2 cores, and the training rows about 2 more); a ring call's time
is its slowest rank's.

The bytes each rank sends per call are measured, not derived: the child wraps
``torch.distributed.batch_isend_irecv`` (all ring_attention sends go through it) and adds up
the ``nbytes`` of every send. The small ``all_gather`` of shapes at the start of a call is not
counted. docs/distributed.md turns the per-step figure into a communication-vs-compute model.

Training: ``dikkat train --task lm`` (a small GPT, byte tokens, the built-in text) for
``--train-steps`` steps of ``--train-batch`` sequences, in 1 process with 1 and 2 threads and
with ``--nproc 2`` (DDP, 1 thread each, the batch split between them); 0 steps skips it. Its
log.jsonl has, every 10 steps, the tokens/s since the loop began (every rank's tokens); the
rate reported is that of the steps after the first log line — the tokens of those steps over
their time, both read off the first and last log lines — so start-up (imports, data, process
group) and the first steps are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import save_json
from dikkat.masks import causal

B, H, G, D = 1, 8, 2, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_qkv(n: int) -> tuple[torch.Tensor, ...]:
    """The same q, k, v and output gradient in every process."""
    gen = torch.Generator().manual_seed(n)
    return tuple(torch.randn(B, h, n, D, generator=gen) for h in (H, G, G, H))


def timed(
    fn: Callable[[], object], repeats: int, sync: Callable[[float], float], warmup: int
) -> float:
    """Median over ``repeats`` calls (after ``warmup`` more) of ``sync(seconds)``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(sync(time.perf_counter() - t0))
    return statistics.median(times)


def child(rank: int, world: int, port: int, n: int, repeats: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    from dikkat.distributed import RingStats, ring_attention, shard_sequence

    sent = [0]
    original = dist.batch_isend_irecv

    def counting(ops: list[dist.P2POp]) -> list[dist.Work]:
        sent[0] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting  # ring_attention looks it up on the module at each call
    q, k, v, dout = (shard_sequence(t, 2) for t in global_qkv(n))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    stats = RingStats()

    def forward() -> None:
        with torch.no_grad():
            ring_attention(q, k, v, causal(), stats=stats)

    def backward() -> None:
        ring_attention(q, k, v, causal()).backward(dout)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    row: dict = {"impl": f"ring W={world}", "n": n, "threads_per_process": 1}
    for name, fn, warmup in (("fwd", forward, 1), ("fwd_bwd", backward, 0)):
        dist.barrier()
        sent[0] = 0
        row[f"{name}_s"] = timed(fn, repeats, slowest, warmup)
        row[f"{name}_bytes_sent"] = sent[0] // (repeats + warmup)  # per call
    row.update(ring_steps=stats.ring_steps, blocks_computed=stats.blocks_computed,
               pairs_computed=stats.pairs_computed, T_local=q.shape[2])  # fmt: skip
    if rank == 0:
        torch.save(row, Path(out_dir, "row.pt"))
    dist.barrier()
    dist.destroy_process_group()


def ring_row(world: int, n: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(child, args=(world, free_port(), n, repeats, tmp), nprocs=world)
        return torch.load(Path(tmp, "row.pt"))


def tiled_row(threads: int, n: int, repeats: int) -> dict:
    import dikkat

    torch.set_num_threads(threads)
    q, k, v, dout = global_qkv(n)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def forward() -> None:
        with torch.no_grad():
            dikkat.attention(q, k, v, causal(), backend="tiled")

    def backward() -> None:
        dikkat.attention(q, k, v, causal(), backend="tiled").backward(dout)

    row: dict = {"impl": f"tiled, {threads} thread{'s' * (threads > 1)}", "n": n}
    for name, fn, warmup in (("fwd", forward, 1), ("fwd_bwd", backward, 0)):
        row[f"{name}_s"] = timed(fn, repeats, lambda s: s, warmup)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'n':>6}  {'implementation':<16} {'fwd s':>8} {'fwd+bwd s':>10} "
          f"{'steps':>5} {'MiB sent fwd':>13} {'MiB sent fwd+bwd':>17}")  # fmt: skip
    for r in rows:
        mib = [f"{r[k] / 2**20:.2f}" if k in r else "" for k in ("fwd_bytes_sent",
                                                               "fwd_bwd_bytes_sent")]  # fmt: skip
        print(f"{r['n']:>6}  {r['impl']:<16} {r['fwd_s']:>8.2f} {r['fwd_bwd_s']:>10.2f} "
              f"{r.get('ring_steps', ''):>5} {mib[0]:>13} {mib[1]:>17}")  # fmt: skip


SEQ_LEN = 256
TRAIN = ["--task", "lm", "--tokenizer", "bytes", "--d-model", "128", "--layers", "2",
         "--heads", "4", "--seq-len", str(SEQ_LEN), "--max-bytes", "1000000",
         "--eval-every", "0", "--save-every", "0", "--no-progress", "--overwrite"]  # fmt: skip


def train_row(processes: int, threads: int, steps: int, batch: int) -> dict:
    """``dikkat train`` in ``processes`` processes of ``threads`` threads; its steady tokens/s
    from the first and last lines of its log.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp, "run")
        sizes = ["--steps", str(steps), "--batch-size", str(batch), "--nproc", str(processes)]
        command = [sys.executable, "-m", "dikkat", "train", *TRAIN, *sizes, "--out", str(run)]
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        t0 = time.perf_counter()
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        lines = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    rates = [(r["step"], r["tokens_per_s"]) for r in lines if "tokens_per_s" in r]
    per_step = batch * SEQ_LEN  # the tokens of one step, over every rank
    (a, rate_a), (b, rate_b) = rates[0], rates[-1]
    seconds = b * per_step / rate_b - a * per_step / rate_a  # steps a + 1 … b
    return {
        "impl": f"train, {processes} × {threads} thread{'s' * (threads > 1)}",
        "processes": processes,
        "threads_per_process": threads,
        "steps": steps,
        "batch": batch,
        "seq_len": SEQ_LEN,
        "timed_steps": b - a,
        "tokens_per_s": (b - a) * per_step / seconds,
        "tokens_per_s_from_step_0": rate_b,
        "wall_s": wall,
    }


def print_train_table(rows: list[dict]) -> None:
    print(f"{'training':<22} {'steps timed':>11} {'tokens/s':>9} {'from step 0':>12} {'wall s':>7}")
    for r in rows:
        print(f"{r['impl']:<22} {r['timed_steps']:>11} {r['tokens_per_s']:>9,.0f} "
              f"{r['tokens_per_s_from_step_0']:>12,.0f} {r['wall_s']:>7.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="*", default=[8192, 16384], help="none: training only"
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=1, help="timed calls after one warm-up")
    parser.add_argument("--train-steps", type=int, default=40, help="0: no training rows")
    parser.add_argument("--train-batch", type=int, default=16, help="sequences per step")
    args = parser.parse_args(argv)
    if args.train_steps and args.train_steps < 20:
        parser.error("--train-steps must be 0 or at least 20 (two log lines, 10 steps apart)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in args.sizes:
        rows += [tiled_row(t, n, args.repeats) for t in (1, 2)]
        rows += [ring_row(w, n, args.repeats) for w in args.worlds]
        print_table(rows[-2 - len(args.worlds) :])
    if rows:
        print()
        print_table(rows)
    train = []
    if args.train_steps:
        for processes, threads in ((1, 1), (1, 2), (2, 1)):
            train.append(train_row(processes, threads, args.train_steps, args.train_batch))
        print()
        print_train_table(train)
    shape = {"B": B, "H": H, "G": G, "D": D, "dtype": "float32", "mask": "causal",
             "layout": "zigzag"}  # fmt: skip
    training = {"args": TRAIN, "rows": train}
    print(save_json("distributed", {"shape": shape, "rows": rows, "training": training}))
    return rows + train


if __name__ == "__main__":
    main()
