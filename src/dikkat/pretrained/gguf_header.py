"""The typed values of a GGUF file's header (https://github.com/ggml-org/ggml/blob/master/docs/
gguf.md), read in bulk by :class:`Cursor`, every length held against the bytes left before
anything sized by it is built (:mod:`dikkat.pretrained.gguf_file` reads the file with it)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["KEY_BYTES", "MAX_NESTING", "TENSOR_BYTES", "Cursor", "shown"]

MAX_NESTING = 4  # arrays of arrays this deep at most (ggml's reader takes none nested)

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
_U64 = struct.Struct("<Q")
# the fewest bytes one entry can take: a key (length, type, a one-byte value); an array item
# by type; a tensor's directory entry (name length, n_dims, type, offset)
KEY_BYTES, TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
_ITEM_BYTES = {_STRING: 8, _ARRAY: 4 + 8} | {
    k: struct.calcsize(f) for k, (f, _) in _SCALARS.items()
}


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a file's strings in a one-line
    message (a key or a token may be megabytes long, or hold a newline)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "…"


class Cursor:
    """Reads little-endian values from the header; every read is held against the bytes left,
    and a failure names the file and what was being read."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.pos, self.path = buffer, 0, path

    @property
    def left(self) -> int:
        return len(self.buffer) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left:
            raise ValueError(
                f"{self.path}: {what} needs {n} bytes at byte {self.pos}, but the file ends "
                f"{self.left} bytes later: it is truncated, damaged or not GGUF"
            )
        view = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, kind: int, what: str) -> Any:
        fmt = _SCALARS[kind][0]
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        return value

    def string(self, what: str) -> str:
        n = self.scalar(10, f"the length of {what}")
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings: :meth:`string` in a tight loop (a vocabulary holds 10⁵ of them)."""
        buffer, pos, end, out = self.buffer, self.pos, len(self.buffer), []
        unpack, add = _U64.unpack_from, out.append
        for _ in range(count):
            n = unpack(buffer, pos)[0] if pos + 8 <= end else end  # a length past the end
            if pos + 8 + n > end:
                self.pos = pos
                self.take(8 + n, f"item {len(out)} of {what}")  # raises, naming the place
            add(str(buffer[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            if depth >= MAX_NESTING:
                raise ValueError(
                    f"{self.path}: {what} holds arrays nested more than {MAX_NESTING} deep"
                )
            item, count = self.scalar(4, f"the item type of {what}"), self.scalar(10, what)
            size = _ITEM_BYTES.get(item)
            if size is None:
                raise ValueError(f"{self.path}: {what} is an array of unknown GGUF type {item}")
            if count * size > self.left:  # before any list of that many items is built
                raise ValueError(
                    f"{self.path}: {what} claims {count} items, which need at least "
                    f"{count * size} bytes; {self.left} are left in the file"
                )
            if item == _STRING:
                return self.strings(count, what)
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                data = np.frombuffer(self.take(count * size, what), dtype=dtype)
                return (data != 0).tolist() if item == _BOOL else data.tolist()
            return [self.value(item, what, depth + 1) for _ in range(count)]
        if kind in _SCALARS:
            value = self.scalar(kind, what)
            return bool(value) if kind == _BOOL else value
        raise ValueError(f"{self.path}: {what} has unknown GGUF value type {kind}")
