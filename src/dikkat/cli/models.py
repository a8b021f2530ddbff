"""``dikkat models``: the models other tools keep on this machine — the Hugging Face cache,
ollama's store, LM Studio's folder — each with its architecture, quantisation, size and
context, and whether dikkat runs it (or why not)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dikkat.cli.common import add_command


def cmd_models(args: argparse.Namespace) -> int:
    from dikkat.pretrained import stores
    from dikkat.pretrained.catalog import describe

    found = [describe(s) for s in stores.stored_models()]
    if args.json:
        rows = [
            {"name": d.stored.name, "store": d.stored.store, "path": str(d.stored.path),
             "architecture": d.architecture, "quantisation": d.quantisation, "bytes": d.size,
             "context": d.context, "runs": d.runs, "why": d.why}
            for d in found
        ]  # fmt: skip
        print(json.dumps(rows, indent=1))
        return 0
    if not found:
        print(f"no models found in {stores.where()}")
        return 0
    header = ("name", "store", "architecture", "quant", "size", "context", "dikkat")
    table = [header] + [
        (d.stored.name, d.stored.store, d.architecture, d.quantisation, _size(d.size),
         "?" if d.context is None else f"{d.context:,}", "runs" if d.runs else f"no: {d.why}")
        for d in found
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1])
    print(f"\nlooked in {stores.where()}; run one with: dikkat chat NAME")
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def add_commands(sub: Any) -> None:
    models = add_command(
        sub,
        "models",
        cmd_models,
        help="list the models other tools keep here (Hugging Face cache, ollama, LM Studio)",
        description="List the models in the Hugging Face hub's cache, ollama's store and LM "
        "Studio's models folder, with their architecture, quantisation, size and context, and "
        "whether dikkat runs each (the reason where it does not). Each name is what every "
        "--model and dikkat chat take; nothing is downloaded.",
        examples=[
            ("dikkat models", "what is here, and what dikkat runs"),
            ("dikkat models --json", "the same, for a program"),
        ],
        notes="Where: HF_HUB_CACHE / HF_HOME (else ~/.cache/huggingface/hub), OLLAMA_MODELS "
        "(else ~/.ollama/models), ~/.lmstudio/models. A listed name runs as it is: dikkat chat "
        "Qwen/Qwen3-0.6B (the Hugging Face cache), dikkat chat llama3.2:1b (ollama), dikkat chat "
        "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M (a GGUF repository's file by its tag). A "
        "prefix hf:, ollama: or lmstudio: asks one store only.",
    )
    models.add_argument("--json", action="store_true", help="one JSON list instead of a table")
