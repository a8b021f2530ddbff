"""A fine-tune of a GGUF model, back in GGUF, in the two ways llama.cpp runs one:

- :func:`write_merged_gguf`: a copy of the base file whose changed weights are dequantise(base)
  + delta, quantised again — a model file like any other (``llama-cli -m merged.gguf``);
- :func:`write_lora_gguf`: llama.cpp's own LoRA adapter file, which its tools add to the base at
  run time (``llama-cli -m base.gguf --lora adapter.gguf``).

Both take tensors under the base file's names (``blk.0.attn_q.weight``), in torch order (rows =
output features) and in the file's row order: llama.cpp's converter permutes the rows of a Llama's
q and k (``conversion/llama.py``, ``LlamaModel.permute``, applied to a LoRA's B too through
``LoraTorchTensor.reshape`` in ``convert_lora_to_gguf.py``); undoing or redoing that is the
caller's.

The merged file keeps the base file's header byte for byte — every key in its order, with its
value type (a ``u32`` stays a ``u32``), ``general.alignment`` included — and writes the tensor
directory and data again, one tensor at a time: a tensor that is not changed is copied as it
lies. Quantising is gguf-py's (``gguf.quants.quantize``), whose Q8_0, Q4_0 and Q4_1 are the same
bytes as ggml's reference quantisers (``quantize_row_q8_0_ref`` … in ``ggml/src/ggml-quants.c``;
benchmarks/lora_gguf_check.py compares them with ``llama-quantize --pure``). gguf-py cannot
quantise K-quants or i-quants: a changed tensor stored in one is refused unless ``kind`` names a
type it can.

The adapter file is what ``convert_lora_to_gguf.py`` writes and ``llama_adapter_lora_init_impl``
(``src/llama-adapter.cpp``) checks: ``general.type`` = ``adapter``, ``general.architecture`` the
base's, ``adapter.type`` = ``lora``, ``adapter.lora.alpha`` (f32); per weight ``NAME.lora_a``
(PEFT's A, torch shape (r, K)) and ``NAME.lora_b`` (B, (N, r)), F32. llama.cpp adds
``alpha / r · B (A x)`` to the weight's product (``build_lora_mm`` in ``src/llama-graph.cpp``, r
read from B), PEFT's scaling.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from dikkat.files import atomic_write
from dikkat.validate import check_choice, check_float

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.gguf_reader import ReaderTensor

__all__ = ["KINDS", "write_lora_gguf", "write_merged_gguf"]

KINDS = ("F32", "F16", "BF16", "Q8_0")  # what ``kind`` may name
_FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7}  # gguf.LlamaFileType, by kind
_U32 = 4  # the GGUF value type of general.file_type


def write_merged_gguf(
    base: str | os.PathLike,
    out: str | os.PathLike,
    deltas: Mapping[str, Tensor],
    *,
    kind: str | None = None,
    progress: bool = True,
) -> Path:
    """Write the GGUF file ``base`` to ``out`` with each tensor named in ``deltas`` replaced by
    its dequantised values + the delta (same shape, torch order, the file's row order),
    atomically (a failure leaves what was at ``out``); returns ``out``.

    ``kind`` None: a changed tensor is quantised again in its own type. ``kind`` one of
    :data:`KINDS`: every quantised or 16-bit matrix of the file is written in it (F32 matrices,
    norms and other vectors stay as they are, and so does a matrix whose rows are not whole
    blocks of ``kind``), and ``general.file_type`` (where the file has one) says so. Every other
    tensor is copied byte for byte. One tensor is held in fp32 at a time; ``progress`` shows a
    bar of bytes on a terminal. gguf-py's reader takes seconds on a large vocabulary (10 s on
    Gemma 3's 262 144 tokens).

    >>> deltas = {"blk.0.attn_q.weight": delta}  # (N, K), as the file's rows
    >>> write_merged_gguf("base.gguf", "tuned.gguf", deltas)  # doctest: +SKIP
    PosixPath('tuned.gguf')
    """
    from gguf import GGMLQuantizationType  # a fifth of a second to import: only when writing

    if kind is not None:
        check_choice("kind", kind, KINDS)
    base, out = Path(base), Path(out)
    reader = _open_base(base, out)
    tensors = {t.name: t for t in reader.tensors}
    _check_deltas(base, tensors, deltas)
    target = None if kind is None else GGMLQuantizationType[kind]
    plan = {name: _planned(t, name in deltas, target) for name, t in tensors.items()}
    version, n_keys, keys = _header(reader, None if kind is None else _FILE_TYPES[kind])
    sizes = {name: _nbytes(_shape(tensors[name]), qtype) for name, qtype in plan.items()}
    alignment = int(reader.alignment)  # general.alignment, or GGUF's default of 32

    def write(tmp: str) -> None:
        bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, file=sys.stderr,
                   desc=f"dikkat: writing {out.name}", disable=None if progress else True,
                   delay=1.0, leave=False)  # fmt: skip
        with open(tmp, "wb") as f, bar:
            f.write(b"GGUF" + version + struct.pack("<QQ", len(plan), n_keys) + keys)
            offset = 0
            for name, qtype in plan.items():
                f.write(_directory_entry(name, _shape(tensors[name]), qtype, offset))
                offset += -(-sizes[name] // alignment) * alignment
            f.write(bytes(-f.tell() % alignment))
            for name, qtype in plan.items():
                data = _tensor_bytes(reader, tensors[name], qtype, deltas.get(name))
                f.write(data)
                f.write(bytes(-len(data) % alignment))
                bar.update(len(data))

    atomic_write(out, write)
    return out


def write_lora_gguf(
    base: str | os.PathLike,
    out: str | os.PathLike,
    adapters: Mapping[str, tuple[Tensor, Tensor]],
    *,
    alpha: float,
) -> Path:
    """Write llama.cpp's LoRA adapter file for the GGUF model ``base`` at ``out``, atomically;
    returns ``out``. ``adapters`` maps a base tensor's name to PEFT's (A, B): A (r, K) =
    ``lora_A.weight``, B (N, r) = ``lora_B.weight`` for a weight of N × K, its rows in the file's
    order; the weight becomes W + alpha / r · B A, as in PEFT (not rsLoRA's alpha / √r).

    ``token_embd.weight`` is refused: llama.cpp applies an embedding's LoRA at the lookup only, A
    and B swapped (``build_inp_embd``), and fails where the table is also the output layer; merge
    such a change with :func:`write_merged_gguf`.

    >>> adapters = {"blk.0.attn_q.weight": (a, b)}  # A (r, K), B (N, r)
    >>> write_lora_gguf("base.gguf", "lora.gguf", adapters, alpha=16)  # doctest: +SKIP
    PosixPath('lora.gguf')
    """
    alpha = check_float("alpha", alpha, low=0.0, low_open=True)  # 0 means scale 1 to llama.cpp
    base, out = Path(base), Path(out)
    reader = _open_base(base, out)
    tensors = {t.name: t for t in reader.tensors}
    if not isinstance(adapters, Mapping) or not adapters:
        raise TypeError("adapters must be a non-empty mapping of tensor name → (A, B)")
    pairs = {name: _checked_pair(base, tensors, name, pair) for name, pair in adapters.items()}
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"{base} has no general.architecture, which llama.cpp's adapter needs")

    def write(tmp: str) -> None:
        import gguf  # the format's own writer, as llama.cpp's converter uses

        writer = gguf.GGUFWriter(tmp, architecture)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for name, (a, b) in pairs.items():
            writer.add_tensor(f"{name}.lora_a", a)
            writer.add_tensor(f"{name}.lora_b", b)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(out, write)
    return out


def _open_base(base: Path, out: Path) -> GGUFReader:
    """The base file, opened by gguf-py's reader (its tensors are views of a read-only map);
    ``out`` refused where it is ``base`` or a folder."""
    from gguf import GGUFReader

    if out.is_dir():
        raise ValueError(f"out {out} is a folder: give the path of the .gguf file to write")
    if out.resolve() == base.resolve() or (out.exists() and os.path.samefile(out, base)):
        raise ValueError(f"out {out} is the base file {base}: write the result beside it")
    if not base.is_file():
        raise FileNotFoundError(f"no GGUF file at {base}")
    return GGUFReader(base)


def _check_deltas(
    base: Path, tensors: dict[str, ReaderTensor], deltas: Mapping[str, Tensor]
) -> None:
    if not isinstance(deltas, Mapping):
        raise TypeError(f"deltas must be a mapping of tensor name → tensor, got {type(deltas)}")
    for name, delta in deltas.items():
        shape = _shape(_tensor(base, tensors, name, "deltas"))
        if not isinstance(delta, Tensor) or not delta.is_floating_point():
            raise TypeError(f"deltas[{name!r}] must be a float tensor, got {_described(delta)}")
        if tuple(delta.shape) != shape:
            raise ValueError(
                f"deltas[{name!r}] has shape {tuple(delta.shape)}, but {base.name} holds "
                f"{name!r} as {shape} (torch order: rows = output features)"
            )
        if not bool(torch.isfinite(delta).all()):
            raise ValueError(f"deltas[{name!r}] holds NaN or Inf")


def _checked_pair(
    base: Path, tensors: dict[str, ReaderTensor], name: str, pair: object
) -> tuple[np.ndarray, np.ndarray]:
    """``adapters[name]`` as (A, B) fp32 arrays, checked against the base tensor's shape."""
    shape = _shape(_tensor(base, tensors, name, "adapters"))
    if name == "token_embd.weight":
        raise ValueError(
            "adapters names 'token_embd.weight': llama.cpp applies an embedding's LoRA at the "
            "lookup only (and fails where the table is the output layer too); merge it with "
            "write_merged_gguf instead"
        )
    if len(shape) != 2:
        raise ValueError(f"adapters names {name!r}, of shape {shape}: not a matrix")
    ok = isinstance(pair, tuple | list) and len(pair) == 2
    if not ok or not all(isinstance(t, Tensor) and t.is_floating_point() for t in pair):
        got = ", ".join(map(_described, pair)) if ok else _described(pair)
        raise TypeError(f"adapters[{name!r}] must be (A, B), two float tensors, got {got}")
    a, b = pair
    (n, k), r = shape, a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape != (n, r) or r < 1:
        raise ValueError(
            f"adapters[{name!r}] has A {tuple(a.shape)} and B {tuple(b.shape)}; for {name!r} of "
            f"{shape} they must be (r, {k}) and ({n}, r)"
        )
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        raise ValueError(f"adapters[{name!r}] holds NaN or Inf")
    a, b = (t.detach().to("cpu", torch.float32).contiguous().numpy() for t in (a, b))
    return a, b


def _tensor(base: Path, tensors: dict[str, ReaderTensor], name: str, what: str) -> ReaderTensor:
    tensor = tensors.get(name)
    if tensor is None:
        some = ", ".join(repr(n) for n in list(tensors)[:4])
        raise ValueError(
            f"{what} names {name!r}, which {base.name} does not hold (it holds {len(tensors)} "
            f"tensors: {some}, …)"
        )
    return tensor


def _shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """``tensor``'s shape in torch order (GGUF lists dimensions fastest first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _planned(
    tensor: ReaderTensor, changed: bool, kind: GGMLQuantizationType | None
) -> GGMLQuantizationType:
    """The GGML type ``tensor`` is written in; ``ValueError`` where that needs gguf-py to
    dequantise or quantise a type it cannot."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    stored, shape = GGMLQuantizationType(tensor.tensor_type), _shape(tensor)
    converted = (
        kind is not None
        and stored != GGMLQuantizationType.F32
        and len(shape) >= 2
        and shape[-1] % GGML_QUANT_SIZES[kind][0] == 0
    )
    qtype = kind if converted else stored
    if changed or converted:
        what = f"tensor {tensor.name!r} is stored as {stored.name}, which the gguf package"
        if not _able("dequantise", stored):
            raise ValueError(f"{what} cannot dequantise: it can be neither changed nor converted")
        if not _able("quantise", qtype):
            raise ValueError(f'{what} cannot quantise: pass kind="Q8_0" or kind="F16" to write it')
    return qtype


@functools.cache
def _able(how: str, qtype: GGMLQuantizationType) -> bool:
    """Whether gguf-py can ``how`` (quantise, dequantise) ``qtype``: a block of zeros, tried."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize, quantize

    values, nbytes = GGML_QUANT_SIZES[qtype]
    try:
        if how == "quantise":
            quantize(np.zeros((1, values), np.float32), qtype)
        else:
            dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _header(reader: GGUFReader, file_type: int | None) -> tuple[bytes, int, bytes]:
    """(version, key count, the keys' bytes) of the base file, as they lie, in their order;
    ``general.file_type`` written as ``file_type`` where that is given."""
    keys = [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]  # not keys
    ends = [f.offset for f in keys[1:]] + [keys[-1].offset + sum(p.nbytes for p in keys[-1].parts)]
    data = reader.data  # the whole file, mapped
    pieces = []
    for field, end in zip(keys, ends, strict=True):
        if field.name == "general.file_type" and file_type is not None:
            pieces.append(_string(field.name) + struct.pack("<II", _U32, file_type))
        else:
            pieces.append(data[field.offset : end].tobytes())
    return data[4:8].tobytes(), len(keys), b"".join(pieces)


def _tensor_bytes(
    reader: GGUFReader, tensor: ReaderTensor, qtype: GGMLQuantizationType, delta: Tensor | None
) -> memoryview:
    """The bytes ``tensor`` is written as: as it lies, or dequantised, the delta added, and
    quantised in ``qtype``."""
    from gguf.quants import dequantize, quantize

    stored = reader.data[tensor.data_offset : tensor.data_offset + tensor.n_bytes]
    if delta is None and qtype == tensor.tensor_type:
        return memoryview(stored)  # the file's pages, not a copy
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf are refused below
        values = dequantize(tensor.data, tensor.tensor_type).reshape(_shape(tensor))
    values = np.asarray(values, dtype=np.float32)
    if delta is not None:
        values = values + delta.detach().to("cpu", torch.float32).numpy()
    with np.errstate(invalid="ignore", over="ignore"):  # refused just below
        data = quantize(values, qtype)
        back = dequantize(data, qtype)
    if not np.isfinite(back).all():  # NaN in the base, F16 past ±65504, a scale past fp16's
        raise ValueError(
            f"tensor {tensor.name!r}: its values (largest |x| "
            f"{float(np.abs(values).max()):.4g}) do not fit {qtype.name}, or the base holds NaN"
        )
    return memoryview(data.reshape(-1).view(np.uint8))


def _directory_entry(
    name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, offset: int
) -> bytes:
    """One tensor's entry: name, n_dims, dims fastest first, GGML type, offset in the data."""
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *reversed(shape))
    return _string(name) + dims + struct.pack("<IQ", int(qtype), offset)


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=object)) // block * block_bytes


def _described(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor"
    return type(value).__name__
