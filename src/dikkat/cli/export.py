"""``dikkat export RUN --gguf OUT.gguf``: a GPT run or model folder as a GGUF file that
llama.cpp runs (its ``gpt2`` architecture, or ``starcoder2`` for a GPT with RoPE) and
``dikkat.pretrained.load`` reads back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from dikkat.cli.args import add_no_verify
from dikkat.cli.common import add_command
from dikkat.cli.folders import load_model
from dikkat.cli.generate import _tokenizer_of
from dikkat.models import GPT


def cmd_export(args: argparse.Namespace) -> int:
    from dikkat.interop.gguf_gpt import (  # see dikkat.cli
        architecture_of,
        check_writable,
        write_gguf,
    )

    out = Path(args.gguf)
    if out.exists() and not args.overwrite:  # before the model is read
        raise ValueError(f"--gguf {out} exists; add --overwrite to replace it")
    cpu = torch.device("cpu")
    model = load_model(GPT, args.run, "export", verify=not args.no_verify, device=cpu)
    check_writable(model.config)
    tokenizer = _tokenizer_of(args.run, model.config.vocab_size, not args.no_verify)
    name = Path(args.run).resolve().name
    write_gguf(model, tokenizer, out, dtype=args.dtype, name=name, overwrite=args.overwrite)
    c, size = model.config, out.stat().st_size
    shown = f"{size / 2**20:,.1f} MiB" if size >= 2**20 else f"{size / 2**10:,.1f} KiB"
    print(
        f"wrote {out} ({shown}): {architecture_of(c)}, {c.n_layers} layers, "
        f"width {c.d_model}, {c.n_heads} heads, context {c.max_len}, vocabulary {c.vocab_size:,}, "
        f"{args.dtype}"
    )
    return 0


def add_commands(sub: Any) -> None:
    export = add_command(
        sub,
        "export",
        cmd_export,
        help="write a GPT run as a GGUF file for llama.cpp",
        description="Write the GPT of a run or model folder (dikkat train --task lm, save) and its "
        "tokenizer as one GGUF file of llama.cpp's gpt2 architecture, laid out as llama.cpp's own "
        "converter writes GPT-2; a GPT with RoPE (the demo's) as llama.cpp's starcoder2 "
        "architecture, whose graph is a RoPE GPT's. dikkat.pretrained.load and dikkat generate "
        "--model read it back. A GPT with another activation than the tanh GELU, and a tokenizer "
        "other than bytes or a byte-level BPE, have no such file: they are refused.",
        examples=[
            ("dikkat export runs/gpt --gguf runs/gpt.gguf", "fp32 weights, as trained"),
            ("dikkat export runs/demo --gguf runs/demo.gguf", "the demo's RoPE GPT (starcoder2)"),
            ("dikkat export runs/gpt --gguf runs/gpt-f16.gguf --dtype f16", "matrices in fp16"),
        ],
        notes="The file is written under a temporary name and renamed into place when complete.",
    )
    export.add_argument("run", help="a run or model folder holding a GPT")
    export.add_argument("--gguf", required=True, metavar="OUT", help="the .gguf file to write")
    export.add_argument(
        "--dtype",
        choices=("f32", "f16"),
        default="f32",
        help="f32 (default, lossless) or f16: the matrices in fp16, norms and biases in fp32",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    add_no_verify(export)
