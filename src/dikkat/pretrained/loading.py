"""``dikkat.pretrained.load``: a GGUF file or an HF folder → a native
:class:`~dikkat.models.Decoder` (or, from a GPT-2 GGUF file, a :class:`~dikkat.models.GPT`) with
its tokenizer and chat template.

One path for every architecture: the family a file is (:mod:`dikkat.pretrained.families`, found
by its ``general.architecture`` or ``model_type``) gives the config, the tensors' names, their
fix-ups and the model class; this module checks the names and shapes, reads each tensor once,
and hands them to the model, which fuses and holds them
(:meth:`~dikkat.models.holding.HoldsWeights.hold`).

A GGUF file's quantised matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay packed by
default: each is repacked once, exactly, into :class:`~dikkat.weights.packed.PackedWeight`
(:mod:`dikkat.weights.gguf_blocks`) and multiplied as such (:class:`~dikkat.layers.
packed_layers.PackedLinear`; the token embedding a :class:`~dikkat.weights.packed_layers.
PackedEmbedding`, shared with a tied output layer), never expanded to fp32. Its F16 and BF16
matrices stay 16-bit, multiplied and looked up in fp32 (:mod:`dikkat.weights.half`).
``weights="fp32"`` instead dequantises them with the ``gguf`` package, exactly as transformers
reads the same file (``dtype`` then casts the model: bf16 halves it), and the other formats of
:func:`dikkat.weights.inference_model` convert that. The model is built on the ``meta`` device and
takes the loaded tensors as its parameters (``assign=True``), so its weights are allocated once.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from dikkat.models.holding import Stored
from dikkat.models.io import meta_modules
from dikkat.pretrained.families import Family, by_gguf_architecture, by_hf_model_type
from dikkat.pretrained.gguf_checks import check_shape
from dikkat.pretrained.gguf_file import GGUFFile
from dikkat.pretrained.packed_cache import PackedCache
from dikkat.pretrained.sampling_defaults import from_gguf_metadata, from_hf_folder
from dikkat.pretrained.session import Pretrained
from dikkat.pretrained.sources import resolve
from dikkat.pretrained.tokenizer import Tokenizer
from dikkat.weights.formats import HALF_KINDS, PACKED_KINDS, WeightFormat, check_weights, repack
from dikkat.weights.half import HalfLinear
from dikkat.weights.inference import inference_model
from dikkat.weights.packed import PackedWeight, stacked
from dikkat.weights.packed_layers import PackedLinear

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
    matrices packed as the file holds them, and its 16-bit ones in 16 bits unless ``device``
    or ``dtype`` asks for another (on the CPU, in fp32 arithmetic; an HF folder's
    weights stay as they are); "fp32" dequantises them; "bf16", "int8", "w8a8", "q8", "q4"
    convert the fp32 weights (:func:`dikkat.weights.inference_model`).

    Returns a :class:`Pretrained` (``.model``, ``.tokenizer``, ``.generate``, ``.chat``), the
    model in evaluation mode on ``device``, in ``dtype`` (None: fp32).
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if weights is not None:
        weights = check_weights("weights", weights)
    found = resolve(source)
    if found.kind == "gguf":
        # 16-bit matrices are kept so where the model runs on the CPU in fp32 (else read as fp32)
        fp32_cpu = torch.device(device).type == "cpu" and dtype in (None, torch.float32)
        kept = weights is None
        model, tokenizer, template, suggested = _from_gguf(
            found.path, packed=kept, half=kept and fp32_cpu
        )
    else:
        model, tokenizer, template = _from_hf(found.path)
        suggested = from_hf_folder(found.path)
    if any(isinstance(m, (PackedLinear, HalfLinear)) for m in model.modules()):
        if torch.device(device).type != "cpu" or dtype not in (None, torch.float32):
            raise ValueError(
                f"{found.name} keeps its quantised weights packed, which run on the CPU in "
                f"fp32: device={str(device)!r}, dtype={dtype} need weights='fp32' (or another "
                "format of dikkat.weights.inference_model)"
            )
        model.eval()
    else:
        model.to(device=device, dtype=dtype or torch.float32).eval()
        if weights not in (None, "fp32"):
            model = inference_model(model, weights)
    _give_back_freed_memory()
    return Pretrained(model, tokenizer, template, found.name, found.path, suggested)


def _give_back_freed_memory() -> None:
    """Return the heap the load's temporaries freed to the system (glibc keeps freed memory for
    later allocations: after repacking Gemma 3's blocks, ~100 MB of resident memory that nothing
    uses); a no-op where the C library has no ``malloc_trim``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _from_gguf(path: Path, *, packed: bool, half: bool) -> tuple[nn.Module, Tokenizer, str | None]:
    """The model, tokenizer and chat template of a GGUF file, of the family its
    ``general.architecture`` names (:mod:`dikkat.pretrained.families`): the header's sizes are
    held to the tensors before the model is built (on the meta device), and every tensor is
    read once and handed to the model (:meth:`~dikkat.models.holding.HoldsWeights.hold`),
    quantised matrices packed if ``packed``, 16-bit ones in 16 bits if ``half``; and the
    sampling settings its header suggests."""
    file, source = GGUFFile(path), str(path)  # the header's own rules (gguf_file.py)
    family = by_gguf_architecture(file.metadata.get("general.architecture"), source)
    assert family.config_from_gguf is not None  # by_gguf_architecture: only such families
    shapes = {name: info.shape for name, info in file.tensors.items()}
    settings: list[str] = []  # tensors the config read: settings, not weights (rope_freqs)

    def values(name: str) -> Tensor:
        settings.append(name)
        return file.read(name)

    config = family.config_from_gguf(file.metadata, shapes, values, source)
    names = family.tensors.gguf(config)
    _check_names(set(file.tensors), set(names), tuple(settings), source)
    with meta_modules():  # built once, its weights allocated only as they are loaded
        model = family.model(config)
    own = model.weight_shapes()  # every tensor's shape, before any is read or repacked
    for theirs, ours in names.items():
        check_shape(shapes, theirs, own[ours], "the header's sizes", source)
    tokenizer = _tokenizer(file)

    # a large file's repacked matrices come from the cache after its first load
    cache = PackedCache(file) if packed and PackedCache.wanted(file) else None
    cached = cache.read() if cache is not None else None
    writer = cache.writer() if cache is not None and cached is None else None

    in_map: dict[str, int] = {}  # tensors handed to the model where they lie in the file

    def read(theirs: str, ours: str) -> Stored:
        info = file.tensors[theirs]
        if info.kind_name in ("F32", *HALF_KINDS):  # F32, and F16/BF16 kept 16-bit, lie in the map
            keep = half and len(info.shape) in (2, 3) and info.kind_name in HALF_KINDS
            whole = file.read_half(theirs) if keep else file.read(theirs)
            stored: Stored = family.gguf_fix(ours, whole, config)
            if file.lies_in_map(stored):
                in_map[theirs] = stored.untyped_storage().data_ptr()  # type: ignore[union-attr]
            elif file.lies_in_map(whole):  # the fix-up copied it (llama's q/k rows)
                file.let_go(theirs, mapped=True)
            return stored
        elif packed and len(info.shape) in (2, 3) and info.kind_name in PACKED_KINDS:
            if cached is not None and theirs in cached:
                return cached[theirs]
            repacked = _packed(file, theirs, ours, family, config)
            if writer is not None:
                writer.add(theirs, repacked)
            stored = repacked
        else:
            stored = family.gguf_fix(ours, file.read(theirs), config)
        file.let_go(theirs)  # its bytes are copied: the file's pages need not stay resident
        _give_back_freed_memory()  # and the heap its repacking used for a moment
        return stored

    # a bar on a terminal where the tensors take more than a second (a first load repacks)
    total = sum(file.tensors[theirs].nbytes for theirs in names)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"dikkat: reading {path.name}",
               disable=None, delay=1.0, leave=False, file=sys.stderr)  # fmt: skip
    try:
        weights = {}
        for theirs, ours in names.items():
            weights[ours] = read(theirs, ours)
            bar.update(file.tensors[theirs].nbytes)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        bar.close()
    if writer is not None:
        writer.commit()
    model.hold(weights, source)
    held = _held_storages(model)
    for theirs in [t for t, at in in_map.items() if at not in held]:  # joined into a copy
        file.let_go(theirs, mapped=True)
    if cache is not None and cached is not None:
        cache.let_go()
    suggested = from_gguf_metadata(file.metadata, source)
    return model, tokenizer, file.metadata.get("tokenizer.chat_template"), suggested


def _held_storages(model: nn.Module) -> set[int]:
    """Where the storages of every tensor ``model`` holds begin: its parameters and buffers,
    and the tensors its modules keep as attributes (a 16-bit layer's ``parts``)."""
    found = set()
    for module in model.modules():
        for value in [
            *module._parameters.values(),
            *module._buffers.values(),
            *vars(module).values(),
        ]:
            for t in value if isinstance(value, tuple | list) else (value,):
                if isinstance(t, Tensor) and not t.is_meta:
                    found.add(t.untyped_storage().data_ptr())
    return found


def _tokenizer(file: GGUFFile) -> Tokenizer:
    """The tokenizer of an open GGUF file; a vocabulary it cannot be built from is refused
    naming the file (and, from :meth:`Tokenizer.from_gguf_metadata`, the key)."""
    try:
        return Tokenizer.from_gguf_metadata(file.metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file.path}: {e}") from None


SLICE_ROWS = 4096  # rows of a large tensor repacked at a time (a multiple of 16)


def _packed(file: GGUFFile, name: str, ours: str, family: Family, config: Any) -> PackedWeight:
    """Tensor ``name`` repacked in the kernel's groups of 16 rows (which the layers stack and
    hold as they are), its rows in dikkat's order (what the family's fix-up does to the
    dequantised tensor, done to the row indices). A tensor in file order is repacked
    :data:`SLICE_ROWS` rows at a time into the result, so that its repacking needs a slice's
    memory beside it, not a copy of it (a token table is the largest tensor of a small model).
    A stack of matrices (a mixture's experts, (E, rows, K)) is packed as its E·rows rows."""
    info = file.tensors[name]
    where = f"{file.path}: tensor {name!r}"
    *lead, K = info.shape
    N = math.prod(lead)
    raw = file.raw(name)
    rows = torch.arange(N)
    order = family.gguf_fix(ours, rows[:, None], config)[:, 0]
    if not torch.equal(order, rows):
        whole = repack(raw, info.kind_name, (N, K), name=where)
        return whole.take(order).in_groups()

    def repacked(a: int) -> PackedWeight:
        b = min(N, a + SLICE_ROWS)
        p = repack(raw[a:b], info.kind_name, (b - a, K), name=where).in_groups()
        file.let_go(name, (a, b))  # the slice is copied: its pages need not stay resident
        return p

    return stacked(map(repacked, range(0, N, SLICE_ROWS)), N)


def _from_hf(folder: Path) -> tuple[nn.Module, Tokenizer, str | None]:
    from safetensors import safe_open

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / 'config.json'} is not readable JSON: {e}") from None
    family = by_hf_model_type(hf.get("model_type"), str(folder))
    assert family.config_from_hf is not None  # by_hf_model_type: only such families
    config = family.config_from_hf(hf, str(folder))
    names = family.tensors.hf(config)
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

    def read(theirs: str, ours: str) -> Tensor:
        with safe_open(str(where[theirs]), framework="pt") as f:
            return family.hf_fix(ours, f.get_tensor(theirs).float(), config)

    with meta_modules():
        model = family.model(config)
    model.hold({ours: read(theirs, ours) for theirs, ours in names.items()}, str(folder))
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
