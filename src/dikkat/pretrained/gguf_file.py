"""Reading a GGUF file: its metadata, its tensor directory, and each tensor dequantised.

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) is one file: a header of typed
key/value pairs (the architecture's sizes, the tokenizer's vocabulary, the chat template), a
directory of tensors (name, dims, quantisation type, offset), then the tensor data, aligned.

The header is parsed here, in bulk: ``gguf.GGUFReader`` builds a Python object for every element
of every array, which takes tens of seconds on a 262 144-token vocabulary. The tensor data stays
in a read-only memory map and each tensor is dequantised by the ``gguf`` package
(``gguf.quants.dequantize``), the format's own reference implementation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["GGUFFile", "TensorInfo"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value types: id → (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool: one byte
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


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


class _Cursor:
    """Reads little-endian values from the header, naming the file when it ends too early."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.pos, self.path = buffer, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buffer):
            raise ValueError(f"{self.path} ends inside its GGUF header: truncated or not GGUF")
        view = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind][0]
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        return bytes(self.take(self.scalar(10))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar(4), self.scalar(10)
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                data = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
                return (data != 0).tolist() if item == _BOOL else data.tolist()
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind in _SCALARS:
            value = self.scalar(kind)
            return bool(value) if kind == _BOOL else value
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} in the header")


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (key → value) and ``tensors`` (name →
    :class:`TensorInfo`); :meth:`read` dequantises one tensor to fp32.

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
        cursor = _Cursor(memoryview(self._map), self.path)
        if bytes(cursor.take(4)) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        version = cursor.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{self.path} is GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_keys = cursor.scalar(10), cursor.scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_keys):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar(4))
        directory = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar(10) for _ in range(cursor.scalar(4))]
            directory.append((name, tuple(reversed(dims)), cursor.scalar(4), cursor.scalar(10)))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in directory:
            info = TensorInfo(name, shape, kind, start + offset, _nbytes(shape, kind, name))
            if info.offset + info.nbytes > size:
                raise ValueError(
                    f"{self.path}: tensor {name!r} ends at byte {info.offset + info.nbytes}, past "
                    f"the end of the file ({size} bytes): the file is truncated"
                )
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name``, (rows, bytes per row) uint8, read-only."""
        info = self._info(name)
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, info.nbytes // rows)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` dequantised to fp32, in torch order (a new, writable tensor)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self._info(name)
        values = dequantize(self.raw(name), GGMLQuantizationType(info.kind))
        return torch.from_numpy(np.array(values, dtype=np.float32)).view(info.shape)  # a copy

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path} holds no tensor {name!r}")
        return info


def _nbytes(shape: tuple[int, ...], kind: int, name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has GGML type {kind}, which gguf cannot read") from None
    elements = int(np.prod(shape))
    if shape and shape[-1] % block:
        raise ValueError(
            f"tensor {name!r}: a row of {shape[-1]} values is not a whole number of "
            f"{block}-value blocks"
        )
    return elements // block * block_bytes
