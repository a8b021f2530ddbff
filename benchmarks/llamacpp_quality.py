"""dikkat against llama.cpp on one GGUF file: the same greedy tokens, the same perplexity.

    python benchmarks/llamacpp_quality.py [MODEL] [--greedy 64] [--ctx 512] [--text-bytes 24000]

MODEL is a name (``smollm2``, ``gemma3-270m``) or a ``.gguf`` file, read by dikkat with its own
packed weights; llama.cpp's tools come from benchmarks/llamacpp_build.py (built on first use).

- greedy tokens: one English prompt, tokenized by both (the ids compared), and ``--greedy`` new
  tokens from ``llama-simple`` and from :func:`dikkat.generation.generate`; the count of
  dikkat's leading tokens whose text llama.cpp's continuation starts with (llama-simple prints
  text, not ids).
- perplexity: ``llama-perplexity -c CTX`` on held-out text made of this Python's standard
  library sources, and dikkat's on the same text by llama-perplexity's own method
  (:func:`perplexity_chunks`), with their relative difference.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import torch

from llamacpp_build import LlamaCppError, build_llamacpp, cache_dir, run

PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith"
# llama.cpp's tools turn "\\n" in a -f file's text into a newline unless told not to
NO_ESCAPE = "--no-escape"
STDLIB_FILES = ("textwrap.py", "csv.py", "shlex.py", "fnmatch.py", "colorsys.py", "difflib.py")


@contextmanager
def text_file(text: str) -> Iterator[str]:
    """The path of a temporary file holding ``text`` exactly, removed afterwards."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def llama_ids(bins: Path, path: Path, text: str, *, parse_special: bool) -> list[int]:
    """``text``'s ids by llama.cpp's tokenizer, BOS as the model wants it."""
    with text_file(text) as name:
        cmd = [str(bins / "llama-tokenize"), "-m", str(path), "-f", name, "--ids", NO_ESCAPE]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = run(cmd, f"llama-tokenize on {path.name}").stdout
    return [int(i) for i in out.strip().splitlines()[-1].strip("[]").split(",") if i.strip()]


def llama_greedy(bins: Path, path: Path, prompt: str, n: int) -> str:
    """llama-simple's greedy continuation of ``prompt`` (it echoes the prompt first)."""
    cmd = [str(bins / "llama-simple"), "-m", str(path), "-n", str(n), prompt]
    out = run(cmd, f"llama-simple on {path.name}").stdout
    at = out.find(prompt)
    if at < 0:
        raise LlamaCppError(f"llama-simple did not echo the prompt: {out[:200]!r}")
    return out[at + len(prompt) :].removesuffix("\n")


def agreeing_tokens(pieces: list[str], text: str) -> int:
    """How many of ``pieces`` (dikkat's tokens as text, in order) ``text`` starts with."""
    k, at = 0, 0
    for piece in pieces:
        if not text.startswith(piece, at):
            break
        k, at = k + 1, at + len(piece)
    return k


def token_pieces(decode, row: list[int]) -> list[str]:
    """Each token's text as the row's text grows: a character split over several tokens (a
    trailing U+FFFD until it is whole) comes with its last token; a token that rewrites the text
    before it gets U+FFFD, which agrees with nothing."""
    texts = ["", *(decode(row[: i + 1]).rstrip("\ufffd") for i in range(len(row)))]
    return [b[len(a) :] if b.startswith(a) else "\ufffd" for a, b in pairwise(texts)]


def greedy(bins: Path, path: Path, lm, n: int) -> dict:
    """Both engines' greedy continuations of :data:`PROMPT`; where they part, dikkat's margin
    between its two most likely tokens and whether llama.cpp took dikkat's second choice."""
    from dikkat.generation import generate

    ids = lm.tokenizer.encode(PROMPT)
    theirs = llama_ids(bins, path, PROMPT, parse_special=True)  # as llama-simple tokenizes
    eos = tuple(sorted(lm.tokenizer.eos_ids))  # llama-simple stops at any end-of-generation id
    with torch.inference_mode():
        row = generate(lm.model, [ids], n, stop_ids=eos)[0][len(ids) :]
    row = row[:-1] if row and row[-1] in eos else row
    decode = lambda r: lm.tokenizer.decode(r, skip_special=True)  # noqa: E731
    pieces = token_pieces(decode, row)
    text = llama_greedy(bins, path, PROMPT, n)
    k = agreeing_tokens(pieces, text)
    found = {
        "prompt_ids": ids,
        "same_prompt_ids": ids == theirs,
        "dikkat_tokens": len(row),
        "agreeing_tokens": k,
        "same_text": "".join(pieces) == text,
        "dikkat_text": "".join(pieces),
        "llama_text": text,
    }
    if k < len(row):
        with torch.inference_mode():
            logits = lm.model(torch.tensor([ids + row[:k]]), last_only=True)[0, -1].double()
        top = logits.topk(2)
        second = token_pieces(decode, [*row[:k], int(top.indices[1])])[-1]
        found["margin_at_split"] = float(top.values[0] - top.values[1])
        found["llama_took_second"] = bool(second) and text.startswith(
            second, len("".join(pieces[:k]))
        )
    return found


def heldout_text(nbytes: int) -> str:
    """About ``nbytes`` of this Python's standard-library sources, cut at a line's end, with no
    trailing newline (llama-perplexity's ``-f`` drops one)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text(encoding="utf-8") for name in STDLIB_FILES)
    if len(text) < nbytes:
        raise LlamaCppError(f"the stdlib text has {len(text)} characters, fewer than {nbytes}")
    return text[: text.rfind("\n", 0, nbytes)].rstrip("\n")


def perplexity_chunks(ids: list[int], n_ctx: int, bos: int | None) -> list[tuple[list, list]]:
    """llama-perplexity's method (tools/perplexity/perplexity.cpp in llama.cpp, ``perplexity``):
    the tokenized text (BOS first when the model adds one) cut into ``len // n_ctx`` whole
    chunks, the rest dropped; each chunk's first token replaced by BOS when the model adds one;
    the logits at positions ``n_ctx // 2 … n_ctx - 2`` scored against the chunk's next tokens.
    Returns one (the ids to run, the ``n_ctx - n_ctx // 2 - 1`` targets) per chunk."""
    if len(ids) < 2 * n_ctx:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than 2 × n_ctx = {2 * n_ctx}")
    first, chunks = n_ctx // 2, []
    for i in range(len(ids) // n_ctx):
        chunk = ids[i * n_ctx : (i + 1) * n_ctx]
        chunks.append((chunk if bos is None else [bos, *chunk[1:]], chunk[first + 1 :]))
    return chunks


def dikkat_perplexity(model, ids: list[int], n_ctx: int, bos: int | None) -> float:
    """exp of the mean negative log-likelihood of :func:`perplexity_chunks`' targets."""
    nll, count, first = 0.0, 0, n_ctx // 2
    with torch.inference_mode():
        for run_ids, targets in perplexity_chunks(ids, n_ctx, bos):
            hidden = model(torch.tensor([run_ids]), return_hidden=True)[0]  # (n_ctx, C)
            logits = model.lm_head(hidden[first : n_ctx - 1]).double()  # (n_ctx - first - 1, V)
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])
            nll, count = nll - logp.sum().item(), count + len(targets)
    return math.exp(nll / count)


def parse_llama_perplexity(output: str) -> float:
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    if found is None:
        raise LlamaCppError(f"llama-perplexity printed no final estimate: {output[-200:]!r}")
    return float(found.group(1))


def perplexity(bins: Path, path: Path, lm, text: str, n_ctx: int, threads: int) -> dict:
    theirs = llama_ids(bins, path, text, parse_special=False)  # as llama-perplexity tokenizes
    ids = lm.tokenizer.encode(text)
    if min(len(ids), len(theirs)) < 2 * n_ctx:
        raise LlamaCppError(
            f"the text is {min(len(ids), len(theirs))} tokens, fewer than 2 × -c {n_ctx}: "
            "give more text (--text-bytes) or a shorter --ctx"
        )
    with text_file(text) as name:
        cmd = [str(bins / "llama-perplexity"), "-m", str(path), "-f", name, "-c", str(n_ctx)]
        done = run([*cmd, "-t", str(threads), NO_ESCAPE], f"llama-perplexity on {path.name}")
    llama_ppl = parse_llama_perplexity(done.stdout + done.stderr)
    ours = dikkat_perplexity(
        lm.model, ids, n_ctx, lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    )
    return {
        "tokens": len(ids),
        "same_ids": ids == theirs,
        "chunks": len(ids) // n_ctx,
        "llama_ppl": llama_ppl,
        "dikkat_ppl": ours,
        "rel_diff": ours / llama_ppl - 1,
    }


def quality_table(per_model: dict[str, dict]) -> str:
    """Markdown: per model, the greedy agreement and both perplexities."""
    lines = [
        "| model | prompt ids equal | greedy tokens agreeing | margin where they part "
        "| text ids equal | chunks | ppl llama.cpp | ppl dikkat | difference |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for model, q in per_model.items():
        g, p = q["greedy"], q["perplexity"]
        agree = f"{g['agreeing_tokens']}/{g['dikkat_tokens']}"
        if "margin_at_split" in g:  # dikkat's top two logits there; llama.cpp took the second?
            took = "llama.cpp took dikkat's 2nd" if g["llama_took_second"] else "another token"
            agree += f" | {g['margin_at_split']:.3f} ({took})"
        else:
            agree += " | "
        ppl = f"{p['llama_ppl']:.4f} | {p['dikkat_ppl']:.4f} | {100 * p['rel_diff']:+.2f} %"
        lines.append(
            f"| {model} | {g['same_prompt_ids']} | {agree} | {p['same_ids']} | {p['chunks']} "
            f"| {ppl} |"
        )
    return "\n".join(lines)


def compare(bins: Path, name: str, greedy_n: int, text: str, n_ctx: int, threads: int) -> dict:
    """Both comparisons on one model: {"file", "greedy", "perplexity"}."""
    from dikkat.pretrained import load
    from dikkat.pretrained.sources import resolve

    path = resolve(name).path
    lm = load(path)  # the file's own packed weights
    return {
        "file": str(path),
        "greedy": greedy(bins, path, lm, greedy_n),
        "perplexity": perplexity(bins, path, lm, text, n_ctx, threads),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2", help="a name or a .gguf file")
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--ctx", type=int, default=512, help="perplexity chunk length (-c)")
    parser.add_argument("--text-bytes", type=int, default=24_000, help="held-out text size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=cache_dir(), help="llama.cpp's build")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        bins = build_llamacpp(args.cache)
        text = heldout_text(args.text_bytes)
        result = compare(bins, args.model, args.greedy, text, args.ctx, args.threads)
    except LlamaCppError as e:
        raise SystemExit(f"llamacpp_quality.py: {e}") from None
    print(quality_table({args.model: result}))
    return result


if __name__ == "__main__":
    main()
