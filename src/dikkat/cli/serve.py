"""``dikkat serve``: an OpenAI-compatible HTTP server over a GPT or a pretrained decoder
(docs/server.md)."""

from __future__ import annotations

import argparse
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dikkat.cli.args import add_no_verify, positive_int
from dikkat.cli.chat import load_pretrained
from dikkat.cli.common import add_command, add_device, device_of, require_extra
from dikkat.cli.folders import load_model
from dikkat.cli.generate import _tokenizer_of
from dikkat.interop import load_hf_gpt2_dir
from dikkat.layers import WEIGHT_FORMATS
from dikkat.models import GPT
from dikkat.text import load_tokenizer


def build_app(args: argparse.Namespace, executor: Executor | None = None) -> Any:
    """The app ``dikkat serve`` would serve: the model and its tokenizer, an engine over them
    (stepped in ``executor``, :func:`dikkat.serving.server.create_app`)."""
    sources = [s for s in (args.checkpoint, args.hf_gpt2, args.model) if s is not None]
    if len(sources) != 1:
        raise ValueError("give one of a run or model folder, --hf-gpt2 PATH or --model MODEL")
    require_extra("serve", "serve")  # before the model is loaded: fastapi and uvicorn
    from dikkat.serving import Engine  # loaded when a command runs (see dikkat.cli)
    from dikkat.serving.engine import default_num_blocks

    device = device_of(args)
    chat_prompt = None
    if args.model is not None:
        # a GGUF file's own packed weights, or fp32 for the engine to convert (batched layouts)
        lm = load_pretrained(args, None if args.weights is None else "fp32")
        model, tokenizer, name = lm.model, lm.tokenizer, lm.name
        if lm.chat_template is not None:
            chat_prompt = lm.chat_prompt
    elif args.hf_gpt2 is not None:
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
    if model.cache_layout().device != torch.device(device):
        model.to(device)  # (packed weights stay on the CPU: loading refused another device)
    model.eval()
    context = model.cache_layout().context
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(f"--max-model-len {args.max_model_len} is past the model's context of "
                         f"{context}")  # fmt: skip
    served_len = args.max_model_len or context
    num_blocks = args.num_blocks or default_num_blocks(
        model.cache_layout(), args.block_size, args.max_batch, served_len
    )
    engine = Engine(
        model,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        weights=args.weights,
        compile=args.compile,
    )
    if args.compile:
        print("dikkat: compiling the decode step (a minute or two the first time)…", flush=True)
        engine.warm_up()
    from dikkat.serving.server import create_app  # needs fastapi (checked above)

    stats = engine.stats()
    chat = "chat and completions" if chat_prompt is not None else "completions (no chat template)"
    print(
        f"dikkat: {args.name or name} ({model.n_params:,} parameters, context "
        f"{served_len}) on http://{args.host}:{args.port}/v1: {chat}; {stats.total_blocks} "
        f"KV cache blocks of {stats.block_size} tokens, batches of up to {args.max_batch}, "
        f"{engine.weights} weights",
        flush=True,
    )
    return create_app(
        engine,
        tokenizer,
        args.name or name,
        api_key=args.api_key,
        chat_prompt=chat_prompt,
        max_model_len=args.max_model_len,
        executor=executor,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C); with --dry-run, build everything and stop there.

    The model's load, the warm-up and every engine step run in one thread, not the event loop's:
    each thread that starts OpenMP parallel regions gets a team of workers of its own, and with
    more workers than cores libgomp stops spinning idle ones (its ``GOMP_SPINCOUNT`` throttling,
    https://gcc.gnu.org/onlinedocs/libgomp/GOMP_005fSPINCOUNT.html), so that every region of
    every step would wait for its workers to wake.
    """
    # (not shut down here: the app's engine loop runs in it for as long as the app is served;
    # its idle thread ends with the interpreter)
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="dikkat-torch")
    app = torch_thread.submit(build_app, args, torch_thread).result()
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
        help="an OpenAI-compatible HTTP server over a GPT or a pretrained decoder",
        description="Serve a dikkat GPT run or model folder, a locally saved Hugging Face GPT-2, "
        "or a pretrained decoder (--model: SmolLM2, Gemma 3, any Llama-family GGUF or HF "
        "folder) over HTTP: /v1/chat/completions (a model with a chat template), "
        "/v1/completions, /tokenize, /detokenize, /v1/models, /health, /metrics. Requests are "
        "batched by an engine with a paged KV cache (docs/server.md).",
        examples=[
            ("dikkat serve --model smollm2 --max-model-len 2048", "on http://127.0.0.1:8000"),
            ("dikkat serve runs/gpt", "a GPT of dikkat train"),
            ("dikkat serve --hf-gpt2 ./gpt2 --port 8080 --api-key sesame", ""),
        ],
    )
    serve.add_argument("checkpoint", nargs="?", help="a run or model folder (dikkat train, save)")
    serve.add_argument("--hf-gpt2", metavar="PATH", help="an HF GPT-2 directory (save_pretrained)")
    serve.add_argument(
        "--model",
        metavar="MODEL",
        help="a pretrained decoder: a name (smollm2, gemma3-270m), a .gguf file or an HF folder",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--name", help="the model's name in the API (default: the folder's)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    engine = serve.add_argument_group("the engine")
    engine.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    engine.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="the context a request may use, prompt and answer (default: the model's); a chat "
        "answer without max_tokens runs to it",
    )
    engine.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV cache blocks in all (default: enough for --max-batch requests of "
        "--max-model-len tokens)",
    )
    engine.add_argument("--max-batch", type=positive_int, default=16, help="decoded together")
    engine.add_argument("--max-queue", type=positive_int, default=64, help="may wait (then 503)")
    engine.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="format the linear layers multiply in: fp32 (as trained), bf16, int8 "
        "(per-channel, weight-only), w8a8 (int8 weights, 8-bit inputs, x86 CPUs), q8 or q4 "
        "(blocks of 32); default: a GGUF file's own quantisation with --model, else fp32; the "
        "saved weights are not changed",
    )
    engine.add_argument(
        "--compile",
        action="store_true",
        help="decode through the model's torch.compile'd step (a Decoder or GPT; compiled "
        "before serving starts, in a minute or two), without the eager forward's per-layer "
        "Python",
    )
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="load the model, build the server, do not serve"
    )
    add_device(serve)
    add_no_verify(serve)
