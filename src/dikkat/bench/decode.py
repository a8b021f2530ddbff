"""``dikkat bench decode``: how fast a pretrained model reads a prompt and decodes on this CPU,
and how close decoding comes to the memory's read bandwidth — the job of llama.cpp's
``llama-bench`` (its ``pp`` and ``tg`` tests), in dikkat's words.

Each repetition decodes ``new_tokens`` greedily from a random prompt, never stopping at EOS, and
runs one prefill of a longer random prompt; the bytes each decoded token reads and the read
bandwidth they are compared with come from :mod:`dikkat.bench.bandwidth`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from dikkat.bench.bandwidth import (
    available_bytes,
    expert_picks,
    mean_kv_bytes,
    peak_rss_mb,
    read_bandwidth,
    weight_bytes,
)
from dikkat.bench.record import machine
from dikkat.generation import SamplingParams, iter_generate, prefill
from dikkat.validate import check_int
from dikkat.weights import InferenceLinear, inference_model

__all__ = [
    "DecodeBenchConfig",
    "DecodeBenchResult",
    "format_decode_table",
    "random_ids",
    "run_decode_benchmark",
]


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``dikkat bench decode`` runs; the defaults are its flags'."""

    prompt_tokens: int = 16  # the prompt each decode starts from
    new_tokens: int = 128  # tokens each decode produces, EOS ignored; the first is the prefill's
    prefill_tokens: int = 512  # the prompt of the prefill test
    threads: int = 2  # torch's threads, for the model and the bandwidth probe alike
    weights: str | None = None  # the linear layers' format; None: the model's own
    repeat: int = 3  # timed repetitions, after one warm-up that is not reported
    seed: int = 0  # seeds the random prompts
    probe_bytes: int = 2**30  # the buffer read to time the bandwidth (less if memory is short)
    compile: bool = False  # decode with the model's torch.compile'd static step

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "prefill_tokens", "threads", "repeat", "probe_bytes"):
            check_int(name, getattr(self, name))
        # decode speed is timed over the tokens after the first, which the prefill gives
        check_int("new_tokens", self.new_tokens, at_least=2)
        check_int("seed", self.seed, at_least=0)
        if self.weights is not None and not isinstance(self.weights, str):
            raise TypeError(f"weights must be a format name or None, got {self.weights!r}")


@dataclass(frozen=True)
class DecodeBenchResult:
    """One benchmark run: the speeds of each repetition and what they are compared against."""

    model: str  # as asked for
    weights: str  # the format the linear layers hold ("+"-joined where they differ)
    config: DecodeBenchConfig
    decode_tok_s: list[float]  # per repetition: tokens after the first / their seconds
    prefill_tok_s: list[float]  # per repetition: prefill_tokens / the prefill's seconds
    decode_tokens: list[int]  # per repetition: the tokens decoded (always new_tokens)
    weight_bytes: int  # read once per decoded token
    kv_bytes: float  # keys and values read per decoded token, averaged over the decode
    read_gb_s: float  # the probe's read bandwidth, 10⁹ bytes per second
    probe_bytes: int  # the buffer it read
    peak_rss_mb: float | None  # the process's peak resident memory before the probe, 10⁶ bytes
    # with compile: of the compiled decode's first CHECKED_TOKENS, how many the eager model
    # gives too, in order (None: not compiled)
    compiled_agrees: int | None = None
    load_s: float | None = None  # seconds to load the model (file to inference copy)
    # seconds from the first decode's start to its first token: the process's first prefill
    # (of prompt_tokens) and pick, with whatever the first call costs (a kernel's first load)
    first_token_s: float | None = None
    # a mixture of experts: the k experts a token reads of the E a layer holds (None: no mixture)
    experts: tuple[int, int] | None = None
    machine: dict[str, Any] = field(default_factory=machine)

    @property
    def bytes_per_token(self) -> int:
        return round(self.weight_bytes + self.kv_bytes)

    @property
    def bandwidth_share(self) -> float:
        """bytes per token · median decode tok/s, as a share of the read bandwidth."""
        return self.bytes_per_token * statistics.median(self.decode_tok_s) / (self.read_gb_s * 1e9)

    def as_dict(self) -> dict[str, Any]:
        """The JSON ``dikkat bench decode --json`` prints."""
        return {
            "model": self.model,
            **asdict(self.config),
            "weights": self.weights,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s_median": statistics.median(self.decode_tok_s),
            "prefill_tok_s_median": statistics.median(self.prefill_tok_s),
            "decode_tokens": self.decode_tokens,
            "bytes_per_token": self.bytes_per_token,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "read_gb_s": self.read_gb_s,
            "probe_bytes": self.probe_bytes,
            "bandwidth_share": self.bandwidth_share,
            "peak_rss_mb": self.peak_rss_mb,
            "compiled_agrees": self.compiled_agrees,
            "load_s": self.load_s,
            "first_token_s": self.first_token_s,
            "experts_read": None if self.experts is None else list(self.experts),
            "torch": self.machine["torch"],
            "cpu": self.machine["cpu"],
            "machine": self.machine,
        }


# --- the measurements --------------------------------------------------------------------------


def _time_decode(
    model: nn.Module, prompt: list[int], new_tokens: int, compile: bool = False
) -> tuple[list[int], float, float]:
    """(the tokens decoded, tok/s after the first, seconds to the first): greedy, with no stop
    token, so exactly ``new_tokens`` come (the model's EOS included, as any other token);
    ``compile``: through the model's compiled static step (the warm-up compiles it)."""
    params = SamplingParams(max_new_tokens=new_tokens)
    start = time.perf_counter()
    steps = iter_generate(model, [prompt], params, compile=compile)
    tokens = [int(next(steps)[0])]  # the prefill and the first token
    first = time.perf_counter() - start
    start = time.perf_counter()
    tokens += [int(step[0]) for step in steps]
    return tokens, (len(tokens) - 1) / (time.perf_counter() - start), first


CHECKED_TOKENS = 16  # the compiled decode's first tokens, compared with the eager model's


def _agreement(model: nn.Module, prompt: list[int], compiled: list[int]) -> int:
    """How many of the first :data:`CHECKED_TOKENS` tokens of a compiled decode the eager model
    gives too, in order (a compiled graph that computes something else shows here first;
    rounding alone rarely parts them this early)."""
    n = min(CHECKED_TOKENS, len(compiled))
    eager, _, _ = _time_decode(model, prompt, n)
    return next((i for i in range(n) if eager[i] != compiled[i]), n)


def _time_prefill(model: nn.Module, ids: list[int]) -> float:
    """tok/s of one prefill of ``ids`` into a fresh cache."""
    batch = torch.tensor([ids], device=model.cache_layout().device)  # type: ignore[operator]
    cache = model.new_cache(1, len(ids))  # type: ignore[operator]
    start = time.perf_counter()
    prefill(model, batch, cache)  # type: ignore[arg-type]
    return len(ids) / (time.perf_counter() - start)


def _special_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special ids: BOS, EOS and the end ids, pad, unknown, control tokens."""
    ids = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unk_id}
    ids |= set(tokenizer.eos_ids)
    added = tokenizer.backend.get_added_tokens_decoder()
    ids |= {i for i, token in added.items() if token.special}
    return {i for i in ids if i is not None}


def random_ids(n: int, vocab_size: int, avoid: set[int], generator: torch.Generator) -> list[int]:
    """``n`` ids drawn uniformly from [0, vocab_size) without those of ``avoid``."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in avoid if i < vocab_size]] = False
    pool = allowed.nonzero().flatten()
    if not len(pool):
        raise ValueError(f"every id of the vocabulary of {vocab_size} is special: {sorted(avoid)}")
    return pool[torch.randint(len(pool), (n,), generator=generator)].tolist()


# --- the run -----------------------------------------------------------------------------------


def _load(model: str, weights: str | None) -> tuple[nn.Module, Any]:
    """The model ``model`` names as an inference copy (its linear layers in ``weights``; None:
    the model's own format, a GGUF file's packed blocks), and its tokenizer."""
    from dikkat.pretrained import load  # it brings the GGUF reader: `dikkat --help` stays light

    lm = load(model, weights=weights)  # type: ignore[arg-type]
    net = lm.model
    if not any(isinstance(m, InferenceLinear) for m in net.modules()):
        # made once, here: generation uses a copy it is given as it is (None: fp32)
        net = inference_model(net, weights)  # type: ignore[arg-type]
    return net, lm.tokenizer


def _format_of(model: nn.Module) -> str:
    held = {m.weights_format for m in model.modules() if isinstance(m, InferenceLinear)}
    return "+".join(sorted(held))


def run_decode_benchmark(
    model: str,
    config: DecodeBenchConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> DecodeBenchResult:
    """Benchmark the pretrained model ``model`` names (anything :func:`dikkat.pretrained.load`
    takes) as ``config`` says; ``progress`` is told each step (one line each).

    One untimed warm-up of each test, then ``repeat`` repetitions of a decode of
    ``new_tokens`` from a random ``prompt_tokens`` prompt and a prefill of ``prefill_tokens``,
    interleaved; then the peak resident memory, and last the read bandwidth (whose buffer would
    otherwise raise that peak). torch's thread count is ``threads`` during the run and restored
    after it.
    """
    config = DecodeBenchConfig() if config is None else config
    say = progress or (lambda _: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(model, config, say)
    finally:
        torch.set_num_threads(threads)


def _run(source: str, config: DecodeBenchConfig, say: Callable[[str], None]) -> DecodeBenchResult:
    say(f"loading {source} …")
    start = time.perf_counter()
    model, tokenizer = _load(source, config.weights)
    load_s = time.perf_counter() - start
    weights = _format_of(model)
    say(f"loaded in {load_s:.1f} s; {weights} weights")
    _check_room(source, model, config)
    generator = torch.Generator().manual_seed(config.seed)
    vocab = min(model.config.vocab_size, tokenizer.vocab_size)  # type: ignore[union-attr]
    avoid = _special_ids(tokenizer)
    prompt = random_ids(config.prompt_tokens, vocab, avoid, generator)
    long_prompt = random_ids(config.prefill_tokens, vocab, avoid, generator)

    say("warm-up …")
    warm, _, first_token_s = _time_decode(model, prompt, config.new_tokens, config.compile)
    _time_prefill(model, long_prompt)
    agree = _agreement(model, prompt, warm) if config.compile else None
    if agree is not None:
        say(f"the compiled decode's first {min(CHECKED_TOKENS, len(warm))} tokens: the eager "
            f"model's first {agree}")  # fmt: skip
    decode: list[float] = []
    prefills: list[float] = []
    counts: list[int] = []
    for r in range(config.repeat):
        tokens, tok_s, _ = _time_decode(model, prompt, config.new_tokens, config.compile)
        counts.append(len(tokens))
        decode.append(tok_s)
        prefills.append(_time_prefill(model, long_prompt))
        say(
            f"repetition {r + 1}/{config.repeat}: decode {decode[-1]:.1f} tok/s, "
            f"prefill {prefills[-1]:.1f} tok/s"
        )
    peak = peak_rss_mb()  # before the probe's buffer raises it

    probe = config.probe_bytes
    available = available_bytes()
    if available is not None:
        probe = max(4, min(probe, available // 4))
    say(f"read bandwidth: summing {probe / 2**20:.0f} MiB of fp32, best of 3 …")
    read_gb_s = read_bandwidth(probe)
    return DecodeBenchResult(
        model=source,
        weights=weights,
        config=config,
        decode_tok_s=decode,
        prefill_tok_s=prefills,
        decode_tokens=counts,
        weight_bytes=weight_bytes(model),
        kv_bytes=mean_kv_bytes(model, config.prompt_tokens, config.new_tokens),
        read_gb_s=read_gb_s,
        probe_bytes=probe // 4 * 4,
        peak_rss_mb=peak,
        compiled_agrees=agree,
        load_s=load_s,
        first_token_s=first_token_s,
        experts=expert_picks(model),
    )


def _check_room(source: str, model: nn.Module, config: DecodeBenchConfig) -> None:
    context = model.config.max_len  # type: ignore[union-attr]
    prompt, new = config.prompt_tokens, config.new_tokens
    if prompt + new > context:
        raise ValueError(
            f"{prompt} prompt tokens + {new} new tokens = {prompt + new} positions, past the "
            "context of "
            f"{source} ({context} positions)"
        )
    if config.prefill_tokens > context:
        raise ValueError(
            f"{config.prefill_tokens} prefill tokens are past the context of {source} "
            f"({context} positions)"
        )


# --- the table ---------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.2f} s"


def format_decode_table(result: DecodeBenchResult) -> str:
    """The human-readable report of ``result``."""
    c = result.config
    reps = [f"rep {i + 1}" for i in range(c.repeat)]
    head = f"{'':<16}" + "".join(f"{r:>10}" for r in [*reps, "median"])

    def row(name: str, values: Sequence[float]) -> str:
        cells = [*values, statistics.median(values)]
        return f"{name:<16}" + "".join(f"{v:>10.1f}" for v in cells)

    mean_keys = c.prompt_tokens + c.new_tokens / 2
    peak = "unavailable" if result.peak_rss_mb is None else f"{result.peak_rss_mb:.0f} MB"
    lines = [
        f"model           {result.model}",
        f"weights         {result.weights}",
        f"threads         {c.threads}  ({result.machine['cpu']}, torch {result.machine['torch']})",
        "",
        head,
        row("decode tok/s", result.decode_tok_s),
        row("prefill tok/s", result.prefill_tok_s),
        f"  decode: {c.new_tokens} tokens after a {c.prompt_tokens}-token prompt, timed after the "
        f"first; prefill: {c.prefill_tokens} tokens",
        "",
        f"bytes/token     {result.bytes_per_token / 1e6:.2f} MB (weights "
        f"{result.weight_bytes / 1e6:.2f}, KV cache {result.kv_bytes / 1e6:.2f} at "
        f"{mean_keys:g} keys on average)",
        *(
            []
            if result.experts is None
            else [
                f"  of each layer's experts, the {result.experts[0]} of {result.experts[1]} a "
                "token picks (only those are read)"
            ]
        ),
        f"read bandwidth  {result.read_gb_s:.1f} GB/s (a sum over {result.probe_bytes / 2**20:.0f}"
        " MiB of fp32, best of 3)",
        f"share           {100 * result.bandwidth_share:.0f} % (bytes/token × median decode "
        "tok/s ÷ read bandwidth)",
        f"peak RSS        {peak}",
        f"load            {_seconds(result.load_s)}; first token {_seconds(result.first_token_s)}"
        f" (the first decode's {c.prompt_tokens}-token prefill and pick)",
    ]
    if result.compiled_agrees is not None:
        n = min(CHECKED_TOKENS, c.new_tokens)
        lines.append(f"compiled        its first {n} tokens: the eager model's first "
                     f"{result.compiled_agrees}")  # fmt: skip
    return "\n".join(lines)
