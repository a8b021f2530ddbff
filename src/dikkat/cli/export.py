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
    from dikkat.training.finetune import is_finetune

    if is_finetune(args.run):
        return _export_finetune(args)
    if args.gguf is None:
        raise ValueError("--gguf OUT is needed (--lora-gguf is a fine-tune's)")
    if args.lora_gguf is not None or args.type is not None:
        raise ValueError(f"--lora-gguf and --type are a fine-tune's; {args.run} is not one")
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


def _export_finetune(args: argparse.Namespace) -> int:
    """A fine-tune's adapters merged into its base GGUF (--gguf) or as llama.cpp's adapter file
    (--lora-gguf)."""
    from dikkat.training.finetune_export import export_lora_gguf, export_merged_gguf

    given = (("--gguf", args.gguf), ("--lora-gguf", args.lora_gguf))
    wanted = [(flag, Path(p)) for flag, p in given if p is not None]
    if not wanted:
        raise ValueError(f"{args.run} is a fine-tune: give --gguf OUT, --lora-gguf OUT or both")
    if args.dtype != "f32":
        raise ValueError("--dtype is a GPT's; a fine-tune's merged file takes --type")
    for flag, out in wanted:
        if out.exists() and not args.overwrite:
            raise ValueError(f"{flag} {out} exists; add --overwrite to replace it")
    for flag, out in wanted:
        if flag == "--gguf":
            try:
                export_merged_gguf(args.run, out, kind=args.type)
            except ValueError as e:  # the library's keyword, said as this command's flag
                said = str(e).replace('pass kind="Q8_0" or kind="F16"', "give --type Q8_0 or F16")
                raise ValueError(said) from None
            what = f"the base with the adapters merged ({args.type or 'its own types'})"
        else:
            export_lora_gguf(args.run, out)
            what = "llama.cpp's LoRA adapter (llama-cli -m BASE --lora FILE)"
        print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB): {what}")
    return 0


def add_commands(sub: Any) -> None:
    export = add_command(
        sub,
        "export",
        cmd_export,
        help="write a GPT run, or a fine-tune, as a GGUF file for llama.cpp",
        description="Write the GPT of a run or model folder (dikkat train --task lm, save) and its "
        "tokenizer as one GGUF file of llama.cpp's gpt2 architecture, laid out as llama.cpp's own "
        "converter writes GPT-2; a GPT with RoPE (the demo's) as llama.cpp's starcoder2 "
        "architecture, whose graph is a RoPE GPT's. dikkat.pretrained.load and dikkat generate "
        "--model read it back. A GPT with another activation than the tanh GELU, and a tokenizer "
        "other than bytes or a byte-level BPE, have no such file: they are refused. A fine-tune "
        "(dikkat finetune) of a GGUF model is written as its base file with the adapters merged "
        "(--gguf, each matrix quantised again in its own type, or --type), or as llama.cpp's "
        "LoRA adapter file (--lora-gguf).",
        examples=[
            ("dikkat export runs/gpt --gguf runs/gpt.gguf", "fp32 weights, as trained"),
            ("dikkat export runs/demo --gguf runs/demo.gguf", "the demo's RoPE GPT (starcoder2)"),
            ("dikkat export runs/gpt --gguf runs/gpt-f16.gguf --dtype f16", "matrices in fp16"),
            ("dikkat export runs/ft --gguf ft.gguf --lora-gguf ft-lora.gguf", "a fine-tune"),
        ],
        notes="The file is written under a temporary name and renamed into place when complete.",
    )
    export.add_argument("run", help="a run or model folder holding a GPT")
    export.add_argument("--gguf", metavar="OUT", help="the .gguf file to write")
    export.add_argument(
        "--lora-gguf", metavar="OUT", help="a fine-tune: llama.cpp's LoRA adapter file"
    )
    export.add_argument(
        "--type",
        choices=("F16", "BF16", "F32", "Q8_0"),
        help="a fine-tune's merged file: every matrix in this type (default: each its own)",
    )
    export.add_argument(
        "--dtype",
        choices=("f32", "f16"),
        default="f32",
        help="f32 (default, lossless) or f16: the matrices in fp16, norms and biases in fp32",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    add_no_verify(export)
