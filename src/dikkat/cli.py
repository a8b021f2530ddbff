"""The ``dikkat`` command line.

Every subcommand has ``--help`` with examples; a bad argument ends with one line on stderr
(``dikkat: error: …``) and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from dikkat import __version__
from dikkat.argtypes import add_no_verify, non_negative_float, positive_int, probability
from dikkat.bench.cli import add_bench_commands
from dikkat.training.cli import add_training_commands
from dikkat.vision.cli import add_vision_commands

EXAMPLES = """examples:
  dikkat demo                                   train a GPT, watch it learn, sample from it
  dikkat seeds                                  the seeds' numbers on real tensors
  dikkat train --task translate --steps 3000    digits → English words, Seq2Seq
  dikkat translate runs/translate 4721 90210    use the trained translator
  dikkat leak-demo                              what training without the causal mask does
  dikkat generate runs/gpt "def main(" -n 200   continue a prompt with a trained GPT
  dikkat generate --hf-gpt2 ./gpt2 "Hello" -n 40 --temperature 0.8 --top-p 0.9
  dikkat embed "a cat" "a dog"                  MiniLM sentence embeddings
  dikkat similar "a feline" "a cat" "a car"     rank sentences by similarity
  dikkat bench attention --quick                attention backends side by side, time and memory
  dikkat bench cost                             what the n × n score matrix weighs
  dikkat --version
"""


def _fmt(values, digits: int = 2) -> str:
    return "(" + ", ".join(f"{float(x):.{digits}f}" for x in values) + ")"


def cmd_seeds(args: argparse.Namespace) -> int:
    """Print each seed number we compute beside the number the seed states."""
    from dikkat.seeds import (
        SEED_CLAIMS,
        causal_exercise,
        scaling_experiment,
        torch_mha_facts,
        worked_example,
    )

    def row(label: str, ours: str, seed: str) -> None:
        print(f"  {label:<28} {ours:<34} seed: {seed}")

    print("dikkat seeds — the seeds' numbers, computed\n")
    print("S2  worked example, d_k = 2 (softmax(QKᵀ/√2)V, reference backend, float64)")
    ex = worked_example()
    row("A's scores (A←A, A←B)", _fmt(ex.scores[0], 3), SEED_CLAIMS["S2 A scores"])
    row("A's weights", _fmt(ex.weights[0]), SEED_CLAIMS["S2 A weights"])
    row("o_A", _fmt(ex.outputs[0]), SEED_CLAIMS["S2 o_A"])
    row("B's scores (B←A, B←B)", _fmt(ex.scores[1], 3), SEED_CLAIMS["S2 B scores"])
    row("B's weights", _fmt(ex.weights[1]), SEED_CLAIMS["S2 B weights"])
    row("o_B", _fmt(ex.outputs[1]), "closer to B's value [0, 1]")

    print("\nS4  causal mask, 3 tokens: cells set to −∞ (x) — queries down, keys across")
    for i, r in enumerate(causal_exercise(3).tolist()):
        print(
            "  "
            + " ".join("x" if c else "." for c in r)
            + ("   " + SEED_CLAIMS["S4"] if i == 0 else "")
        )

    s = scaling_experiment(d_k=args.d_k)
    print(f"\nS3  why divide by √d_k: d_k = {s.d_k}, {s.n_keys} keys, unit-variance q and k")
    row(
        "score variance",
        f"unscaled {s.score_var_unscaled:.1f}, scaled {s.score_var_scaled:.2f}",
        f"grows with d_k ({s.d_k}) vs ≈ 1",
    )
    row(
        "mean largest weight",
        f"unscaled {s.max_weight_unscaled:.2f}, scaled {s.max_weight_scaled:.2f}",
        SEED_CLAIMS["S3"],
    )
    row(
        "mean entropy (nats)",
        f"unscaled {s.entropy_unscaled:.2f}, scaled {s.entropy_scaled:.2f}",
        f"uniform would be {math.log(s.n_keys):.2f}",
    )

    print("\nS13 torch.nn.MultiheadAttention script, run through MultiHeadAttention.from_torch")
    f = torch_mha_facts()
    row("weights shape", str(f.weights_shape), SEED_CLAIMS["S13 shape"])
    row("same outputs after shuffling", str(f.shuffle_equal), SEED_CLAIMS["S13 shuffle"])
    row("max |ours − torch| output", f"{f.max_output_diff:.1e}", "(ours must match torch)")
    print(
        f"  causal weights (ours; max |ours − torch| = "
        f"{(f.causal_weights_ours - f.causal_weights_torch).abs().max().item():.1e}):"
    )
    for r in f.causal_weights_ours.tolist():
        print("    " + " ".join(f"{x:.2f}" for x in r))
    print(f"  {'':<28} {'':<34} seed: {SEED_CLAIMS['S13 causal']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Continue a prompt, printing tokens as they come."""
    import torch

    from dikkat.generation import iter_generate
    from dikkat.text import load_tokenizer

    if (args.checkpoint is None) == (args.hf_gpt2 is None):
        raise ValueError("give either a CHECKPOINT directory or --hf-gpt2 PATH")
    if args.hf_gpt2 is not None:
        from dikkat.interop import load_hf_gpt2_dir

        model = load_hf_gpt2_dir(args.hf_gpt2)
        tokenizer = load_tokenizer(args.hf_gpt2)
    else:
        from dikkat.models import GPT

        model = GPT.load(args.checkpoint, verify=not args.no_verify)
        tokenizer = _tokenizer_of(args.checkpoint, model.config.vocab_size, not args.no_verify)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model only "
            f"{model.config.vocab_size:,}: they do not belong together"
        )
    model.eval()
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
    with torch.inference_mode():
        for token in iter_generate(
            model,
            [prompt],
            steps,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=args.eos_id,
            seed=args.seed,
        ):
            new.append(int(token[0]))
            text = tokenizer.decode(new)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
    sys.stdout.write(tokenizer.decode(new)[len(shown) :] + "\n")
    return 0


def _tokenizer_of(folder: str, vocab_size: int, verify: bool) -> Any:
    """A model folder's or run's tokenizer. A model saved with ``save()`` alone has none; for a
    byte-level model (256 ids) that can only mean bytes, any other size is an error."""
    from dikkat import runs
    from dikkat.text import ByteTokenizer, load_tokenizer

    try:
        return load_tokenizer(folder, verify=verify)
    except FileNotFoundError:
        if runs.folder_kind(folder) == "model" and vocab_size == ByteTokenizer.vocab_size:
            return ByteTokenizer()
        raise


def cmd_embed(args: argparse.Namespace) -> int:
    """Print one JSON list per sentence: its 384-dim MiniLM embedding."""
    import json

    from dikkat.pretrained import minilm

    for row in minilm().encode(args.sentences).tolist():
        print(json.dumps([round(x, args.digits) for x in row]))
    return 0


def cmd_similar(args: argparse.Namespace) -> int:
    """Rank candidate sentences by cosine similarity to the query."""
    from dikkat.pretrained import minilm

    for score, text in minilm().similar(args.query, args.candidates):
        print(f"{score:7.4f}  {text}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage dump
        self.exit(2, f"dikkat: error: {message} (see `dikkat --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dikkat",
        description="Attention and the Transformer, end to end.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dikkat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    seeds = sub.add_parser(
        "seeds",
        help="the seeds' numbers, computed on real tensors",
        description="Walk through the seeds on real tensors: the worked example (S2), the causal "
        "mask (S4), √d_k scaling (S3) and the nn.MultiheadAttention facts (S13).",
        epilog="example:\n  dikkat seeds\n  dikkat seeds --d-k 128",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    seeds.add_argument(
        "--d-k", type=positive_int, default=64, help="head dim for the S3 scaling experiment"
    )
    seeds.set_defaults(func=cmd_seeds)
    add_training_commands(sub)
    add_vision_commands(sub)
    add_bench_commands(sub)

    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a GPT (streams tokens)",
        description="Continue PROMPT with a dikkat GPT checkpoint or a locally saved Hugging Face "
        "GPT-2, one token at a time over a KV cache. Greedy unless --temperature > 0.",
        epilog="examples:\n  dikkat generate runs/gpt 'import os' -n 100\n"
        "  dikkat generate --hf-gpt2 ./gpt2 'Hello, my name is' -n 40 --temperature 0.8 --top-k 50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("checkpoint", nargs="?", help="directory written by model.save / dikkat train")
    gen.add_argument("prompt", help="text to continue")
    gen.add_argument("--hf-gpt2", metavar="PATH", help="an HF GPT-2 directory (save_pretrained)")
    gen.add_argument("-n", "--max-new-tokens", type=positive_int, default=100)
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=positive_int, default=None)
    gen.add_argument("--top-p", type=probability, default=None)
    gen.add_argument("--eos-id", type=int, default=None, help="stop at this token id")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    add_no_verify(gen)
    gen.set_defaults(func=cmd_generate)

    embed = sub.add_parser(
        "embed",
        help="sentence embeddings from the real all-MiniLM-L6-v2",
        description="Print each sentence's 384-dim, L2-normalised MiniLM embedding as a JSON list.",
        epilog="example:\n  dikkat embed 'a cat sits on the mat' 'attention is all you need'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("sentences", nargs="+")
    embed.add_argument("--digits", type=positive_int, default=6, help="decimals to print")
    embed.set_defaults(func=cmd_embed)

    similar = sub.add_parser(
        "similar",
        help="rank sentences by similarity to a query (MiniLM)",
        description="Rank CANDIDATES by cosine similarity of their MiniLM embeddings to QUERY.",
        epilog="example:\n  dikkat similar 'a feline on a rug' 'a cat on a mat' 'prices fell'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    similar.add_argument("query")
    similar.add_argument("candidates", nargs="+")
    similar.set_defaults(func=cmd_similar)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from dikkat.training.trainer import DivergedError, TrainingInterrupted

    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"dikkat: error: {e}", file=sys.stderr)
        return 2
    except DivergedError as e:
        print(f"dikkat: error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:  # the run is saved: say where, no traceback
        print(f"\ndikkat: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("\ndikkat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
