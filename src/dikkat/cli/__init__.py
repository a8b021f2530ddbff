"""The ``dikkat`` command line: one parser, one module per family of commands.

Every command has ``--help`` with examples (:func:`dikkat.cli.common.add_command`); a user error
ends with one line on stderr (``dikkat: error: …``) and exit status 2, a real bug keeps its
traceback.

``dikkat --help`` builds every command's parser, so a command module imports at its top only what
its parser needs; what a command needs to run (training, pretrained models, the server, the maps)
it imports inside its function, and ``dikkat --help`` answers without loading them
(tests/cli/test_cli.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dikkat.cli import (
    audit,
    bench,
    chat,
    demo,
    export,
    finetune,
    generate,
    models,
    seeds,
    serve,
    show,
    train,
    vision,
)
from dikkat.cli.common import RAW, USER_ERRORS, DikkatParser, format_examples
from dikkat.version import __version__

# the families of commands, in the order `dikkat --help` lists them
COMMANDS = (
    train,
    finetune,
    demo,
    generate,
    export,
    chat,
    models,
    serve,
    audit,
    vision,
    show,
    bench,
    seeds,
)


def build_parser() -> argparse.ArgumentParser:
    parser = DikkatParser(
        prog="dikkat",
        description="Attention and the Transformer, end to end.",
        formatter_class=RAW,
    )
    parser.add_argument("--version", action="version", version=f"dikkat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=DikkatParser)
    for family in COMMANDS:
        family.add_commands(sub)
    # the first example of every command, stated once where the command is defined
    firsts = [getattr(p, "dikkat_examples", ())[:1] for p in dict.fromkeys(sub.choices.values())]
    parser.epilog = format_examples([e for first in firsts for e in first])
    return parser


def main(argv: Sequence[str] | None = None) -> int:

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the words as given: `train --nproc` runs them again in each process
    if args.command is None:
        parser.print_help()
        return 0
    # what training raises, caught here for every command: imported once a command runs
    from dikkat.training.results import DivergedError
    from dikkat.training.signals import TrainingInterrupted

    try:
        return args.func(args)
    except USER_ERRORS as e:
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
