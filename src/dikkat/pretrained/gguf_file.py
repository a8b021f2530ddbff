"""Reading a GGUF file: its metadata, its tensor directory, and each tensor dequantised.

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is one file: a header of typed
key/value pairs (the architecture's sizes, the tokenizer's vocabulary, the chat template), a
directory of tensors (name, dims, quantisation type, offset), then the tensor data, aligned.

The header is parsed here, in bulk (:mod:`dikkat.pretrained.gguf_header`): ``gguf.GGUFReader``
builds a Python object for every element of every array, which takes tens of seconds on a
262 144-token vocabulary. The tensor data stays in a read-only memory map; a quantised tensor is
dequantised from it by the ``gguf`` package (``gguf.quants.dequantize``), the format's own
reference implementation. An F32, F16 or BF16 tensor is used where it lies: a tensor over a
private (copy-on-write) map of the file, so that its bytes are the system's page cache, shared
with every process that maps the file, read in large pieces as they are first touched, and
written nowhere (a write makes the process its own copy of the page); it reads faster than the
same bytes copied into fresh memory (BENCHMARKS.md, "Weights where the file lies"), as llama.cpp
maps its files (``llama_mmap``). :meth:`GGUFFile.read_half` keeps 16 bits. A file changed in
place while a model uses it (not replaced by a rename, as dikkat writes files) changes or, cut
short, kills the process (``SIGBUS``), as it does llama.cpp.

Nothing in the file is trusted (docs/models.md, "What a load checks"). Every length and count is
held against the bytes left before anything sized by it is built; arrays nest at most
:data:`MAX_NESTING` deep; a key or a tensor name appears once; ``general.alignment`` is a power
of two; a tensor has at most four dimensions and fewer than 2⁶³ values; the tensors lie one after
another in the data section, in directory order, each at the aligned end of the one before.
Those are the rules of ggml's own reader (``ggml/src/gguf.cpp``, ``gguf_init_from_file_impl``),
with which llama.cpp loads every file, so a file it reads passes them. One more: the file ends
with the last tensor's data (and its padding), as gguf-py's writer and ggml's leave it. Together
they make a wrong offset, shape or type id (F16 written over a Q4_1 tensor's type) a gap, an
overlap or bytes left over, refused by name. :meth:`GGUFFile.read` refuses a tensor holding NaN
or ±Inf.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dikkat.pretrained.gguf_header import KEY_BYTES, MAX_NESTING, TENSOR_BYTES, Cursor, shown
from dikkat.weights.formats import HALF_KINDS

__all__ = ["MAX_NESTING", "GGUFFile", "TensorInfo", "shown"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_INT64_MAX = 2**63 - 1
_INTEGER_KINDS = ("I8", "I16", "I32", "I64")  # GGML types that hold no weights
# the kinds read as they are stored, as these dtypes
_WHOLE = {"F32": torch.float32, **HALF_KINDS}
_CHECKED_ROWS = 4096  # rows looked at together for NaN and Inf
_READ_BYTES = 1 << 26  # bytes a read asks for (Linux reads at most 2 GiB - 4 KiB at once)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: GGUF lists dims fastest first, so this is reversed
    kind: int  # a gguf.GGMLQuantizationType value (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, …)
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def kind_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.kind).name


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (key → value) and ``tensors`` (name →
    :class:`TensorInfo`); :meth:`read` dequantises one tensor to fp32. A file that breaks the
    format's rules (the module's notes) is refused with a ``ValueError`` naming it.

    >>> f = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    >>> f.metadata["general.architecture"], f.tensors["blk.0.attn_q.weight"].kind_name
    ('llama', 'Q4_1')
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        with self.path.open("rb") as file:
            size = self.path.stat().st_size
            if size < 24:
                raise ValueError(f"{self.path} is {size} bytes long: not a GGUF file")
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            # the same file (not whatever its path names later), for reads into a tensor
            self._fd = os.dup(file.fileno())
        weakref.finalize(self, os.close, self._fd)
        self._private: mmap.mmap | None = None  # where F32/F16/BF16 tensors lie (_whole)
        cursor = Cursor(memoryview(self._map), self.path)
        if bytes(cursor.take(4, "the magic")) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        version = cursor.scalar(4, "the version")
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are read")
        n_tensors = cursor.scalar(10, "the tensor count")
        n_keys = cursor.scalar(10, "the key count")
        least = n_keys * KEY_BYTES + n_tensors * TENSOR_BYTES
        if least > cursor.left:
            raise ValueError(
                f"{self.path}: the header lists {n_tensors} tensors and {n_keys} keys, which "
                f"take at least {least} bytes; {cursor.left} are left in the file"
            )
        self.metadata: dict[str, Any] = {}
        for i in range(n_keys):
            key = cursor.string(f"the name of key #{i}")
            if key in self.metadata:
                raise ValueError(f"{self.path}: key {shown(key)} is in the header twice")
            self.metadata[key] = cursor.value(
                cursor.scalar(4, f"the type of key {shown(key)}"), f"key {shown(key)}"
            )
        alignment = _alignment(self.metadata, self.path)
        directory = [_directory_entry(cursor, i, self.path) for i in range(n_tensors)]
        start = -(-cursor.pos // alignment) * alignment
        self.data_start = start  # where the tensors' data begins: the header is all before it
        self.tensors: dict[str, TensorInfo] = {}
        end, previous = 0, None  # where the previous tensor's data ends, padded, from start
        for name, shape, kind, offset in directory:
            if name in self.tensors:
                raise ValueError(f"{self.path}: tensor {shown(name)} is listed twice")
            info = TensorInfo(name, shape, kind, start + offset, _nbytes(shape, kind, name, path))
            _check_place(info, offset, end, previous, alignment, size, self.path)
            self.tensors[name] = info
            end, previous = offset + -(-info.nbytes // alignment) * alignment, name
        if size > start + end:  # bytes no tensor reads: a shifted start, a shrunk last tensor
            raise ValueError(
                f"{self.path} holds {size - start - end} bytes after the data of its last "
                f"tensor {shown(previous)}: a tensor's type, shape or offset, or "
                "general.alignment, is wrong"
            )

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name``, (rows, bytes per row) uint8, read-only."""
        info = self._info(name)
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, info.nbytes // rows if rows else 0)

    def header_bytes(self) -> bytes:
        """The header's bytes (keys, values, the tensors' directory): all before the data."""
        return self._map[: self.data_start]

    def lies_in_map(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lies in the file's private map (as :meth:`read` and
        :meth:`read_half` give F32, F16 and BF16 tensors)."""
        if self._private is None:
            return False
        start = torch.frombuffer(self._private, dtype=torch.uint8, count=1).data_ptr()
        return start <= tensor.data_ptr() < start + len(self._private)

    def let_go(
        self, name: str, rows: tuple[int, int] | None = None, *, mapped: bool = False
    ) -> None:
        """Drop the pages of tensor ``name``'s bytes (of its ``rows`` [start, stop) of
        :meth:`raw`, default all) from this process's resident memory: a loader that has made
        its own copy calls it, so that the file's pages do not stay resident beside the copies
        (the file stays mapped and in the system's page cache; a later read faults the pages in
        again). ``mapped``: the pages of the private map that :meth:`read` and
        :meth:`read_half` give tensors in, only those wholly within the tensor's bytes — which
        must then be used no more (a page written to is dropped with what was written). A
        no-op where ``madvise`` is missing."""
        info = self._info(name)
        n = max(1, int(np.prod(info.shape[:-1])))
        if rows is not None and not 0 <= rows[0] <= rows[1] <= n:
            raise ValueError(f"rows must lie in [0, {n}] for tensor {shown(name)}, got {rows}")
        row_bytes = info.nbytes // n
        first, stop = (
            (0, info.nbytes) if rows is None else (rows[0] * row_bytes, rows[1] * row_bytes)
        )
        if not hasattr(mmap, "MADV_DONTNEED") or stop <= first:
            return
        page = mmap.PAGESIZE
        if mapped:  # inward: a page shared with a neighbour in use stays
            start = -(-(info.offset + first) // page) * page
            end = (info.offset + stop) // page * page
            if self._private is not None and end > start:
                self._private.madvise(mmap.MADV_DONTNEED, start, end - start)
            return
        start = (info.offset + first) // page * page
        self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + stop - start)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` dequantised to fp32, in torch order (writable; an F32 one lies in the
        file's private map, see the module doc); a ``ValueError`` where it holds NaN or ±Inf, or
        integers (I8 … I64: no weights)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self._info(name)
        if info.kind_name in _INTEGER_KINDS:
            raise ValueError(
                f"{self.path}: tensor {shown(name)} is stored as {info.kind_name}: integers, "
                "which no model reads as weights (a damaged type id?)"
            )
        if info.kind_name in _WHOLE:  # fp32 as stored, or 16 bits widened: no dequantising
            stored = self._whole(info, _WHOLE[info.kind_name])
            if stored.dtype == torch.float32:
                return stored
            widened = stored.float()
            self.let_go(name, mapped=True)  # copied: the map's pages need not stay resident
            return widened
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # NaN is refused just below
                values = dequantize(self.raw(name), GGMLQuantizationType(info.kind))
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {shown(name)} is stored as {info.kind_name}, which the gguf "
                "package cannot dequantise"
            ) from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32)).view(info.shape)  # a copy
        self._check_finite(tensor, info)
        return tensor

    def read_half(self, name: str) -> Tensor:
        """Tensor ``name``, stored as F16 or BF16, as it is stored: fp16 or bf16 in torch order
        (writable, in the file's private map); a ``ValueError`` where it holds NaN or ±Inf or is
        stored as another kind."""
        info = self._info(name)
        dtype = HALF_KINDS.get(info.kind_name)
        if dtype is None:
            raise ValueError(
                f"{self.path}: tensor {shown(name)} is stored as {info.kind_name}, not in 16 bits "
                f"({', '.join(HALF_KINDS)})"
            )
        return self._whole(info, dtype)

    def _whole(self, info: TensorInfo, dtype: torch.dtype) -> Tensor:
        """``info``'s bytes, stored as ``dtype``, as a tensor over the file's private map (read
        into a new tensor where its offset is not a multiple of the dtype's size), checked for
        NaN and Inf."""
        if os.fstat(self._fd).st_size < info.offset + info.nbytes:
            raise ValueError(
                f"{self.path}: tensor {shown(info.name)} ends past the end of the file, which "
                "changed while it was read"
            )
        if info.offset % dtype.itemsize == 0:
            if self._private is None:  # copy-on-write: writes reach neither the file nor others
                self._private = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            count = info.nbytes // dtype.itemsize
            tensor = torch.frombuffer(self._private, dtype=dtype, count=count, offset=info.offset)
            tensor = tensor.view(info.shape)
        else:
            tensor = torch.empty(info.shape, dtype=dtype)
            self._read_into(tensor, info)
        self._check_finite(tensor, info)
        return tensor

    def _read_into(self, tensor: Tensor, info: TensorInfo) -> None:
        """``info``'s bytes into ``tensor`` (contiguous, as many bytes), read from the file by
        the system's reads, in slices."""
        out = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        if not hasattr(os, "preadv"):  # (not on every system): a copy from the map
            out[:] = memoryview(self._map)[info.offset : info.offset + info.nbytes]
            return
        done = 0
        while done < info.nbytes:
            n = min(info.nbytes - done, _READ_BYTES)
            got = os.preadv(self._fd, [out[done : done + n]], info.offset + done)
            if got <= 0:
                raise ValueError(
                    f"{self.path}: tensor {shown(info.name)} ends past the end of the file, "
                    "which changed while it was read"
                )
            done += got

    def _check_finite(self, tensor: Tensor, info: TensorInfo) -> None:
        """A ``ValueError`` naming the first NaN or ±Inf of ``tensor`` (read from ``info``'s
        bytes), if it has one: a slice of rows at a time, in its own dtype, by its smallest
        and largest values (which are NaN or ±Inf where any value is)."""
        rows = tensor.view(-1, info.shape[-1]) if len(info.shape) > 1 else tensor.view(1, -1)
        for a in range(0, rows.shape[0], _CHECKED_ROWS):
            part = rows[a : a + _CHECKED_ROWS]
            if part.numel() == 0 or all(map(math.isfinite, torch.aminmax(part))):
                continue
            first = a * rows.shape[1] + int((~torch.isfinite(part)).flatten().nonzero()[0, 0])
            raise ValueError(
                f"{self.path}: tensor {shown(info.name)} ({info.kind_name}) holds NaN or Inf, "
                f"the first at {_place(first, info.shape)}: the file is damaged"
            )

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        return info


def _place(index: int, shape: tuple[int, ...]) -> str:
    """Flat ``index`` of a tensor of ``shape`` as "row r, column c" (rows: all but the last
    dimension, flattened) or, for a vector, "value i"."""
    if len(shape) < 2:
        return f"value {index}"
    return f"row {index // shape[-1]}, column {index % shape[-1]}"


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    """``general.alignment``: an integer power of two (ggml reads it as uint32 and refuses
    any other)."""
    value = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(
            f"{path}: general.alignment = {shown(value)} is not a power of two: the tensors' "
            "offsets cannot be read"
        )
    return value


def _directory_entry(cursor: Cursor, i: int, path: Path) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor's entry: name, torch-order shape, GGML type, offset in the data section."""
    name = cursor.string(f"the name of tensor #{i}")
    what = f"tensor {shown(name)}"
    n_dims = cursor.scalar(4, f"the dimension count of {what}")
    if n_dims > _MAX_DIMS:  # before reading that many
        raise ValueError(
            f"{path}: {what} has {n_dims} dimensions; a GGUF tensor has at most {_MAX_DIMS}"
        )
    dims = [cursor.scalar(10, f"the dimensions of {what}") for _ in range(n_dims)]
    count = 1
    for d in dims:
        count *= max(d, 1)
        if d > _INT64_MAX or count > _INT64_MAX:  # ggml's dims are int64_t
            raise ValueError(
                f"{path}: {what} has dimensions {dims} (fastest first), more values than a "
                "64-bit count holds"
            )
    kind = cursor.scalar(4, f"the type of {what}")
    return name, tuple(reversed(dims)), kind, cursor.scalar(10, f"the offset of {what}")


def _check_place(
    info: TensorInfo,
    offset: int,
    end: int,
    previous: str | None,
    alignment: int,
    size: int,
    path: Path,
) -> None:
    """``info`` starts at the aligned end of the previous tensor and ends inside the file."""
    what = f"tensor {shown(info.name)}"
    if offset % alignment:
        raise ValueError(
            f"{path}: {what} starts at offset {offset} of the data section, not a multiple of "
            f"the alignment {alignment}"
        )
    if offset != end:
        if previous is None:
            where = "the data section's first tensor starts at 0"
        else:
            how = "overlaps" if offset < end else f"leaves {offset - end} bytes after"
            where = f"{how} the data of {shown(previous)}, which ends at {end}"
        raise ValueError(
            f"{path}: {what} starts at offset {offset}, but {where}: its offset, or the type "
            "or shape of a tensor before it, is wrong"
        )
    if info.offset + info.nbytes > size:
        raise ValueError(
            f"{path}: {what} ends at byte {info.offset + info.nbytes}, past the end of the "
            f"file ({size} bytes): the file is truncated, or the tensor's type or shape is wrong"
        )


def _nbytes(shape: tuple[int, ...], kind: int, name: str, path: Path) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ValueError(
            f"{path}: tensor {shown(name)} has GGML type {kind}, which gguf cannot read"
        ) from None
    row = shape[-1] if shape else 1
    if row % block:
        raise ValueError(
            f"{path}: tensor {shown(name)}: a row of {row} values is not a whole number of "
            f"{block}-value blocks"
        )
    elements = int(np.prod(shape, dtype=object)) if shape else 1
    return elements // block * block_bytes
