"""Seeded fuzzing of a GGUF file's header and tensor directory: hundreds of damaged copies of the
tiny Llama of tiny_gguf.py, each of which must be refused in one line (``ValueError``,
``TypeError`` or ``FileNotFoundError``, naming the file) or load into a model whose logits are
finite — never another exception, never a hang (each load runs under a wall-clock alarm), never
NaN.

Damage to the file's structure (counts, lengths, offsets, dims, n_dims, type ids, duplicates,
truncation) leaves nothing to guess: such a file is refused, or it loads the same model (the
damage fell where it changes nothing, e.g. a count's value read the same way). Damage to a
header value (random bytes, a key's value type, the alignment) may make another valid model (a
different ε, a renamed token), which must still answer finite logits with sizes that agree.
"""

from __future__ import annotations

import contextlib
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import Key, Layout, prompt_ids, tiny_llama, write

import dikkat

pytest.importorskip("gguf")
if not hasattr(signal, "setitimer"):  # pragma: no cover
    pytest.skip("the per-case alarm needs signal.setitimer", allow_module_level=True)

CASES = 25  # per kind of damage; 13 kinds
PER_CASE_S = 20.0  # a load that runs longer has hung (a load of the tiny file takes ~0.1 s)
SEED = 43


class CaseTimeout(BaseException):  # not an Exception: no handler inside the loader catches it
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread after ``seconds``; pytest-timeout's own
    alarm (pyproject.toml) is put back afterwards with what was left of it."""

    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout(f"still loading after {seconds} s")

    handler = signal.signal(signal.SIGALRM, expire)
    left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if left:
            spent = time.monotonic() - start
            signal.setitimer(signal.ITIMER_REAL, max(left - spent, 1e-3), interval)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[bytes, Layout, torch.Tensor]:
    """The undamaged file's bytes, its layout, and its model's logits on a 32-token prompt."""
    data, layout = write(*tiny_llama())
    path = tmp_path_factory.mktemp("fuzz") / "base.gguf"
    path.write_bytes(data)
    with torch.no_grad():
        logits = dikkat.pretrained.load(path).model(torch.tensor([prompt_ids()]))
    assert torch.isfinite(logits).all()
    return data, layout, logits


def check(path: Path, data: bytes, reference: torch.Tensor, strict: bool) -> str | None:
    """What is wrong with loading ``data`` (written to ``path``): None where it is refused in
    one line ("refused") or loads as it must."""
    path.write_bytes(data)
    try:
        with time_limit(PER_CASE_S):
            try:
                lm = dikkat.pretrained.load(path)
            except (ValueError, TypeError, FileNotFoundError) as e:
                message = str(e)
                if "\n" in message or len(message) > 800 or str(path) not in message:
                    return f"a refusal that is not one line naming the file: {message!r}"
                return "refused"
            c, tokenizer = lm.model.config, lm.tokenizer
            rows = lm.model.tok_emb.num_embeddings
            if not c.vocab_size == rows == tokenizer.vocab_size:
                return f"sizes disagree: config {c.vocab_size}, rows {rows}, {tokenizer!r}"
            ids = prompt_ids()
            if c.max_len < len(ids):  # a damaged context length: a valid, shorter model
                return "loaded the same model with another context" if strict else None
            with torch.no_grad():
                logits = lm.model(torch.tensor([ids]))
    except CaseTimeout as e:
        return str(e)
    except Exception as e:  # anything else is the failure this test looks for
        return f"{type(e).__name__}: {str(e)[:300]}"
    if not torch.isfinite(logits).all():
        return "loaded a model whose logits are not finite"
    if strict and not torch.equal(logits, reference):
        return "loaded, with logits other than the undamaged file's"
    return None


# ------------------------------------------------------------------ kinds of damage
# each: (rng, bytes, layout) → damaged bytes


def _set(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value % 2 ** (8 * struct.calcsize(fmt)))
    return bytes(out)


def _odd_value(rng: np.random.Generator, old: int) -> int:
    """A replacement for a count, length, dim or offset: near the old one, or far off."""
    choices = [0, 1, old + 1, old - 1, old * 2, old // 2, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
    choices.append(int(rng.integers(0, 2**62)))
    return int(choices[rng.integers(len(choices))])


def _tensor_field(rng, layout: Layout, field: str) -> int:
    names = list(layout.tensors)
    return layout.tensors[names[rng.integers(len(names))]][field]


def flip_header_bytes(rng, data: bytes, layout: Layout) -> bytes:
    out = bytearray(data)
    for _ in range(rng.integers(1, 5)):
        out[rng.integers(0, layout.header_end)] ^= int(rng.integers(1, 256))
    return bytes(out)


def random_header_field(rng, data: bytes, layout: Layout) -> bytes:
    """Random bytes over one whole field of the tensor directory or one key's value."""
    fields = [(w[f], 8 if f in ("offset", "dims") else 4) for w in layout.tensors.values()
              for f in ("n_dims", "dims", "type", "offset")]  # fmt: skip
    fields += [(w["value"], min(8, w["end"] - w["value"])) for w in layout.keys.values()]
    at, n = fields[rng.integers(len(fields))]
    out = bytearray(data)
    out[at : at + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return bytes(out)


def truncate(rng, data: bytes, layout: Layout) -> bytes:
    return data[: rng.integers(0, len(data))]


def counts(rng, data: bytes, layout: Layout) -> bytes:
    at = layout.counts + 8 * int(rng.integers(2))  # the tensor count, or the key count
    return _set(data, at, "<Q", _odd_value(rng, struct.unpack_from("<Q", data, at)[0]))


def lengths(rng, data: bytes, layout: Layout) -> bytes:
    """A string's length (a key's name, a string value) or an array's item count."""
    spots = [w["key"] for w in layout.keys.values()]
    for w in layout.keys.values():
        kind = struct.unpack_from("<I", data, w["type"])[0]
        spots += [w["value"]] if kind == 8 else [w["value"] + 4] if kind == 9 else []
    spots += [w["name"] for w in layout.tensors.values()]
    at = spots[rng.integers(len(spots))]
    return _set(data, at, "<Q", _odd_value(rng, struct.unpack_from("<Q", data, at)[0]))


def tensor_types(rng, data: bytes, layout: Layout) -> bytes:
    kind = int(rng.integers(0, 45)) if rng.random() < 0.9 else int(rng.integers(0, 2**32))
    return _set(data, _tensor_field(rng, layout, "type"), "<I", kind)


def key_types(rng, data: bytes, layout: Layout) -> bytes:
    names = list(layout.keys)
    at = layout.keys[names[rng.integers(len(names))]]["type"]
    return _set(data, at, "<I", int(rng.integers(0, 14)))


def offsets(rng, data: bytes, layout: Layout) -> bytes:
    a, b = (_tensor_field(rng, layout, "offset") for _ in range(2))
    old, other = struct.unpack_from("<Q", data, a)[0], struct.unpack_from("<Q", data, b)[0]
    how = rng.integers(4)
    if how == 0:  # another tensor's bytes
        return _set(data, a, "<Q", other)
    if how == 1:  # swapped with another's
        return _set(_set(data, a, "<Q", other), b, "<Q", old)
    if how == 2:  # moved by whole alignments
        return _set(data, a, "<Q", old + 32 * int(rng.choice([-3, -2, -1, 1, 2, 3])))
    return _set(data, a, "<Q", _odd_value(rng, old))


def dims(rng, data: bytes, layout: Layout) -> bytes:
    names = list(layout.tensors)
    where = layout.tensors[names[rng.integers(len(names))]]
    n = struct.unpack_from("<I", data, where["n_dims"])[0]
    if n == 2 and rng.random() < 0.3:  # the two dims swapped: the same bytes, transposed
        k, m = struct.unpack_from("<QQ", data, where["dims"])
        return _set(_set(data, where["dims"], "<Q", m), where["dims"] + 8, "<Q", k)
    at = where["dims"] + 8 * int(rng.integers(n))
    return _set(data, at, "<Q", _odd_value(rng, struct.unpack_from("<Q", data, at)[0]))


def n_dims(rng, data: bytes, layout: Layout) -> bytes:
    value = int(rng.choice([0, 1, 2, 3, 4, 5, 8, 2**31, 2**32 - 1]))
    return _set(data, _tensor_field(rng, layout, "n_dims"), "<I", value)


def duplicates(rng, data: bytes, layout: Layout) -> bytes:
    """A key or a tensor name written twice (the file rebuilt, otherwise sound)."""
    keys, tensors = tiny_llama()
    if rng.random() < 0.5:
        twin = keys[rng.integers(len(keys))]
        keys.insert(
            int(rng.integers(len(keys) + 1)), Key(twin.name, twin.kind, twin.value, twin.sub)
        )
    else:
        i, j = rng.choice(len(tensors), 2, replace=False)
        tensors[i] = type(tensors[i])(tensors[j].name, tensors[i].kind, tensors[i].shape,
                                      tensors[i].data)  # fmt: skip
    return write(keys, tensors)[0]


def key_values(rng, data: bytes, layout: Layout) -> bytes:
    """A number in the header (a size, ε, the RoPE base, a token id, a flag) replaced by
    another of its type: an odd integer, or a float that is NaN, infinite, zero, negative,
    tiny or huge."""
    spots = []
    for w in layout.keys.values():
        kind = struct.unpack_from("<I", data, w["type"])[0]
        if kind in (4, 6, 7):  # uint32, float32, bool
            spots.append((w["value"], kind))
    at, kind = spots[rng.integers(len(spots))]
    if kind == 4:
        return _set(data, at, "<I", _odd_value(rng, struct.unpack_from("<I", data, at)[0]))
    if kind == 7:
        return _set(data, at, "<B", int(rng.integers(0, 256)))
    odd = [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e-45, 3e38, rng.normal()]
    out = bytearray(data)
    struct.pack_into("<f", out, at, odd[rng.integers(len(odd))])
    return bytes(out)


def alignment(rng, data: bytes, layout: Layout) -> bytes:
    value = int(rng.choice([0, 1, 2, 7, 8, 16, 24, 48, 64, 128, 4096, 2**31]))
    return _set(data, layout.keys["general.alignment"]["value"], "<I", value)


# kind → (damage, strict: only a refusal or the same model will do)
DAMAGE: dict[str, tuple[Callable[..., bytes], bool]] = {
    "flip_header_bytes": (flip_header_bytes, False),
    "random_header_field": (random_header_field, False),
    "key_types": (key_types, False),
    "key_values": (key_values, False),
    "truncate": (truncate, True),
    "counts": (counts, True),
    "lengths": (lengths, True),
    "tensor_types": (tensor_types, True),
    "offsets": (offsets, True),
    "dims": (dims, True),
    "n_dims": (n_dims, True),
    "duplicates": (duplicates, True),
    "alignment": (alignment, True),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_files_are_refused_or_load_a_finite_model(kind, base, tmp_path):
    data, layout, reference = base
    damage, strict = DAMAGE[kind]
    rng = np.random.default_rng([SEED, list(DAMAGE).index(kind)])
    failures, refused = [], 0
    for case in range(CASES):
        damaged = damage(rng, data, layout)
        if damaged == data:
            continue
        problem = check(tmp_path / f"{kind}-{case}.gguf", damaged, reference, strict)
        refused += problem == "refused"
        if problem not in (None, "refused"):
            failures.append(f"case {case}: {problem}")
    assert not failures, "\n".join(failures)
    if kind in ("truncate", "counts", "n_dims", "duplicates"):
        assert refused > CASES // 2  # the damage is real: most of it is refused
