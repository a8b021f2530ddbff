"""``dikkat serve``: an OpenAI-compatible HTTP server over a GPT or a pretrained decoder
(docs/server.md)."""

from __future__ import annotations

import argparse
import functools
import socket
import sys
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from dikkat.cli.args import add_no_verify, positive_float, positive_int
from dikkat.cli.chat import load_pretrained
from dikkat.cli.common import (
    add_command,
    add_device,
    add_eager_argument,
    compiles,
    device_of,
    require_extra,
)
from dikkat.cli.folders import load_model
from dikkat.cli.generate import _tokenizer_of
from dikkat.interop import load_hf_gpt2_dir
from dikkat.models import GPT
from dikkat.text import load_tokenizer
from dikkat.weights import WEIGHT_FORMATS


def build_app(args: argparse.Namespace, executor: Executor | None = None) -> Any:
    """The app ``dikkat serve`` would serve: the model and its tokenizer, an engine over them
    (stepped in ``executor``, :func:`dikkat.serving.server.create_app`)."""
    check_source(args)
    require_extra("serve", "serve")  # before the model is loaded: fastapi and uvicorn
    from dikkat.serving import Engine  # loaded when a command runs (see dikkat.cli)
    from dikkat.serving.limits import LOOPBACK_NAMES, MIB, WILDCARD_HOSTS, Limits
    from dikkat.serving.paged import default_num_blocks

    device = device_of(args)
    chat_ids = None
    if args.model is not None:
        # a GGUF file's own packed weights, or fp32 for the engine to convert (batched layouts)
        lm = load_pretrained(args, None if args.weights is None else "fp32")
        model, tokenizer, name = lm.model, lm.tokenizer, lm.name
        if lm.chat_template is not None:
            special = args.allow_special_in_content
            chat_ids = functools.partial(lm.chat_ids, special_in_content=special)
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
        compile=compiles(args),
    )
    if compiles(args):  # the batch decode step was compiled or loaded above; a first run of each
        engine.warm_up()
    from dikkat.serving.server import create_app  # needs fastapi (checked above)

    stats = engine.stats()
    chat = "chat and completions" if chat_ids is not None else "completions (no chat template)"
    print(
        f"dikkat: {args.name or name} ({model.n_params:,} parameters, context "
        f"{served_len}) on http://{_address(args.host, args.port)}/v1: {chat}; "
        f"{stats.total_blocks} KV cache blocks of {stats.block_size} tokens, batches of up to "
        f"{args.max_batch}, {engine.weights} weights",
        flush=True,
    )
    if args.host not in LOOPBACK_NAMES and args.api_key is None:
        print(f"dikkat: {args.host} is reachable from other machines, and no --api-key is "
              "asked: anyone who reaches it may use it", file=sys.stderr, flush=True)  # fmt: skip
    hosts = [*([] if args.host in WILDCARD_HOSTS else [args.host]), *args.allowed_hosts]
    return create_app(
        engine,
        tokenizer,
        args.name or name,
        api_key=args.api_key,
        chat_ids=chat_ids,
        max_model_len=args.max_model_len,
        executor=executor,
        limits=Limits(max_body_bytes=int(args.max_body_mb * MIB)),
        allowed_hosts=hosts,
        allowed_origins=args.allowed_origins,
    )


def check_source(args: argparse.Namespace) -> None:
    sources = [s for s in (args.checkpoint, args.hf_gpt2, args.model) if s is not None]
    if len(sources) != 1:
        raise ValueError("give one of a run or model folder, --hf-gpt2 PATH or --model MODEL")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C); with --dry-run, build everything and stop there.

    The address is bound first, before the model loads: one in use, or not this machine's, is
    one line and exit status 2 at once. The model's load, the warm-up and every engine step run
    in one thread, not the event loop's: each thread that starts OpenMP parallel regions gets a
    team of workers of its own, and with more workers than cores libgomp stops spinning idle
    ones (its ``GOMP_SPINCOUNT`` throttling,
    https://gcc.gnu.org/onlinedocs/libgomp/GOMP_005fSPINCOUNT.html), so that every region of
    every step would wait for its workers to wake. However serving ends, the engine's loop is
    stopped and that thread let go, so that nothing keeps the process from exiting.
    """
    check_source(args)
    require_extra("serve", "serve")  # before anything is bound or loaded
    from dikkat.serving.listen import listen

    sockets = [] if args.dry_run else listen(args.host, args.port)
    if sockets:
        args.port = sockets[0].getsockname()[1]  # (port 0: the one the system chose)
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="dikkat-torch")
    app = None
    try:
        app = torch_thread.submit(build_app, args, torch_thread).result()
        if not args.dry_run:
            run_server(app, sockets, args.log_level)
    finally:
        if app is not None:
            app.state.runner.stop()  # (done already after a clean shutdown: then a no-op)
        torch_thread.shutdown(wait=False, cancel_futures=True)
        for sock in sockets:
            sock.close()
    return 0


def run_server(app: Any, sockets: list[socket.socket], log_level: str) -> None:
    """Serve ``app`` on ``sockets`` until interrupted, with the server's uvicorn settings."""
    import uvicorn  # optional, like fastapi (cmd_serve checked that the server imports)

    from dikkat.serving.listen import uvicorn_settings

    settings = uvicorn_settings(app.state.limits, log_level)
    server = uvicorn.Server(uvicorn.Config(app, **settings))
    try:
        server.run(sockets=sockets)
    except OSError as e:  # the sockets are bound, but a listen can still fail
        raise ValueError(f"cannot serve on {sockets[0].getsockname()}: {e}") from None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (one the system chooses) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {port}")
    return port


def api_key(text: str) -> str:
    """argparse type: a key a client can send in an HTTP header."""
    from dikkat.serving.limits import check_api_key  # loaded when the command runs

    try:
        return check_api_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def host_list(text: str) -> list[str]:
    """argparse type: comma-separated host names (``--allowed-hosts``)."""
    return _access_list(text, "hosts")


def origin_list(text: str) -> list[str]:
    """argparse type: comma-separated web origins (``--allowed-origins``)."""
    return _access_list(text, "origins")


def _access_list(text: str, what: str) -> list[str]:
    from dikkat.serving.limits import Access, names  # loaded when the command runs

    items = names(text)
    try:
        Access.of(**{what: items})
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return items


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
    serve.add_argument("--port", type=port_number, default=8000, help="0: any free port")
    serve.add_argument("--name", help="the model's name in the API (default: the folder's)")
    serve.add_argument(
        "--api-key", type=api_key, help="require 'Authorization: Bearer KEY' on every request"
    )
    safety = serve.add_argument_group("who may use it (docs/server.md, 'Running it safely')")
    safety.add_argument(
        "--allowed-hosts",
        type=host_list,
        default=[],
        metavar="NAMES",
        help="comma-separated host names a request's Host header may give, besides localhost, "
        "127.0.0.1, ::1, --host and the address it arrived at ('*': any; the default refuses "
        "other names, as DNS rebinding would send them)",
    )
    safety.add_argument(
        "--allowed-origins",
        type=origin_list,
        default=[],
        metavar="ORIGINS",
        help="comma-separated web origins (http://localhost:3000) whose pages may call the "
        "server, with CORS headers ('*': any; default: none, and a request from any other "
        "origin is refused)",
    )
    safety.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=16.0,
        metavar="MB",
        help="a request body's limit in MiB (default 16; past it 413)",
    )
    safety.add_argument(
        "--allow-special-in-content",
        action="store_true",
        help="tokenise special-token text in chat messages (<|im_start|>) as the special tokens, "
        "which lets a user forge turns of the conversation (default: as plain text)",
    )
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
    add_eager_argument(engine)
    serve.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="load the model, build the server, do not serve"
    )
    add_device(serve)
    add_no_verify(serve)
