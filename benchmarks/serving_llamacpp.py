"""dikkat's server and llama.cpp's ``llama-server`` side by side on the same GGUF file: aggregate
tokens/s with 1, 4 and 8 streams at once.

    python benchmarks/serving_llamacpp.py [--models smollm2,gemma3-270m] [--streams 1,4,8]
                                          [--tokens 128] [--prompt 16] [--rounds 2]
                                          [--parallel 8] [--threads 2] [--eager]

For each model, both servers run at once, each in its own process on a free 127.0.0.1 port,
started and stopped here, on the same file:

- dikkat: ``python -m dikkat serve --model FILE --max-batch PARALLEL`` (a GGUF file's quantised
  weights kept packed as the file holds them; the decode step compiled, or loaded compiled,
  before the server answers; torch threads from ``OMP_NUM_THREADS``; this script's ``--eager``:
  the server's, which decodes step by step in Python);
- llama.cpp: ``llama-server -m FILE -np PARALLEL -cb -t THREADS -tb THREADS -c CTX``, built once
  by benchmarks/llamacpp_build.py; ``CTX`` gives each of the ``PARALLEL`` slots room for a
  prompt and its tokens (``-c`` is shared among the slots).

The clients are benchmarks/serving.py's: the official ``openai`` async client streaming
``/v1/completions`` from this process, each stream a different slice of this Python's
standard-library source as token ids, greedy (``temperature`` 0), ``max_tokens`` = ``--tokens``.
End-of-text is kept from ending a stream on both sides: dikkat gets ``logit_bias`` −100 on the
tokenizer's end ids, llama-server ``ignore_eos: true`` (which biases every end-of-generation
token to −∞; tools/server/server-schema.cpp in llama.cpp); a round whose streams got fewer
tokens stops the run. Each server is warmed first with ``max(--streams)`` streams of 4 tokens.

Per stream count and round the two engines take turns, the order alternating, while the other
server is idle; both are sent the same prompts, and no prompt is sent to one server twice (so
neither engine's prefix cache helps). Aggregate tokens/s = every stream's tokens / the wall time
from the first request to the last token's chunk (llama-server closes a stream with one more
chunk that holds no token, not counted); each figure is the median of ``--rounds``. The JSON
(benchmarks/results/serving-llamacpp.json) keeps every round's figures, with time to first
token and inter-token latency, and the load average before and after.

Run it on an otherwise idle machine: llama.cpp's threads meet at a barrier after each operation
of the graph (``ggml_barrier`` in ggml/src/ggml-cpu/ggml-cpu.c), so every operation waits for
the thread whose core another process has taken; with one of the cores taken, llama-server's
tokens/s can fall far more than dikkat's, and the ratio then says more about the load than about
the engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from common import save_json
from llamacpp_build import VERSION, LlamaCppError, build_llamacpp, cache_dir
from serving import STDLIB, Prompts, Server, free_port, streams_round

ENGINES = ("llama-server", "dikkat")


class LlamaServer(Server):
    """``llama-server`` on ``path`` in its own process, on a free port (:class:`Server`'s
    :meth:`wait` and :meth:`stop`)."""

    def __init__(self, bins: Path, path: Path, parallel: int, ctx: int, threads: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkdtemp()) / "llama-server.log"
        self.command = [str(bins / "llama-server"), "-m", str(path), "-np", str(parallel), "-cb",
                        "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                        "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        with open(self.log, "w") as out:
            self._process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)


def slot_context(prompt: int, tokens: int) -> int:
    """A slot's context: the prompt and its tokens, rounded up to a multiple of 256."""
    return -(-(prompt + tokens) // 256) * 256


def prompt_text(path: Path) -> tuple[list[int], list[int]]:
    """The standard-library text as the file's token ids, and the tokenizer's end ids (only the
    tokenizer is read: the weights are the servers')."""
    from dikkat.pretrained.gguf_file import GGUFFile
    from dikkat.pretrained.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text(encoding="utf-8") for name in STDLIB)
    return tokenizer.encode(text, add_special=False), sorted(tokenizer.eos_ids)


def startup_line(server: Server) -> str:
    """What ``dikkat serve`` printed on starting: the model, its cache and its weight format."""
    lines = [x for x in server.log.read_text().splitlines() if x.startswith("dikkat:")]
    return lines[-1] if lines else ""


def one_model(name: str, bins: Path, args: argparse.Namespace, counts: list[int]) -> dict:
    """Both servers on one model's file: every round's figures, and their medians."""
    from dikkat.pretrained.sources import resolve

    path = resolve(name).path
    print(f"{name}: {path}", flush=True)
    text, ends = prompt_text(path)
    ctx = args.parallel * slot_context(args.prompt, args.tokens)
    llama = LlamaServer(bins, path, args.parallel, ctx, args.threads)
    servers: dict[str, Server] = {"llama-server": llama}
    try:  # both load at once; each waits its turn while the other is measured
        extra_args = ("--eager",) if args.eager else ()
        servers["dikkat"] = Server(str(path), args.parallel, args.threads, extra_args)
        for server in servers.values():
            server.wait()
        started = startup_line(servers["dikkat"])
        print(f"  {started}", flush=True)
        extra = {"dikkat": None, "llama-server": {"ignore_eos": True}}
        bias = {"dikkat": {str(i): -100.0 for i in ends}, "llama-server": {}}
        prompts = Prompts(text, args.prompt)
        load_before = os.getloadavg()
        for engine, server in servers.items():  # warm: first requests, every batch row
            streams_round(server.url, prompts.take(max(counts)), 4, bias[engine], extra[engine])
        rounds: dict[str, dict[int, list[dict]]] = {e: {n: [] for n in counts} for e in ENGINES}
        for r in range(args.rounds):
            for i, n in enumerate(counts):
                batch = prompts.take(n)  # the same prompts for both, new to each
                for engine in ENGINES[:: 1 if (r + i) % 2 == 0 else -1]:
                    url = servers[engine].url
                    row = streams_round(url, batch, args.tokens, bias[engine], extra[engine])
                    rounds[engine][n].append(row)
                    print(f"  round {r + 1}, {n} streams, {engine:>12}: "
                          f"{row['tokens_per_s']:7.1f} tok/s", flush=True)  # fmt: skip
        load_after = os.getloadavg()
        print(f"  load average (1 minute) {load_before[0]:.2f} → {load_after[0]:.2f}")
    finally:
        for server in servers.values():
            server.stop()
    medians = {
        e: {n: statistics.median(x["tokens_per_s"] for x in rs) for n, rs in per.items()}
        for e, per in rounds.items()
    }
    return {
        "file": str(path),
        "dikkat_server": started,
        "llama_server_command": llama.command,
        "load_average": {"start": load_before, "end": load_after},  # 1, 5, 15 minutes
        "rounds": {e: {str(n): rs for n, rs in per.items()} for e, per in rounds.items()},
        "tokens_per_s": {e: {str(n): v for n, v in m.items()} for e, m in medians.items()},
    }


def table(models: dict[str, dict], counts: list[int]) -> str:
    """Markdown: one row per model and stream count, both engines' aggregate tok/s."""
    lines = [
        "| model | streams | llama-server tok/s | dikkat tok/s | dikkat / llama-server |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in models.items():
        for n in counts:
            ll, dk = (m["tokens_per_s"][e][str(n)] for e in ENGINES)
            lines.append(f"| {name} | {n} | {ll:.1f} | {dk:.1f} | {dk / ll:.2f} |")
    for name, m in models.items():
        start, end = (m["load_average"][k][0] for k in ("start", "end"))
        lines.append(f"\n{name}: load average (1 minute) {start:.2f} → {end:.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--models", default="smollm2,gemma3-270m", help="names or .gguf files, comma-separated")
    add("--streams", default="1,4,8", help="concurrent streams, a list")
    add("--tokens", type=int, default=128, help="new tokens per stream")
    add("--prompt", type=int, default=16, help="prompt tokens per stream")
    add("--rounds", type=int, default=2, help="interleaved rounds; the medians are reported")
    add("--parallel", type=int, default=8, help="llama-server -np, dikkat serve --max-batch")
    add("--threads", type=int, default=2, help="both servers' threads")
    add("--eager", action="store_true", help="dikkat serve --eager")
    add("--llamacpp-version", default=VERSION, help="the llama-cpp-python sdist's version")
    add("--cache", type=Path, default=cache_dir(), help="where llama.cpp is built")
    args = parser.parse_args(argv)
    for flag in ("rounds", "parallel", "threads", "prompt"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (a decode rate needs two tokens)")
    try:
        args.counts = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams takes whole numbers, comma-separated, got {args.streams!r}")
    if min(args.counts) < 1 or max(args.counts) > args.parallel:
        parser.error(f"--streams {args.streams} must lie in 1 … --parallel {args.parallel}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        bins = build_llamacpp(args.cache, args.llamacpp_version)
    except LlamaCppError as e:
        raise SystemExit(f"serving_llamacpp.py: {e}") from None
    models = {name: one_model(name, bins, args, args.counts) for name in args.models.split(",")}
    report = (
        f"Aggregate tokens/s, median of {args.rounds} rounds: {args.prompt}-token prompts, "
        f"{args.tokens} greedy tokens a stream, {args.threads} threads each, "
        f"llama-server -np {args.parallel} -cb, dikkat serve --max-batch {args.parallel}"
        f"{' --eager' if args.eager else ''}:\n\n"
        f"{table(models, args.counts)}\n"
    )
    print("\n" + report)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "models": models}
    written = save_json("serving-llamacpp", {**result, "report": report})
    print(f"wrote {written}")
    return result


if __name__ == "__main__":
    main()
