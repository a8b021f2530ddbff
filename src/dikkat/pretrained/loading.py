"""``dikkat.pretrained.load``: a GGUF file or an HF folder → a native
:class:`~dikkat.models.Decoder` (or, from a GPT-2 GGUF file, a :class:`~dikkat.models.GPT`) with
its tokenizer and chat template.

A GGUF file's quantised matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay packed by
default: each is repacked once, exactly, into :class:`~dikkat.layers.packed.PackedWeight`
(:mod:`dikkat.pretrained.gguf_packed`) and multiplied as such (:class:`~dikkat.layers.
packed_layers.PackedLinear`; the token embedding a :class:`~dikkat.layers.packed_layers.
PackedEmbedding`, shared with a tied output layer), never expanded to fp32. ``weights="fp32"``
instead dequantises them with the ``gguf`` package, exactly as transformers reads the same file
(``dtype`` then casts the model: bf16 halves it), and the other formats of
:func:`dikkat.layers.inference_model` convert that. The model is built on the ``meta`` device and
takes the loaded tensors as its parameters (``assign=True``), so its weights are allocated once.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dikkat.layers.linear import LinearRows
from dikkat.layers.mlp import GatedMLP
from dikkat.models.decoder import Decoder, DecoderConfig
from dikkat.models.gpt import GPT
from dikkat.models.io import load_checked
from dikkat.pretrained import families
from dikkat.pretrained.gguf_checks import check_shape, gguf_tokenizer
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.gpt2_gguf import gpt_from_gguf
from dikkat.pretrained.session import Pretrained
from dikkat.pretrained.sources import resolve
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.weights.formats import PACKED_KINDS, WeightFormat, check_weights, repack
from dikkat.weights.inference import inference_model
from dikkat.weights.packed import PackedWeight
from dikkat.weights.packed_layers import PackedEmbedding, PackedLinear

__all__ = ["load"]

# tensors some HF checkpoints carry that hold nothing a model needs (RoPE tables it recomputes)
_HF_IGNORED = ("rotary_emb.inv_freq",)


def load(
    source: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    weights: WeightFormat | None = None,
) -> Pretrained:
    """Load a pretrained decoder: ``source`` is a name (``"smollm2"``, ``"gemma3-270m"``), a
    ``.gguf`` file, or a Hugging Face folder (``config.json``, safetensors weights,
    ``tokenizer.json``) of a Llama, Mistral, Qwen2 or Gemma 3 (text) model. A GGUF file of the
    ``gpt2`` architecture (llama.cpp's converter, ``dikkat export --gguf``) becomes a
    :class:`~dikkat.models.GPT`, any other a :class:`~dikkat.models.Decoder`.

    ``weights`` is the format the linear layers hold: None keeps a GGUF file's quantised
    matrices packed as the file holds them (on the CPU, in fp32 arithmetic; an HF folder's
    weights stay as they are); "fp32" dequantises them; "bf16", "int8", "w8a8", "q8", "q4"
    convert the fp32 weights (:func:`dikkat.layers.inference_model`).

    Returns a :class:`Pretrained` (``.model``, ``.tokenizer``, ``.generate``, ``.chat``), the
    model in evaluation mode on ``device``, in ``dtype`` (None: fp32).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if weights is not None:
        weights = check_weights("weights", weights)
    found = resolve(source)
    if found.kind == "gguf":
        model, tokenizer, template = _from_gguf(found.path, packed=weights is None)
    else:
        model, tokenizer, template = _from_hf(found.path)
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        if torch.device(device).type != "cpu" or dtype not in (None, torch.float32):
            raise ValueError(
                f"{found.name} keeps its quantised weights packed, which run on the CPU in "
                f"fp32: device={str(device)!r}, dtype={dtype} need weights='fp32' (or another "
                "format of dikkat.layers.inference_model)"
            )
        model.eval()
    else:
        model.to(device=device, dtype=dtype or torch.float32).eval()
        if weights not in (None, "fp32"):
            model = inference_model(model, weights)
    _give_back_freed_memory()
    return Pretrained(model, tokenizer, template, found.name, found.path)


def _give_back_freed_memory() -> None:
    """Return the heap the load's temporaries freed to the system (glibc keeps freed memory for
    later allocations: after repacking Gemma 3's blocks, ~100 MB of resident memory that nothing
    uses); a no-op where the C library has no ``malloc_trim``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _from_gguf(path: Path, *, packed: bool) -> tuple[Decoder | GPT, Tokenizer, str | None]:
    file = GGUFFile(path)  # the header's own rules (gguf_file.py)
    if file.architecture == "gpt2":  # GPT-2's layout, a dikkat GPT (gpt2_gguf.py)
        model, tokenizer = gpt_from_gguf(file, packed=packed)
        return model, tokenizer, file.metadata.get("tokenizer.chat_template")
    shapes = {name: info.shape for name, info in file.tensors.items()}
    config = families.config_from_gguf(file.metadata, shapes, str(path))
    names = families.gguf_names(config)
    _check_names(set(file.tensors), set(names), (), str(path))
    with torch.device("meta"):  # built once, its weights allocated only as they are loaded
        model = Decoder(config)
    own = model.state_dict()  # every tensor's shape, before any is read or repacked
    for theirs, ours in names.items():
        check_shape(shapes, theirs, tuple(own[ours].shape), "the header's sizes", str(path))
    tokenizer = gguf_tokenizer(file)

    def read(name: str) -> Tensor:
        return families.from_gguf(name, file.read(name), config)

    held: dict[str, PackedWeight] = {}
    if packed:
        for theirs, ours in names.items():
            info = file.tensors[theirs]
            if len(info.shape) == 2 and info.kind_name in PACKED_KINDS:
                held[ours] = _packed(file, theirs, config)
    model = _assemble(model, names, read, str(path), held)
    return model, tokenizer, file.metadata.get("tokenizer.chat_template")


def _packed(file: GGUFFile, name: str, config: DecoderConfig) -> PackedWeight:
    """Tensor ``name`` repacked, its rows in dikkat's order (what :func:`families.from_gguf`
    does to the dequantised tensor, done to the row indices)."""
    info = file.tensors[name]
    where = f"{file.path}: tensor {name!r}"
    p = repack(file.raw(name), info.kind_name, info.shape, name=where)  # type: ignore[arg-type]
    rows = torch.arange(info.shape[0])
    order = families.from_gguf(name, rows[:, None], config)[:, 0]
    return p if torch.equal(order, rows) else p.take(order)


def _from_hf(folder: Path) -> tuple[Decoder, Tokenizer, str | None]:
    from safetensors import safe_open

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / 'config.json'} is not readable JSON: {e}") from None
    config = families.config_from_hf(hf, str(folder))
    names = families.hf_names(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where |= {key: file for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if config.tie_embeddings:
        where.pop("lm_head.weight", None)  # a tied copy some checkpoints store anyway
    _check_names(set(where), set(names), _HF_IGNORED, str(folder))

    def read(name: str) -> Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return families.from_hf(name, f.get_tensor(name).float(), config)

    with torch.device("meta"):
        model = Decoder(config)
    model = _assemble(model, names, read, str(folder))
    tokenizer, template = Tokenizer.from_hf_folder(folder)
    return model, tokenizer, template


def _check_names(stored: set[str], wanted: set[str], ignored: tuple[str, ...], source: str) -> None:
    """Every tensor the model takes is stored, and every stored tensor is taken (or known to be
    meaningless): weights of a component dikkat lacks are refused, never dropped."""
    missing = sorted(wanted - stored)
    extra = sorted(n for n in stored - wanted if not n.endswith(ignored))
    if missing or extra:
        raise ValueError(
            f"{source} does not hold the tensors its config describes: missing {missing[:4]}"
            f"{' …' * (len(missing) > 4)}, not used by dikkat {extra[:4]}{' …' * (len(extra) > 4)}"
        )


def _assemble(
    model: Decoder,
    names: dict[str, str],
    read: Callable[[str], Tensor],
    source: str,
    held: dict[str, PackedWeight] | None = None,
) -> Decoder:
    """``model`` (built on the meta device) holding the stored tensors (each read once, its
    memory kept as the parameter); the weights in ``held`` (dikkat name → packed weight) in
    packed layers instead."""
    held, config = dict(held or {}), model.config
    read_here = {ours: theirs for theirs, ours in names.items()}
    done: set[str] = set()  # dikkat names taken by packed layers
    for i, block in enumerate(model.blocks):
        attn = block.attn
        parts = [f"blocks.{i}.attn.{n}_proj.weight" for n in "qkv"]
        if hasattr(attn, "qkv_proj") and all(n in held for n in parts):
            biases = [n.replace(".weight", ".bias") for n in parts]
            bias = None
            if attn.qkv_proj.bias is not None:
                bias = torch.nn.Parameter(torch.cat([read(read_here[b]) for b in biases]))
            layer = PackedLinear([held.pop(n) for n in parts], bias, False)
            attn.qkv_proj = layer
            for n in "qkv":  # the q/k/v views read their rows of the fused layer
                object.__setattr__(getattr(attn, f"{n}_proj"), "source", layer)
            done |= {*parts, *(biases if bias is not None else ())}
        else:
            held = {k: v for k, v in held.items() if k not in parts}  # all three or none
        pair = [f"blocks.{i}.mlp.{n}.weight" for n in ("gate", "up")]
        if isinstance(block.mlp, GatedMLP) and all(n in held for n in pair):
            # one product for both (gate's rows, then up's); gate and up become its views
            layer = PackedLinear([held.pop(n) for n in pair], None, False)
            hidden = layer.out_features // 2
            block.mlp.gate_up = layer
            block.mlp.gate = LinearRows(layer, 0, hidden)  # type: ignore[arg-type]
            block.mlp.up = LinearRows(layer, hidden, 2 * hidden)  # type: ignore[arg-type]
            done |= set(pair)
    for name, p in held.items():
        _hold(model, name.removesuffix(".weight"), p)
        done.add(name)
    if config.tie_embeddings and "tok_emb.weight" in held:
        model.lm_head = PackedLinear(held["tok_emb.weight"], None, False)  # the same table
    state = {ours: read(theirs) for theirs, ours in names.items() if ours not in done}
    load_checked(model, state, source, assign=True)
    if config.tie_embeddings and "tok_emb.weight" not in held:
        model.lm_head.weight = model.tok_emb.weight  # assign=True replaced the shared parameter
    return model


def _hold(model: Decoder, path: str, p: PackedWeight) -> None:
    """Replace the module at ``path`` (a Linear, or the token embedding) by its packed form."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, leaf)
    packed: torch.nn.Module
    if isinstance(old, torch.nn.Embedding):
        packed = PackedEmbedding(p)
    else:
        packed = PackedLinear(p, old.bias, False)  # the bias (meta) is loaded with the rest
    setattr(parent, leaf, packed)
