"""``dikkat show``: the attention maps of a real model on one input, as pictures (docs/show.md)."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dikkat.cli.args import add_no_verify
from dikkat.cli.common import add_command, add_device, device_of, require_extra
from dikkat.cli.folders import held, load_model, refusal, task_seed
from dikkat.models import BERT, GPT, Seq2Seq
from dikkat.tasks.digits import load_digits_split
from dikkat.tasks.translate import encode_numbers
from dikkat.text import NumberTokenizer, load_tokenizer
from dikkat.text.number_words import BOS_ID, EOS_ID
from dikkat.vision.vit import ViT
from dikkat.viz.figure import save_png
from dikkat.viz.heatmaps import draw_alignment, draw_focus, draw_grid
from dikkat.viz.maps import AttentionMaps, spread
from dikkat.viz.overlay import draw_image_attention, draw_importance
from dikkat.viz.report import write_html

if TYPE_CHECKING:
    from dikkat.maps import Faithfulness, TextModel

FULL_ROWS = 256  # up to this many tokens the grid keeps every query row; past it, the focus only
GRID_LAYERS = 6  # layers the grid draws of a deeper model where --layer does not choose
GRID_HEADS = 8  # heads the grid draws of a wider model where --head does not choose


def _indices(text: str) -> list[int]:
    """``"0,-1"`` → [0, -1] (argparse type of --layer and --head)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected indices such as 0 or 0,2,-1, got {text!r}"
        ) from None


def _token(text: str | None) -> str | int | None:
    return int(text) if text is not None and re.fullmatch(r"-?\d+", text) else text


SHOW_DIR = Path("runs/show")  # the pictures of a pretrained or Hugging Face model, by default


def out_dir(args: argparse.Namespace) -> Path:
    """``--out``; else the run folder; else ``runs/show/minilm`` or ``runs/show/NAME`` for
    ``--hf PATH`` (NAME: the folder's name) — never the working folder unasked."""
    if args.out is not None:
        return Path(args.out)
    if args.run is not None:
        return Path(args.run)
    if args.model is not None:  # a name, or the stem of a .gguf file or folder
        return SHOW_DIR / Path(args.model).stem
    return SHOW_DIR / Path(args.hf).resolve().name


class Figures:
    """Where the pictures go: ``--png PATH`` names the main one (the others beside it, with a
    suffix), ``--out DIR`` a folder for all of them (default: :func:`out_dir`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.one_head = args.head is None  # no --head: the report opens on one head, not all
        if args.png is not None:
            self.main = Path(args.png)
        else:
            self.main = out_dir(args) / "attention.png"
        self.html = None if args.html is None else Path(args.html)
        self.written: list[tuple[Path, str]] = []

    def save(self, fig: Any, suffix: str, what: str) -> None:
        path = self.main if not suffix else self.main.with_name(f"{self.main.stem}_{suffix}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.written.append((save_png(fig, path), what))

    def report(self, m: AttentionMaps, focus: int) -> None:
        """With --html, the interactive report of the maps drawn (docs/report.md), opening on
        query row ``focus`` (--token's), the first layer kept and the heads asked for (with no
        --head, the first head alone: every head's lines at once are a tangle)."""
        if self.html is not None:
            heads = m.heads[:1] if self.one_head else None
            page = write_html(m, self.html, focus=focus, heads=heads)
            self.written.append((page, "interactive report (open in a browser)"))


def _focus_summary(m: AttentionMaps, row: int) -> str:
    token, position = m.queries[row], m.query_positions[row]
    lines = [f"where {token!r} (position {position}) looks, mean of heads {list(m.heads)}:"]
    for li, layer in enumerate(m.layers):
        w = m.weights[li, :, row].mean(axis=0)
        top = np.argsort(-w, kind="stable")[:3]
        lines.append(f"  {layer:<20} " + "   ".join(f"{m.keys[j]!r} {w[j]:.2f}" for j in top))
    return "\n".join(lines)


def _readable(m: AttentionMaps, args: argparse.Namespace) -> AttentionMaps:
    """The maps the grid draws: a deep or wide model's, where --layer or --head does not choose,
    cut to :data:`GRID_LAYERS` layers spread from the first to the last and its first
    :data:`GRID_HEADS` heads (30 layers × 9 heads of maps is no picture), said on stderr; the
    focus picture and the report keep them all."""
    layers = spread(len(m.layers), GRID_LAYERS) if args.layer is None else None
    heads = list(range(min(len(m.heads), GRID_HEADS))) if args.head is None else None
    picked = m.pick(layers, heads)
    if picked.weights.shape[:2] != m.weights.shape[:2]:
        print(f"dikkat: the grid draws {', '.join(picked.layers)} of {len(m.layers)} layers and "
              f"{len(picked.heads)} of {len(m.heads)} heads; --layer and --head choose others",
              file=sys.stderr)  # fmt: skip
    return picked


def _checked(args: argparse.Namespace, n_tokens: int) -> None:
    from dikkat.maps.faithfulness import MAX_TOKENS  # loaded when a command runs (see dikkat.cli)

    if args.rollout and args.head is not None:
        raise ValueError("--rollout averages every head: --head does not apply")
    if (args.rollout or args.faithfulness) and n_tokens > MAX_TOKENS:
        raise ValueError(
            f"the input has {n_tokens} tokens: --rollout and --faithfulness need every layer's "
            f"T × T weights, so they take at most {MAX_TOKENS}"
        )


def _show_text(args: argparse.Namespace, tm: TextModel, figures: Figures) -> Faithfulness | None:
    from dikkat import maps  # loaded when a command runs (see dikkat.cli)

    if args.text is None:
        raise ValueError("give the text to read: --text 'a sentence'")
    ids, labels = maps.encode_text(tm, args.text)
    T = len(ids)
    _checked(args, T)
    default = T - 1 if tm.causal else 0  # the newest token; an encoder's [CLS]
    focus = maps.find_token(labels, default if args.token is None else _token(args.token))
    rows = None if T <= FULL_ROWS else [focus]
    if args.rollout:
        full = maps.text_maps(tm, args.text)
        m = maps.rollout_maps(full, layers=args.layer, rows=rows)
    else:
        m = maps.text_maps(tm, args.text, layers=args.layer, heads=args.head, rows=rows)
    row = m.query_positions.index(focus)
    grid = _readable(m, args)
    figures.save(draw_grid(grid), "", f"{len(grid.layers)} layers × {len(grid.heads)} heads")
    figures.save(draw_focus(m, row), "focus", f"where {labels[focus]!r} looks, per head")
    figures.report(m, row)
    print(_focus_summary(m, row))
    return maps.text_faithfulness(tm, args.text, focus) if args.faithfulness else None


def _show_translation(args: argparse.Namespace, figures: Figures) -> Faithfulness | None:
    from dikkat import maps  # loaded when a command runs (see dikkat.cli)

    model = load_model(Seq2Seq, args.run, "show", verify=not args.no_verify, device=device_of(args))
    tokenizer = load_tokenizer(args.run, verify=not args.no_verify)
    if not isinstance(tokenizer, NumberTokenizer):
        raise ValueError(f"{args.run} is not a numbers translator (dikkat train --task translate)")
    if args.rollout:
        raise ValueError("--rollout follows self-attention; a translator shows its cross-attention")
    cleaned = (args.text or "").replace(",", "").replace("_", "")
    if not cleaned.isdigit() or int(cleaned) > 999_999:
        raise ValueError(
            f"--text {args.text!r}: give a whole number from 0 to 999,999 to translate"
        )
    source = [int(i) for i in encode_numbers([int(cleaned)])[0]]
    t = maps.translate(model, source, bos_id=BOS_ID, eos_id=EOS_ID)
    m = maps.translation_maps(model, tokenizer, t, layers=args.layer, heads=args.head)
    focus = 0 if args.token is None else maps.find_token(m.queries, _token(args.token))
    print(f"{args.text} → {tokenizer.decode(list(t.produced))}")
    figures.save(draw_alignment(m), "", "cross-attention: target × source, per layer")
    figures.save(draw_grid(m), "grid", f"{len(m.layers)} layers × {len(m.heads)} heads")
    figures.save(draw_focus(m, focus), "focus", f"where {m.queries[focus]!r} looks, per head")
    figures.report(m, focus)
    print(_focus_summary(m, focus))
    return maps.translation_faithfulness(model, tokenizer, t, focus) if args.faithfulness else None


def _show_image(args: argparse.Namespace, figures: Figures) -> Faithfulness | None:
    from dikkat import maps  # loaded when a command runs (see dikkat.cli)

    model = load_model(ViT, args.run, "show", verify=not args.no_verify, device=device_of(args))
    if args.token is not None:
        raise ValueError("--token does not apply to a ViT: the pictures follow its class token")
    data = load_digits_split(seed=task_seed(args.run))  # held out from the run's training
    if not 0 <= args.image < len(data.test_y):
        raise ValueError(f"--image {args.image}: there are {len(data.test_y)} held-out digits")
    image = data.test_x[args.image]
    title = f"held-out digit {args.image} (label {int(data.test_y[args.image])})"
    _checked(args, model.config.n_tokens)
    if args.rollout:
        full = maps.vit_maps(model, image, rows=None, title=title)
        m = maps.rollout_maps(full, layers=args.layer, rows=[0])
    else:
        m = maps.vit_maps(model, image, layers=args.layer, heads=args.head, title=title)
    picture = image[0].float().cpu().numpy()
    figures.save(draw_image_attention(m, picture), "", "the class token over the patches")
    figures.report(m, 0)  # the class token's row
    return maps.image_faithfulness(model, image) if args.faithfulness else None


def cmd_show(args: argparse.Namespace) -> int:
    """Draw a model's attention on one input; with --faithfulness, rank it against importance."""
    # the maps and the pretrained models load when a command runs (see dikkat.cli)
    from dikkat import maps
    from dikkat.pretrained import load
    from dikkat.pretrained.minilm import minilm

    given = [args.run is not None, args.model is not None, args.hf is not None]
    if sum(given) != 1:
        raise ValueError("give one model: a RUN_DIR, --model MODEL or --hf PATH")
    figures = Figures(args)
    if args.model == "minilm":
        require_extra("minilm", "show --model minilm")
        tm = maps.text_model(minilm(device_of(args)))
        result = _show_text(args, replace(tm, name="all-MiniLM-L6-v2"), figures)
    elif args.model is not None:
        lm = load(args.model, weights="fp32", device=device_of(args))
        result = _show_text(args, maps.text_model(lm), figures)
    elif args.hf is not None:
        require_extra("hf", "show --hf")
        result = _show_text(args, maps.hf_model(args.hf, device=device_of(args)), figures)
    else:
        what = held(args.run)
        if what.model in ("GPT", "BERT"):
            cls = GPT if what.model == "GPT" else BERT
            model = load_model(
                cls, args.run, "show", verify=not args.no_verify, device=device_of(args)
            )
            tokenizer = load_tokenizer(args.run, verify=not args.no_verify)
            result = _show_text(args, maps.text_model(model, tokenizer), figures)
        elif what.model == "Seq2Seq":
            result = _show_translation(args, figures)
        elif what.model == "ViT":
            result = _show_image(args, figures)
        else:
            raise ValueError(refusal(what, "a GPT, BERT, translator or ViT", command="show"))
    if result is not None:
        attention = dict(list(result.attention.items())[-2:])  # the last layer and the rollout
        title = f"{result.focus!r}: {result.output}"
        fig = draw_importance(
            result.tokens, result.importance, attention, result.correlations(), title=title
        )
        figures.save(fig, "faithfulness", "attention beside importance")
        print(result.table())
    for path, what in figures.written:
        print(f"{path}: {what}")
    return 0


def add_commands(sub: Any) -> None:
    """Register show."""
    p = add_command(
        sub,
        "show",
        cmd_show,
        help="picture a model's attention on a text or an image (PNG); is it an explanation?",
        description="Run a model on one input and draw its attention: a grid of heat maps of "
        "every layer × head, and where one token (--token) looks in each head; a translator's "
        "cross-attention as a target × source alignment; a ViT's class token over the image. "
        "The model is the real all-MiniLM-L6-v2 (--model minilm), a local Hugging Face folder "
        "(--hf), or a dikkat run folder (a GPT or BERT with --text, a translator with --text "
        "NUMBER, a digits ViT with --image). --faithfulness prints how well the attention ranks "
        "the input tokens by their effect on the output (docs/show.md).",
        examples=[
            (
                "dikkat show --model minilm --text \"The animal didn't cross the street because "
                'it was too tired." --token it',
                "attention.png and attention_focus.png in runs/show/minilm/",
            ),
            ("dikkat show runs/gpt --text 'import os' --rollout --faithfulness", ""),
            (
                "dikkat show --model smollm2 --text 'The cat sat on the mat because it was "
                "tired.' --token it --layer -1",
                "a real decoder",
            ),
            ("dikkat show runs/translate --text 4721 --layer -1", "the alignment"),
            ("dikkat show runs/gpt --text 'def f(x):' --html attention.html", "open in a browser"),
            ("dikkat show runs/digits --image 3 --png digit.png", ""),
            ("dikkat show --hf ./gpt2 --text 'Hello there' --head 0,1 --out maps", ""),
        ],
        notes="--token takes a token as the tokenizer writes it ('it', '##ing') or a position "
        "(0, -1). Up to 256 tokens the grid shows every query row; past that only --token's "
        "row is captured, so a 4096-token text costs 4096 weights per head, not 4096².",
    )
    p.add_argument(
        "run", nargs="?", help="a run folder of dikkat train (lm, mlm, translate, digits)"
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="a pretrained model: minilm (all-MiniLM-L6-v2), or a decoder dikkat.pretrained.load "
        "reads: a name (smollm2, gemma3-270m), a .gguf file or an HF folder",
    )
    p.add_argument("--hf", metavar="PATH", help="a local Hugging Face model folder (no download)")
    p.add_argument("--text", help="the text to read (for a translator: the number)")
    p.add_argument("--image", type=int, default=0, help="held-out digit to read (a ViT run)")
    p.add_argument("--layer", type=_indices, help="layers to draw, e.g. 0 or 0,-1 (default all)")
    p.add_argument("--head", type=_indices, help="heads to draw, e.g. 3 or 0,1 (default all)")
    p.add_argument("--token", help="the token to focus on: a token or a position")
    p.add_argument("--rollout", action="store_true", help="draw attention rollout instead")
    p.add_argument(
        "--faithfulness",
        action="store_true",
        help="rank attention against leave-one-out importance",
    )
    p.add_argument("--png", metavar="PATH", help="the main picture's path (others beside it)")
    p.add_argument("--html", metavar="PATH", help="also one self-contained interactive HTML report")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the pictures (default: the run folder; for --model and --hf, "
        "runs/show/minilm or runs/show/NAME, NAME the --hf folder's name)",
    )
    add_device(p)
    add_no_verify(p)
