"""``dikkat audit``: check a model's causality and masks, its KV cache and its use of positions
(docs/audit.md)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dikkat import audit
from dikkat.audit import Report
from dikkat.cli.args import add_no_verify, positive_int
from dikkat.cli.common import add_command, add_device, device_of, require_extra
from dikkat.cli.folders import held, load_model
from dikkat.core.masks import causal, document, full, padding
from dikkat.models import BERT, GPT, Decoder, Seq2Seq

Audit = Callable[[], Report]


def _sizes(args: argparse.Namespace, context: int | None) -> dict[str, int]:
    T = args.seq_len if context is None else min(args.seq_len, context)
    return {"seq_len": T, "batch": args.batch, "trials": args.trials, "seed": args.seed}


def _probe(args: argparse.Namespace) -> dict[str, int | None]:
    """The mask audits' extra settings: the token values each key takes."""
    return {"values": args.values}


def _tiled(rows: Tensor, ids: Tensor) -> Tensor:
    """``rows`` (B, …) repeated to the rows of ``ids``: the audit stacks copies of its B rows
    (row r a copy of row r mod B) to try several token values in one call."""
    return rows.repeat(ids.shape[0] // rows.shape[0], *[1] * (rows.dim() - 1))


def _encode_padded(model: BERT, valid: Tensor, ids: Tensor) -> Tensor:
    return model.encode(ids, _tiled(valid, ids))


def _decode_given(model: Seq2Seq, src: Tensor, tgt: Tensor) -> Tensor:
    return model(_tiled(src, tgt), tgt)


def _random_ids(vocab_size: int, sizes: dict[str, int], device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(sizes["seed"])
    return torch.randint(0, vocab_size, (sizes["batch"], sizes["seq_len"]), generator=gen).to(
        device
    )


def gpt_audits(model: GPT, args: argparse.Namespace) -> list[Audit]:
    """Causality; a packed batch of two documents, audited against ``causal() & document``;
    cached decoding; and positions (the last output changes when the tokens before it are
    permuted)."""
    c, device = model.config, model.tok_emb.weight.device
    s = _sizes(args, c.max_len)
    T, V = s["seq_len"], c.vocab_size
    packed = causal() & document((torch.arange(T) >= T // 2).long().to(device))
    p = _probe(args)
    return [
        lambda: audit.causality(model, V, **s, **p),
        lambda: audit.mask(partial(model, mask=packed), packed, V, **s, **p, name="documents"),
        lambda: audit.kv_cache(model, V, T, batch=s["batch"], seed=s["seed"]),
        lambda: audit.permutation(model, _random_ids(V, s, device), causal=True, expect=False),
    ]


def bert_audits(model: BERT, args: argparse.Namespace) -> list[Audit]:
    """Bidirectional (every key read), right padding hidden, and positions used."""
    c, device = model.config, model.tok_emb.weight.device
    s = _sizes(args, c.max_len)
    T, V = s["seq_len"], c.vocab_size
    valid = torch.ones(s["batch"], T, dtype=torch.bool, device=device)
    valid[1:, T - T // 4 :] = False  # every row after the first ends in padding
    encode, p = model.encode, _probe(args)
    return [
        lambda: audit.mask(encode, full(), V, **s, **p, name="bidirectional"),
        lambda: audit.mask(
            partial(_encode_padded, model, valid), padding(valid=valid), V, **s, **p, name="padding"
        ),
        lambda: audit.permutation(encode, _random_ids(V, s, device), expect=False),
    ]


def seq2seq_audits(model: Seq2Seq, args: argparse.Namespace) -> list[Audit]:
    """The decoder's causality, given a fixed random source."""
    c, device = model.config, model.tgt_emb.weight.device
    s = _sizes(args, c.max_len)
    src = _random_ids(c.src_vocab_size, s, device)
    decode = partial(_decode_given, model, src)
    return [
        lambda: audit.causality(
            decode, c.tgt_vocab_size, **s, **_probe(args), embedding=model.tgt_emb
        )
    ]


def hf_audits(model: Any, args: argparse.Namespace) -> list[Audit]:
    """Causality (gradients through ``get_input_embeddings()``), cached decoding, and whether
    it sees positions (reported, not judged: some models have none)."""
    c = model.config
    s = _sizes(args, getattr(c, "max_position_embeddings", None))
    device = model.get_input_embeddings().weight.device
    V = c.vocab_size
    return [
        lambda: audit.causality(model, V, **s, **_probe(args)),
        lambda: audit.kv_cache(model, V, s["seq_len"], batch=s["batch"], seed=s["seed"]),
        lambda: audit.permutation(model, _random_ids(V, s, device), causal=True),
    ]


def decoder_audits(model: Decoder, args: argparse.Namespace) -> list[Audit]:
    """A pretrained decoder: causality on its final hidden states (the output head reads one
    position at a time, and over a vocabulary of 10⁵ ids it would be most of the cost), cached
    decoding, and, where it has sliding layers, every layer against its own window."""
    c, device = model.config, model.tok_emb.weight.device
    s = _sizes(args, c.max_len)
    V = c.vocab_size
    hidden = partial(model, return_hidden=True)
    audits: list[Audit] = [
        lambda: audit.causality(hidden, V, **s, **_probe(args), embedding=model.tok_emb),
        lambda: audit.kv_cache(model, V, s["seq_len"], batch=s["batch"], seed=s["seed"]),
        lambda: audit.permutation(model, _random_ids(V, s, device), causal=True),
    ]
    if c.sliding_window is not None:
        audits.append(lambda: audit.windows(model, seed=s["seed"]))
    return audits


AUDITS = {
    "GPT": (GPT, gpt_audits),
    "BERT": (BERT, bert_audits),
    "Seq2Seq": (Seq2Seq, seq2seq_audits),
}


def load_audits(args: argparse.Namespace) -> tuple[str, list[Audit]]:
    """What is audited (in words) and the audits that apply to it."""
    device = device_of(args)
    if sum(x is not None for x in (args.run, args.hf, args.model)) != 1:
        raise ValueError(
            "give one of RUN_DIR (a dikkat run or model folder), --hf PATH or --model MODEL"
        )
    if args.seq_len < 3:
        raise ValueError(
            f"--seq-len must be at least 3 (the permutation audit moves the tokens before the "
            f"last), got {args.seq_len}"
        )
    if args.model is not None:
        from dikkat.pretrained import load  # loaded when a command runs (see dikkat.cli)

        print(f"dikkat: loading {args.model} …", file=sys.stderr, flush=True)
        lm = load(args.model, device=device, weights="fp32")  # gradients need a plain model
        return f"{args.model} ({lm!r})", decoder_audits(lm.model, args)
    if args.hf is not None:
        path = Path(args.hf)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds no config.json: not a Hugging Face model folder")
        require_extra("hf", "audit --hf")
        from transformers import AutoModelForCausalLM  # optional: only `--hf` needs it

        model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        return f"{path} (Hugging Face {type(model).__name__})", hf_audits(model, args)
    what = held(args.run)
    if what.model not in AUDITS:
        hint = f": use dikkat audit --hf {what.path}" if what.hf_model_type else ""
        raise ValueError(
            f"{what.path} holds {what.describe()}; dikkat audit reads a GPT, a BERT or a "
            f"Seq2Seq (text models over token ids){hint}"
        )
    cls, audits = AUDITS[what.model]
    model = load_model(cls, args.run, "audit", verify=not args.no_verify, device=device).eval()
    return f"{what.path} ({what.describe()})", audits(model, args)


def cmd_audit(args: argparse.Namespace) -> int:
    """Run the audits that apply, print a table; exit 1 if any failed."""
    subject, audits = load_audits(args)
    reports = []
    for i, run in enumerate(audits, 1):  # some take a minute on a real model: say which runs
        print(f"dikkat: audit {i}/{len(audits)} …", file=sys.stderr, flush=True)
        start = time.perf_counter()
        reports.append(run())
        print(f"dikkat: audit {i}/{len(audits)}, {reports[-1].name}: "
              f"{'ok' if reports[-1].ok else 'FAILED'} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    width = max(len(r.name) for r in reports)
    print(f"dikkat audit of {subject}")
    print(f"  {'audit':<{width}}  {'result':<6}  what was found")
    for r in reports:
        print(f"  {r.name:<{width}}  {'ok' if r.ok else 'FAILED':<6}  {r.summary()}")
    print("\nwhat was checked:")
    for r in reports:
        print(f"  {r.name:<{width}}  {r.coverage()}")
    for r in reports:
        if not r.ok:
            print(f"\n{r}")
    return 0 if all(r.ok for r in reports) else 1


def add_commands(sub: Any) -> None:
    p = add_command(
        sub,
        "audit",
        cmd_audit,
        help="check causality, masks, the KV cache and positions of a model",
        description="Probe a dikkat run or model folder, or a local Hugging Face causal LM, with "
        "random tokens, on a float64 copy: set each position to many token ids (every id of "
        "a small vocabulary) and follow the gradients through the token embedding to find "
        "every output that depends on a token its mask hides, beyond 1e-9 of that output's "
        "own dependence on what it may see; check that decoding through the KV cache gives "
        "the full forward's logits, and whether the model sees positions. Prints a table and "
        "what each audit varied and its tolerance; exits 1 when an audit fails.",
        examples=[
            ("dikkat audit runs/gpt", "causality, packed documents, KV cache, positions"),
            ("dikkat audit --hf ./gpt2", "a local Hugging Face causal LM (nothing downloaded)"),
            ("dikkat audit --model smollm2 --values 2 --trials 1", "a pretrained decoder"),
            ("dikkat audit runs/mlm --seq-len 12 --trials 4", "a BERT: bidirectional, padding"),
        ],
        notes="A GPT is audited for causality and against causal() & document(ids) on a batch "
        "of two packed documents; a BERT against full() and a padding mask; a Seq2Seq's decoder "
        "for causality. docs/audit.md explains each audit and how to read its report.",
    )
    p.add_argument("run", nargs="?", metavar="RUN_DIR", help="a run or model folder")
    p.add_argument("--hf", metavar="PATH", help="a Hugging Face model folder (save_pretrained)")
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="a pretrained decoder: a name (smollm2, gemma3-270m), a .gguf file or an HF folder "
        "of a Llama, Mistral, Qwen2 or Gemma 3 (dikkat.pretrained.load)",
    )
    p.add_argument("--seq-len", type=positive_int, default=16, help="positions checked (16)")
    p.add_argument(
        "--trials",
        type=positive_int,
        default=2,
        help="random batches, every key varied in each (2)",
    )
    p.add_argument(
        "--values",
        type=positive_int,
        default=None,
        help="token ids each key takes per trial (default: every id of a vocabulary up to 256, "
        "else 16 drawn; the vocabulary size tries every id)",
    )
    p.add_argument("--batch", type=positive_int, default=2, help="rows per call (2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")
    add_device(p)
    add_no_verify(p)
