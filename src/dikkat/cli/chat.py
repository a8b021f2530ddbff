"""``dikkat chat MODEL``: a conversation with a pretrained chat model, streamed as it is written.

MODEL is what :func:`dikkat.pretrained.load` takes: a name (``smollm2``), a ``.gguf`` file or a
Hugging Face folder. ``--message`` answers once and exits (for scripts); without it the command
reads one turn a line, keeps the conversation, and ends on Ctrl-D or Ctrl-C at the prompt (Ctrl-C
while an answer is being written stops that answer).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dikkat.cli.args import non_negative_float, positive_float, positive_int, probability
from dikkat.cli.common import (
    add_command,
    add_device,
    add_eager_argument,
    compiles,
    device_of,
    utf8_text,
)
from dikkat.generation import WEIGHT_FORMATS, SamplingParams

if TYPE_CHECKING:
    from dikkat.pretrained import Pretrained

COMMANDS_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) leaves"
# chat's repetition penalty where neither a flag nor the model's files give one: ollama's
# default (https://github.com/ollama/ollama/blob/main/docs/modelfile.md, repeat_penalty); a
# small model decoding greedily otherwise loops over a paragraph
CHAT_REPETITION_PENALTY = 1.1


def load_pretrained(args: argparse.Namespace, weights: str | None = None) -> Pretrained:
    """The model ``--model``/MODEL names, in the format ``weights`` (None: as its file holds
    it; :func:`dikkat.pretrained.load`), loaded with a line on stderr saying what and how
    long."""
    from dikkat.pretrained import load  # loaded when a command runs (see dikkat.cli)
    from dikkat.training.finetune import is_finetune, load_finetuned

    print(f"dikkat: loading {args.model} …", file=sys.stderr, flush=True)
    start = time.perf_counter()
    tuned = is_finetune(args.model)  # a run of `dikkat finetune`: its base with its adapters
    if tuned and weights is not None:
        raise ValueError(f"{args.model} is a fine-tune: its base runs as its file holds it")
    if tuned:
        lm = load_finetuned(args.model)
    else:
        lm = load(args.model, device=device_of(args), weights=weights)  # type: ignore[arg-type]
    print(f"dikkat: {lm} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    lm.compile_steps = compiles(args) and not tuned  # the adapters run eagerly
    if lm.sampling_defaults:
        said = ", ".join(f"{k}={v}" for k, v in lm.sampling_defaults.items())
        print(f"dikkat: sampling as the model's files suggest: {said} (flags override)",
              file=sys.stderr)  # fmt: skip
    return lm


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "repetition_penalty", "seed")


def sampling(args: argparse.Namespace, lm: Pretrained) -> dict[str, Any]:
    """The decoding settings of the command line: ``params`` and ``weights`` keywords. A flag
    given wins; then what the model's files suggest (``lm.sampling_defaults``); then the
    command's own default (greedy; ``--repetition-penalty``'s, :func:`add_sampling_flags`)."""
    given = {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k)) is not None}
    own = {"repetition_penalty": args.default_repetition_penalty}
    settings = own | dict(lm.sampling_defaults) | given
    held = {k: _text_or_file(v) for k in ("json_schema", "regex", "grammar")
            if (v := getattr(args, k, None)) is not None}  # fmt: skip
    if getattr(args, "choice", None):
        held["choice"] = args.choice
    params = SamplingParams(max_new_tokens=args.max_new_tokens, **settings, **held)
    return dict(params=params, weights=args.weights)


def _text_or_file(value: str) -> str:
    """A constraint flag's value: the text of the file it names, else itself."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8") if len(value) < 4096 and path.is_file() else value
    except OSError as e:
        raise ValueError(f"cannot read {value}: {e}") from None


def cmd_chat(args: argparse.Namespace) -> int:
    lm = load_pretrained(args, args.weights)
    if lm.chat_template is None:
        raise ValueError(
            f"{args.model} has no chat template (a base model): continue text with "
            f"dikkat generate --model {args.model} 'TEXT'"
        )
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    if args.message is not None:
        answer(lm, [*system, {"role": "user", "content": args.message}], args, sys.stdout)
        return 0
    if isinstance(sys.stdin, io.TextIOWrapper):
        # a line that is not UTF-8 arrives as lone surrogates, refused alone (converse), instead
        # of a decoding error that ends the input, the lines before it included
        sys.stdin.reconfigure(errors="surrogateescape")
    return converse(lm, system, args, sys.stdin, sys.stdout)


def answer(lm: Pretrained, messages: list[dict], args: argparse.Namespace, out: TextIO) -> str:
    """Stream the assistant's answer to ``messages`` into ``out``; return it."""
    pieces = []
    for piece in lm.chat_stream(messages, **sampling(args, lm)):
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def converse(
    lm: Pretrained, system: list[dict], args: argparse.Namespace, inp: TextIO, out: TextIO
) -> int:
    """The interactive loop: one user turn a line, the history kept, until EOF or /exit."""
    history: list[dict] = list(system)
    if inp.isatty():
        print(f"dikkat: chatting with {args.model}; {COMMANDS_HELP}", file=sys.stderr)
    while True:
        try:
            out.write("> ")
            out.flush()
            line = inp.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as Ctrl-D does
            out.write("\n")
            return 0
        if not line:  # end of input (Ctrl-D)
            out.write("\n")
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(system)
            print("dikkat: a new conversation", file=sys.stderr)
            continue
        if not text:
            continue
        try:
            utf8_text(text)
        except argparse.ArgumentTypeError as e:
            print(f"dikkat: error: that line is {e}", file=sys.stderr)
            continue
        turn = [*history, {"role": "user", "content": text}]
        try:
            reply = answer(lm, turn, args, out)
        except KeyboardInterrupt:  # stop this answer; the turn is not kept
            out.write("\n")
            print("dikkat: answer interrupted", file=sys.stderr)
            continue
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, go on
            print(f"dikkat: error: {e} (/reset starts over)", file=sys.stderr)
            continue
        history = [*turn, {"role": "assistant", "content": reply}]


def add_sampling_flags(
    parser: argparse.ArgumentParser, max_new_tokens: int, repetition_penalty: float = 1.0
) -> None:
    """The generation flags ``chat`` and ``generate --model`` share."""
    parser.add_argument("-n", "--max-new-tokens", type=positive_int, default=max_new_tokens)
    from_file = "; default: what the model's files suggest, else "
    parser.add_argument("--temperature", type=non_negative_float, help=f"0 = greedy{from_file}0")
    parser.add_argument("--top-k", type=positive_int, help=f"the k likeliest{from_file}all")
    parser.add_argument("--top-p", type=probability, help=f"nucleus sampling{from_file}1")
    parser.add_argument(
        "--repetition-penalty",
        type=positive_float,
        help="a token already in the prompt or the answer has its logit divided by this "
        f"(multiplied where negative; 1 = none){from_file}{repetition_penalty}",
    )
    parser.set_defaults(default_repetition_penalty=repetition_penalty)
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    held = parser.add_mutually_exclusive_group()  # docs/generation.md, "Constrained decoding"
    held.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="the answer is JSON of this JSON Schema (its text, or a file)",
    )
    held.add_argument("--regex", help="the answer matches this regular expression")
    held.add_argument(
        "--grammar",
        metavar="GRAMMAR",
        help="the answer follows this grammar, GBNF or Lark (its text, or a file)",
    )
    held.add_argument("--choice", nargs="+", metavar="TEXT", help="the answer is one of these")
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="format the linear layers multiply in: fp32, bf16, int8, w8a8, q8, q4; default: "
        "a GGUF file's own quantisation, kept packed (fp32 for an HF folder; docs/models.md)",
    )
    add_eager_argument(parser)


def add_commands(sub: Any) -> None:
    chat = add_command(
        sub,
        "chat",
        cmd_chat,
        help="talk with a pretrained chat model (SmolLM2, any Llama-family GGUF or HF folder)",
        description="A conversation with MODEL in its own chat template, each answer streamed as "
        "it is written. MODEL is a name (smollm2, gemma3-270m), a .gguf file or a Hugging Face "
        f"folder. Without --message it reads one turn a line: {COMMANDS_HELP}; Ctrl-C stops an "
        "answer, and at the prompt leaves.",
        examples=[
            ('dikkat chat smollm2 --message "What is the capital of France?"', "answer once"),
            ("dikkat chat smollm2", "a conversation (Ctrl-D leaves)"),
            ("dikkat chat smollm2 --system 'Answer in one word.' --weights int8", "int8 weights"),
        ],
    )
    chat.add_argument("model", help="a name (smollm2), a .gguf file or an HF folder")
    chat.add_argument("--message", "-m", type=utf8_text, help="answer this one message and exit")
    chat.add_argument(
        "--system", type=utf8_text, help="a system message that starts the conversation"
    )
    add_sampling_flags(chat, max_new_tokens=256, repetition_penalty=CHAT_REPETITION_PENALTY)
    add_device(chat)
