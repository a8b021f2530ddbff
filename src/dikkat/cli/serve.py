"""``dikkat serve``: an OpenAI-compatible HTTP server over a GPT (docs/server.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dikkat.cli.args import add_no_verify, positive_int
from dikkat.cli.common import add_command, add_device, device_of, require_extra
from dikkat.cli.folders import load_model
from dikkat.cli.generate import _tokenizer_of
from dikkat.interop import load_hf_gpt2_dir
from dikkat.layers import WEIGHT_FORMATS
from dikkat.models import GPT
from dikkat.text import load_tokenizer


def build_app(args: argparse.Namespace) -> Any:
    """The app ``dikkat serve`` would serve: the model and its tokenizer, an engine over them."""
    if (args.checkpoint is None) == (args.hf_gpt2 is None):
        raise ValueError("give either a run or model folder, or --hf-gpt2 PATH")
    require_extra("serve", "serve")  # before the model is loaded: fastapi and uvicorn
    from dikkat.serving import Engine  # loaded when a command runs (see dikkat.cli)

    device = device_of(args)
    if args.hf_gpt2 is not None:
        model = load_hf_gpt2_dir(args.hf_gpt2)
        tokenizer = load_tokenizer(args.hf_gpt2)
        name = Path(args.hf_gpt2).resolve().name
    else:
        model = load_model(GPT, args.checkpoint, "serve", verify=not args.no_verify, device=device)
        tokenizer = _tokenizer_of(args.checkpoint, model.config.vocab_size, not args.no_verify)
        name = Path(args.checkpoint).resolve().name
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model only "
            f"{model.config.vocab_size:,}: they do not belong together"
        )
    model.to(device).eval()
    engine = Engine(
        model,
        block_size=args.block_size,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        weights=args.weights,
    )
    from dikkat.serving.server import create_app  # needs fastapi (checked above)

    stats = engine.stats()
    print(
        f"dikkat: {args.name or name} ({model.n_params:,} parameters, context "
        f"{engine.max_len}) on http://{args.host}:{args.port}/v1 — {stats.total_blocks} KV cache "
        f"blocks of {stats.block_size} tokens, batches of up to {args.max_batch}, "
        f"{args.weights} weights",
        flush=True,
    )
    return create_app(engine, tokenizer, args.name or name, api_key=args.api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C); with --dry-run, build everything and stop there."""
    app = build_app(args)
    if args.dry_run:
        return 0
    import uvicorn  # optional, like fastapi (build_app checked that the server imports)

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_commands(sub: Any) -> None:
    serve = add_command(
        sub,
        "serve",
        cmd_serve,
        help="an OpenAI-compatible HTTP server over a GPT",
        description="Serve a dikkat GPT run or model folder, or a locally saved Hugging Face "
        "GPT-2, over HTTP: /v1/completions (streamed or whole), /v1/models, /health, /metrics. "
        "Requests are batched by an engine with a paged KV cache (docs/server.md).",
        examples=[
            ("dikkat serve runs/gpt", "on http://127.0.0.1:8000"),
            ("dikkat serve --hf-gpt2 ./gpt2 --port 8080 --api-key sesame", ""),
        ],
    )
    serve.add_argument("checkpoint", nargs="?", help="a run or model folder (dikkat train, save)")
    serve.add_argument("--hf-gpt2", metavar="PATH", help="an HF GPT-2 directory (save_pretrained)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--name", help="the model's name in the API (default: the folder's)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    engine = serve.add_argument_group("the engine")
    engine.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    engine.add_argument("--max-batch", type=positive_int, default=16, help="decoded together")
    engine.add_argument("--max-queue", type=positive_int, default=64, help="may wait (then 503)")
    engine.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="fp32",
        help="format the linear layers multiply in: fp32 (as trained), bf16, int8 "
        "(per-channel, weight-only) or w8a8 (int8 weights, 8-bit inputs, x86 CPUs); the saved "
        "weights are not changed",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="load the model, build the server, do not serve"
    )
    add_device(serve)
    add_no_verify(serve)
