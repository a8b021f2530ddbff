"""A tiny Llama-architecture GGUF file, written byte by byte, with a map of where each header
field lies: the material the hostile-file tests damage (tests/pretrained/test_gguf_hostile.py,
test_gguf_fuzz.py).

The layout is the format's (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic,
version 3, tensor count, key count, the keys (name, type, value), the tensor directory (name,
n_dims, dims fastest first, GGML type, offset in the data section), then the data section at the
next multiple of the alignment, each tensor's bytes padded to the alignment as gguf-py's writer
and llama.cpp pad them. Quantised blocks come from gguf-py's own ``gguf.quants.quantize``.

The model: 2 layers of width 64, 4 query heads over 2 key/value heads, an MLP of 96, a tied
token embedding (Q8_0) over a byte-level BPE vocabulary of the 256 byte symbols, a few merges and
three control tokens; q, k, attn_output, gate and down in Q4_1, v and up in Q8_0, the norms and
blk.1's attn_output in F32 — so that the packed path (the q/k/v and gate/up fusions included),
the embedding and a float matrix are all read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
            BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
# GGML tensor types used here
T_F32, T_F16, T_Q4_1, T_Q8_0, T_BF16 = 0, 1, 3, 8, 30

WIDTH, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 96, 2
WORDS = ("the", "quick", "brown", "fox", "and", "cat", "sat")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass
class Key:
    """One header key: its name, value type and value (``sub``: an array's item type)."""

    name: str
    kind: int
    value: Any
    sub: int | None = None


@dataclass
class Tensor:
    """One tensor: its name, GGML type, torch-order shape and stored bytes."""

    name: str
    kind: int
    shape: tuple[int, ...]
    data: bytes


@dataclass
class Layout:
    """Where things lie in the written bytes (absolute offsets)."""

    counts: int = 0  # the tensor count (u64), then the key count (u64) right after it
    keys: dict[str, dict[str, int]] = field(default_factory=dict)  # name → key, type, value, end
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # name → name, n_dims,
    # dims, type, offset (the fields' offsets), data (where its bytes start)
    header_end: int = 0
    data_start: int = 0


def _pack(kind: int, value: Any, sub: int | None = None) -> bytes:
    if kind == STRING:
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(raw)) + raw
    if kind == ARRAY:
        assert sub is not None
        return struct.pack("<IQ", sub, len(value)) + b"".join(_pack(sub, v) for v in value)
    return struct.pack(_FORMATS[kind], value)


def write(keys: list[Key], tensors: list[Tensor], alignment: int = 32) -> tuple[bytes, Layout]:
    """The bytes of a GGUF file holding ``keys`` and ``tensors``, and where each field lies."""
    out, layout = bytearray(b"GGUF" + struct.pack("<I", 3)), Layout()
    layout.counts = len(out)
    out += struct.pack("<QQ", len(tensors), len(keys))
    for key in keys:
        where = {"key": len(out)}
        out += _pack(STRING, key.name)
        where["type"] = len(out)
        out += struct.pack("<I", key.kind)
        where["value"] = len(out)
        out += _pack(key.kind, key.value, key.sub)
        where["end"] = len(out)
        layout.keys.setdefault(key.name, where)
    offset = 0
    for t in tensors:
        where = {"name": len(out)}
        out += _pack(STRING, t.name)
        where["n_dims"] = len(out)
        out += struct.pack("<I", len(t.shape))
        where["dims"] = len(out)
        out += b"".join(struct.pack("<Q", d) for d in reversed(t.shape))  # fastest first
        where["type"] = len(out)
        out += struct.pack("<I", t.kind)
        where["offset"] = len(out)
        out += struct.pack("<Q", offset)
        where["data"] = offset
        offset += -(-len(t.data) // alignment) * alignment
        layout.tensors.setdefault(t.name, where)
    layout.header_end = len(out)
    out += bytes(-len(out) % alignment)
    layout.data_start = len(out)
    for t in tensors:
        layout.tensors[t.name]["data"] += layout.data_start
        out += t.data + bytes(-len(t.data) % alignment)
    return bytes(out), layout


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a small byte-level BPE: the 256 byte symbols, the
    merges that build ``WORDS`` (with and without a leading space), and ``SPECIALS``."""
    from dikkat.interop.gguf_vocab import byte_symbols

    tokens, merges = byte_symbols(), []
    for word in WORDS:
        for spelled in (word, "Ġ" + word):
            current = spelled[0]
            for ch in spelled[1:]:
                merge = f"{current} {ch}"
                current += ch
                if merge not in merges:
                    merges.append(merge)
                    if current not in tokens:
                        tokens.append(current)
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return [*tokens, *SPECIALS], types, merges


def _quantised(a: np.ndarray, kind: int) -> bytes:
    import gguf

    if kind == T_F32:
        return a.astype(np.float32).tobytes()
    if kind == T_F16:
        return a.astype(np.float16).tobytes()
    if kind == T_BF16:
        bits = a.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    return gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType(kind)).tobytes()


def tiny_llama(
    *, seed: int = 0, kinds: dict[str, int] | None = None, header: dict[str, Key] | None = None
) -> tuple[list[Key], list[Tensor]]:
    """The keys and tensors of the tiny model (``kinds``: GGUF name → GGML type, overriding the
    defaults; ``header``: keys to replace or add, by name)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = byte_level_vocab()
    V, D = len(tokens), WIDTH // HEADS
    end = tokens.index(SPECIALS[0])
    keys = [
        Key("general.architecture", STRING, "llama"),
        Key("general.alignment", U32, 32),
        Key("llama.block_count", U32, LAYERS),
        Key("llama.context_length", U32, 256),
        Key("llama.embedding_length", U32, WIDTH),
        Key("llama.feed_forward_length", U32, FF),
        Key("llama.attention.head_count", U32, HEADS),
        Key("llama.attention.head_count_kv", U32, KV_HEADS),
        Key("llama.rope.freq_base", F32, 10000.0),
        Key("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        Key("llama.rope.dimension_count", U32, D),
        Key("llama.vocab_size", U32, V),
        Key("tokenizer.ggml.model", STRING, "gpt2"),
        Key("tokenizer.ggml.pre", STRING, "gpt2"),
        Key("tokenizer.ggml.tokens", ARRAY, tokens, STRING),
        Key("tokenizer.ggml.token_type", ARRAY, types, I32),
        Key("tokenizer.ggml.merges", ARRAY, merges, STRING),
        Key("tokenizer.ggml.bos_token_id", U32, end),
        Key("tokenizer.ggml.eos_token_id", U32, end),
        Key("tokenizer.ggml.add_bos_token", BOOL, False),
    ]
    for name, key in (header or {}).items():
        at = [k.name for k in keys].index(name) if name in [k.name for k in keys] else None
        if at is None:
            keys.append(key)
        else:
            keys[at] = key
    shapes: dict[str, tuple[tuple[int, ...], int]] = {"token_embd.weight": ((V, WIDTH), T_Q8_0)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": ((WIDTH,), T_F32),
            b + "attn_q.weight": ((HEADS * D, WIDTH), T_Q4_1),
            b + "attn_k.weight": ((KV_HEADS * D, WIDTH), T_Q4_1),
            b + "attn_v.weight": ((KV_HEADS * D, WIDTH), T_Q8_0),
            b + "attn_output.weight": ((WIDTH, HEADS * D), T_Q4_1 if i == 0 else T_F32),
            b + "ffn_norm.weight": ((WIDTH,), T_F32),
            b + "ffn_gate.weight": ((FF, WIDTH), T_Q4_1),
            b + "ffn_up.weight": ((FF, WIDTH), T_Q8_0),
            b + "ffn_down.weight": ((WIDTH, FF), T_Q4_1),
        }
    shapes["output_norm.weight"] = ((WIDTH,), T_F32)
    tensors = []
    for name, (shape, kind) in shapes.items():
        kind = (kinds or {}).get(name, kind)
        if len(shape) == 1:
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) * (0.5 if name.startswith("token_embd") else 0.1)
        tensors.append(Tensor(name, kind, shape, _quantised(a, kind)))
    return keys, tensors


def tiny_llama_file(path: Any, **options: Any) -> Layout:
    """Write the tiny model (:func:`tiny_llama`'s options) to ``path``; returns the layout."""
    data, layout = write(*tiny_llama(**options))
    path.write_bytes(data)
    return layout


def prompt_ids(n: int = 32, seed: int = 1) -> list[int]:
    """``n`` token ids of the tiny vocabulary (32: a prefill, which multiplies in fp32)."""
    tokens, _, _ = byte_level_vocab()
    return np.random.default_rng(seed).integers(0, len(tokens), n).tolist()
