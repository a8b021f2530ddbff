"""``dikkat generate``, ``fill-mask``, ``embed`` and ``similar``: use a trained or pretrained
text model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dikkat import runs
from dikkat.cli.args import (
    add_no_verify,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
)
from dikkat.cli.chat import load_pretrained, sampling
from dikkat.cli.common import (
    add_command,
    add_device,
    add_eager_argument,
    device_of,
    require_extra,
    utf8_text,
)
from dikkat.cli.folders import load_model
from dikkat.generation import WEIGHT_FORMATS, LookupStats, iter_generate, iter_lookup_generate
from dikkat.interop import load_hf_gpt2_dir
from dikkat.models import BERT, GPT
from dikkat.tasks.mlm import MASK, fill_mask
from dikkat.text import ByteTokenizer, load_tokenizer


def cmd_generate(args: argparse.Namespace) -> int:
    """Continue a prompt, printing tokens as they come."""
    device = device_of(args)
    sources = [s for s in (args.checkpoint, args.hf_gpt2, args.model) if s is not None]
    if not sources and Path(args.prompt).is_dir():
        raise ValueError(f"no prompt given: dikkat generate {args.prompt} 'the text to continue'")
    if len(sources) != 1:
        raise ValueError("give one of a CHECKPOINT directory, --hf-gpt2 PATH or --model MODEL")
    if args.model is not None:
        return _generate_pretrained(args)
    if args.lookup is not None and (args.temperature or 0) > 0:
        raise ValueError(
            f"--lookup decodes greedily; it cannot sample at --temperature {args.temperature} "
            "(drop one of them)"
        )
    if args.hf_gpt2 is not None:
        model = load_hf_gpt2_dir(args.hf_gpt2)
        tokenizer = load_tokenizer(args.hf_gpt2)
    else:
        model = load_model(
            GPT, args.checkpoint, "generate", verify=not args.no_verify, device=device
        )
        tokenizer = _tokenizer_of(args.checkpoint, model.config.vocab_size, not args.no_verify)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model only "
            f"{model.config.vocab_size:,}: they do not belong together"
        )
    model.to(device).eval()
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    room = model.config.max_len - len(prompt)
    if room <= 0:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; the model's context is {room + len(prompt)}"
        )
    steps = min(args.max_new_tokens, room)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    new: list[int] = []
    shown = ""
    stats = LookupStats()
    with torch.inference_mode():
        tokens = (
            iter_generate(
                model,
                [prompt],
                steps,
                temperature=args.temperature or 0.0,
                top_k=args.top_k,
                top_p=args.top_p,
                eos_id=args.eos_id,
                seed=args.seed,
                repetition_penalty=args.repetition_penalty or 1.0,
                weights=args.weights,
            )
            if args.lookup is None
            else iter_lookup_generate(
                model,
                [prompt],
                steps,
                k=args.lookup,
                eos_id=args.eos_id,
                weights=args.weights,
                stats=stats,
            )
        )
        for token in tokens:
            new.append(int(token[0]))
            text = tokenizer.decode(new)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
    sys.stdout.write(tokenizer.decode(new)[len(shown) :] + "\n")
    if args.lookup is not None:
        print(
            f"lookup: {stats.tokens} tokens in {stats.calls} model calls "
            f"({stats.tokens_per_call:.2f} a call); {stats.accepted} of {stats.drafted} "
            f"guessed tokens accepted",
            file=sys.stderr,
        )
    return 0


def _generate_pretrained(args: argparse.Namespace) -> int:
    """``--model``: continue the prompt with a pretrained decoder (dikkat.pretrained.load)."""
    if args.lookup is not None or args.eos_id is not None:
        flag = "--lookup" if args.lookup is not None else "--eos-id"
        raise ValueError(f"{flag} is for dikkat's own GPTs; --model stops at its own end tokens")
    lm = load_pretrained(args, args.weights)
    sys.stdout.write(args.prompt)
    for piece in lm.stream(args.prompt, **sampling(args, lm)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _tokenizer_of(folder: str, vocab_size: int, verify: bool) -> Any:
    """A model folder's or run's tokenizer. A model saved with ``save()`` alone has none; for a
    byte-level model (256 ids) that can only mean bytes, any other size is an error."""
    try:
        return load_tokenizer(folder, verify=verify)
    except FileNotFoundError:
        if runs.folder_kind(folder) == "model" and vocab_size == ByteTokenizer.vocab_size:
            return ByteTokenizer()
        raise


def cmd_fill_mask(args: argparse.Namespace) -> int:
    """Print the text with each [MASK] filled, then the top guesses for each."""
    model = load_model(
        BERT, args.run, "fill-mask", verify=not args.no_verify, device=device_of(args)
    )
    tokenizer = load_tokenizer(args.run, verify=not args.no_verify)
    filled = fill_mask(model, tokenizer, args.text, top_k=args.top_k)
    print(filled.text)
    for i, guesses in enumerate(filled.guesses):
        shown = "   ".join(f"{text!r} {p:.3f}" for text, p in guesses)
        print(f"{MASK} {i + 1}: {shown}")
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """Print one JSON list per sentence: its 384-dim MiniLM embedding."""
    require_extra("minilm", "embed")
    from dikkat.pretrained.minilm import minilm  # loaded when a command runs (see dikkat.cli)

    for row in minilm(device_of(args)).encode(args.sentences).tolist():
        print(json.dumps([round(x, args.digits) for x in row]))
    return 0


def cmd_similar(args: argparse.Namespace) -> int:
    """Rank candidate sentences by cosine similarity to the query."""
    require_extra("minilm", "similar")
    from dikkat.pretrained.minilm import minilm  # loaded when a command runs (see dikkat.cli)

    for score, text in minilm(device_of(args)).similar(args.query, args.candidates):
        print(f"{score:7.4f}  {text}")
    return 0


def add_commands(sub: Any) -> None:
    gen = add_command(
        sub,
        "generate",
        cmd_generate,
        help="continue a prompt with a GPT (streams tokens)",
        description="Continue PROMPT with a dikkat GPT run or model folder, a locally saved "
        "Hugging Face GPT-2, or a pretrained decoder (--model: SmolLM2, Gemma 3, any Llama-family "
        "GGUF file or HF folder), one token at a time over a KV cache. Greedy unless "
        "--temperature > 0.",
        examples=[
            ('dikkat generate runs/gpt "import os" -n 100', "a GPT trained with dikkat train"),
            ("dikkat generate --hf-gpt2 ./gpt2 'Hello, my name is' -n 40 --temperature 0.8", ""),
            ('dikkat generate runs/gpt "import os" --weights int8', "int8 weights: faster"),
            ('dikkat generate runs/gpt "import os" --lookup 8', "guess 8 tokens from the text"),
            ('dikkat generate --model gemma3-270m "The capital of France is"', "a real model"),
        ],
    )
    gen.add_argument("checkpoint", nargs="?", help="a run or model folder (dikkat train, save)")
    gen.add_argument("prompt", type=utf8_text, help="text to continue")
    gen.add_argument("--hf-gpt2", metavar="PATH", help="an HF GPT-2 directory (save_pretrained)")
    gen.add_argument(
        "--model",
        metavar="MODEL",
        help="a pretrained decoder: a name (smollm2, gemma3-270m), a .gguf file or an HF folder",
    )
    gen.add_argument("-n", "--max-new-tokens", type=positive_int, default=100)
    gen.add_argument(
        "--temperature",
        type=non_negative_float,
        help="0 = greedy; default: 0, or with --model what the model's files suggest",
    )
    gen.add_argument("--top-k", type=positive_int, default=None)
    gen.add_argument("--top-p", type=probability, default=None)
    gen.add_argument(
        "--repetition-penalty",
        type=positive_float,
        help="a token already in the text has its logit divided by this (multiplied where "
        "negative); default: with --model what the model's files suggest, else 1 (none)",
    )
    gen.set_defaults(default_repetition_penalty=1.0)
    gen.add_argument("--eos-id", type=int, default=None, help="stop at this token id")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    gen.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="format the linear layers multiply in while generating: fp32 (as trained), bf16, "
        "int8 (per-channel, weight-only), w8a8 (int8 weights, 8-bit inputs, x86 CPUs), q8 or q4 "
        "(blocks of 32, as GGUF's Q8_0 and Q4_0); default: fp32, or a GGUF file's own "
        "quantisation with --model; the saved weights are not changed",
    )
    gen.add_argument(
        "--lookup",
        type=positive_int,
        metavar="K",
        default=None,
        help="prompt-lookup decoding (greedy only): each model call checks up to K tokens "
        "guessed by matching the last tokens against the prompt and the text so far; the same "
        "tokens as plain greedy, in fewer calls (counts printed to stderr)",
    )
    add_eager_argument(gen)
    add_device(gen)
    add_no_verify(gen)

    fill = add_command(
        sub,
        "fill-mask",
        cmd_fill_mask,
        help=f"fill each {MASK} in a text with a BERT trained by --task mlm",
        description=f"Predict every {MASK} in TEXT (one token each) with a BERT run of "
        "`dikkat train --task mlm`: the text with the best guesses, then the top guesses and "
        "their probabilities for each mask.",
        examples=[(f"dikkat fill-mask runs/mlm 'def f(x): return {MASK}'", "one token a mask")],
    )
    fill.add_argument("run", help="run folder of `dikkat train --task mlm`")
    fill.add_argument("text", help=f"text with one or more {MASK}")
    fill.add_argument("--top-k", type=positive_int, default=5, help="guesses shown per mask")
    add_device(fill)
    add_no_verify(fill)

    embed = add_command(
        sub,
        "embed",
        cmd_embed,
        help="sentence embeddings from the real all-MiniLM-L6-v2",
        description="Print each sentence's 384-dim, L2-normalised MiniLM embedding as a JSON list.",
        examples=[("dikkat embed 'a cat sits on the mat' 'attention is all you need'", "")],
    )
    embed.add_argument("sentences", nargs="+")
    embed.add_argument("--digits", type=positive_int, default=6, help="decimals to print")
    add_device(embed)

    similar = add_command(
        sub,
        "similar",
        cmd_similar,
        help="rank sentences by similarity to a query (MiniLM)",
        description="Rank CANDIDATES by cosine similarity of their MiniLM embeddings to QUERY.",
        examples=[("dikkat similar 'a feline on a rug' 'a cat on a mat' 'prices fell'", "")],
    )
    similar.add_argument("query")
    similar.add_argument("candidates", nargs="+")
    add_device(similar)
