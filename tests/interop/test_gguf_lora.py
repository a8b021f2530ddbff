"""A fine-tune back in GGUF (dikkat.interop.gguf_lora) on the tiny Llama of tests/pretrained/
tiny_gguf.py, its matrices in Q4_0, Q4_1, Q8_0, F16, BF16 and F32: the merged file against the
base file's bytes and ggml's own quantising formulas, a full load of it against the same weights
written as F32, and the LoRA adapter file against llama.cpp's loader's rules
(``llama_adapter_lora_init_impl`` in src/llama-adapter.cpp). benchmarks/lora_gguf_check.py runs
both files in llama.cpp itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dikkat
from dikkat.interop import gguf_lora, write_lora_gguf, write_merged_gguf
from dikkat.pretrained import GGUFFile

sys.path.insert(0, str(Path(__file__).parents[1] / "pretrained"))
import tiny_gguf as tg

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

Q4_0, Q4_K = gguf.GGMLQuantizationType.Q4_0.value, gguf.GGMLQuantizationType.Q4_K.value
KINDS = {  # the base's matrices that are not tiny_gguf's defaults (Q4_1, Q8_0, F32)
    "blk.0.attn_q.weight": Q4_0,
    "blk.1.attn_q.weight": tg.T_F16,
    "blk.1.ffn_gate.weight": tg.T_BF16,
}
CHANGED = (  # one tensor of each type: Q4_0, Q4_1, Q8_0, F16, BF16, F32
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.1.attn_q.weight",
    "blk.1.ffn_gate.weight",
    "blk.1.attn_output.weight",
)
HEADER = {  # a file type to rewrite, a chat template, an empty array, an alignment of 64
    "general.file_type": tg.Key("general.file_type", tg.U32, 3),
    "tokenizer.chat_template": tg.Key("tokenizer.chat_template", tg.STRING, "{{ messages }}"),
    "dikkat.test.empty": tg.Key("dikkat.test.empty", tg.ARRAY, [], tg.I32),
    "general.alignment": tg.Key("general.alignment", tg.U32, 64),
}


def tiny_base(path: Path, extra: tuple[tg.Tensor, ...] = ()) -> Path:
    keys, tensors = tg.tiny_llama(kinds=KINDS, header=HEADER)
    path.write_bytes(tg.write(keys, [*extra, *tensors], alignment=64)[0])  # extra: first
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return tiny_base(tmp_path / "base.gguf")


def deltas_for(path: Path, names=CHANGED, scale: float = 0.05, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = GGUFFile(path).tensors
    return {n: scale * torch.randn(shapes[n].shape, generator=g) for n in names}


def expected_bytes(file: GGUFFile, name: str, kind: int, delta: torch.Tensor | None) -> bytes:
    """gguf-py's quantising of dequantise(stored) + delta: the bytes the writer must produce."""
    values = file.read(name).numpy() + (0 if delta is None else delta.numpy())
    return quantize(values.astype(np.float32), gguf.GGMLQuantizationType(kind)).tobytes()


def q8_0_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``quantize_row_q8_0_ref`` (ggml/src/ggml-quants.c), written out: per block of 32,
    d = amax / 127 stored as fp16, q = roundf(x / d) (halves away from zero); (d, q)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d))
    scaled = blocks * inv
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)
    return d.astype(np.float16), q


def test_no_delta_and_no_kind_copies_the_file_byte_for_byte(base, tmp_path):
    out = write_merged_gguf(base, tmp_path / "copy.gguf", {})
    assert out == tmp_path / "copy.gguf" and out.read_bytes() == base.read_bytes()


def test_changed_tensors_are_requantised_in_their_own_type_and_all_else_is_kept(base, tmp_path):
    deltas = deltas_for(base)
    out = write_merged_gguf(base, tmp_path / "m.gguf", deltas, progress=False)
    before, after = GGUFFile(base), GGUFFile(out)
    # the header (every key, in order, with its type; the tensor directory) is the base's
    assert after.header_bytes() == before.header_bytes()
    assert list(after.metadata) == list(before.metadata) and after.metadata == before.metadata
    kinds = {after.tensors[n].kind_name for n in CHANGED}
    assert kinds == {"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"}
    for name, info in before.tensors.items():
        if name not in deltas:
            assert np.array_equal(after.raw(name), before.raw(name)), name
            continue
        assert after.tensors[name].kind == info.kind
        assert after.raw(name).tobytes() == expected_bytes(before, name, info.kind, deltas[name])
        assert after.raw(name).tobytes() != before.raw(name).tobytes()  # the change is there


def test_merged_values_are_within_each_formats_rounding(base, tmp_path):
    deltas = deltas_for(base)
    before, after = GGUFFile(base), GGUFFile(write_merged_gguf(base, tmp_path / "m.gguf", deltas))
    for name in CHANGED:
        want = (before.read(name) + deltas[name]).numpy()
        got, kind = after.read(name).numpy(), after.tensors[name].kind_name
        blocks = want.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        if kind == "F32":
            assert np.array_equal(got, want)
        elif kind == "F16":  # round to nearest even, as ggml's fp32 → fp16
            assert np.array_equal(got, want.astype(np.float16).astype(np.float32))
        elif kind == "BF16":
            bits = want.view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).view(np.float32)
            assert np.array_equal(got, rounded)
        elif kind == "Q8_0":  # ggml's reference quantiser, written out here
            d, q = q8_0_ref(want)
            assert np.array_equal(after.raw(name).reshape(-1, 34)[:, :2].view(np.float16), d)
            assert np.array_equal(after.raw(name).reshape(-1, 34)[:, 2:].view(np.int8), q)
            # within half a step of the block's scale (and the scale's own fp16 rounding)
            err = np.abs(got.reshape(-1, 32) - blocks)
            assert (err <= 0.5 * amax / 127 * (1 + 127 * 2.0**-10) + 1e-7).all()
        else:  # Q4_0, Q4_1: 16 levels over the block's range, the extreme one clipped
            err = np.abs(got.reshape(-1, 32) - blocks)
            span = amax / 8 if kind == "Q4_0" else np.ptp(blocks, axis=1, keepdims=True) / 15
            assert (err <= 1.01 * span + 1e-6).all(), (name, float((err - span).max()))


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "BF16", "F32"])
def test_a_kind_converts_every_quantised_or_16_bit_matrix(tmp_path, kind):
    odd = np.random.default_rng(1).standard_normal((5, 40)).astype(np.float16)  # rows of 40
    extra = tg.Tensor("extra.weight", tg.T_F16, (5, 40), odd.tobytes())
    base = tiny_base(tmp_path / "base.gguf", (extra,))
    deltas = deltas_for(base)
    out = write_merged_gguf(base, tmp_path / f"{kind}.gguf", deltas, kind=kind)
    before, after = GGUFFile(base), GGUFFile(out)
    target = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[target][0]
    for name, info in before.tensors.items():
        converts = info.kind_name != "F32" and len(info.shape) == 2 and info.shape[1] % block == 0
        want = target.value if converts else info.kind
        assert after.tensors[name].kind == want, name
        if want == info.kind and name not in deltas:
            assert np.array_equal(after.raw(name), before.raw(name)), name
        else:
            raw = after.raw(name).tobytes()
            assert raw == expected_bytes(before, name, want, deltas.get(name)), name
    # rows of 40 are not whole blocks of 32: the odd matrix stays F16 in a Q8_0 file
    assert after.tensors["extra.weight"].kind_name == ("F16" if kind == "Q8_0" else kind)
    file_type = {"F32": "ALL_F32"}.get(kind, f"MOSTLY_{kind}")
    assert after.metadata["general.file_type"] == gguf.LlamaFileType[file_type].value
    rest = {k: v for k, v in after.metadata.items() if k != "general.file_type"}
    assert list(after.metadata) == list(before.metadata)
    assert rest == {k: v for k, v in before.metadata.items() if k != "general.file_type"}


def test_a_k_quant_is_refused_by_name_unless_a_kind_is_given(tmp_path):
    zeros = bytes(2 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1])  # 2 rows of 256
    base = tiny_base(tmp_path / "base.gguf", (tg.Tensor("extra.weight", Q4_K, (2, 256), zeros),))
    delta = {"extra.weight": torch.full((2, 256), 0.25)}
    with pytest.raises(ValueError, match=r"'extra.weight' is stored as Q4_K.*kind=\"Q8_0\""):
        write_merged_gguf(base, tmp_path / "m.gguf", delta)
    assert not (tmp_path / "m.gguf").exists()
    after = GGUFFile(write_merged_gguf(base, tmp_path / "m.gguf", delta, kind="Q8_0"))
    assert after.tensors["extra.weight"].kind_name == "Q8_0"
    torch.testing.assert_close(
        after.read("extra.weight"), delta["extra.weight"], rtol=2**-10, atol=0
    )
    for kind in ("Q4_K", "Q4_0", "f16"):
        with pytest.raises(ValueError, match=f"kind must be one of .*got '{kind}'"):
            write_merged_gguf(base, tmp_path / "n.gguf", {}, kind=kind)


def test_bad_deltas_are_refused_naming_the_tensor_and_the_shapes(base, tmp_path):
    out, q = tmp_path / "m.gguf", "blk.0.attn_q.weight"
    with pytest.raises(ValueError, match=r"deltas names 'blk.0.attn_qq.weight', which base.gguf"):
        write_merged_gguf(base, out, {"blk.0.attn_qq.weight": torch.zeros(64, 64)})
    with pytest.raises(
        ValueError, match=r"has shape \(64, 63\), but base.gguf holds .* \(64, 64\)"
    ):
        write_merged_gguf(base, out, {q: torch.zeros(64, 63)})
    with pytest.raises(ValueError, match=r"\(64, 64\)"):
        write_merged_gguf(base, out, {q: torch.zeros(64, 64).T[:, :32]})  # 64 × 32
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        write_merged_gguf(base, out, {q: torch.full((64, 64), float("inf"))})
    with pytest.raises(TypeError, match=r"must be a float tensor, got a torch\.int64 tensor"):
        write_merged_gguf(base, out, {q: torch.zeros(64, 64, dtype=torch.long)})
    with pytest.raises(ValueError, match="do not fit F16"):  # past fp16's largest value
        write_merged_gguf(base, out, {"blk.1.attn_q.weight": torch.full((64, 64), 1e5)})
    assert not out.exists() and os.listdir(tmp_path) == ["base.gguf"]


def test_out_is_never_the_base(base, tmp_path):
    data = base.read_bytes()
    link = tmp_path / "link.gguf"
    link.symlink_to(base)
    for out in (base, tmp_path / "." / "base.gguf", link):
        with pytest.raises(ValueError, match="is the base file"):
            write_merged_gguf(base, out, {})
        with pytest.raises(ValueError, match="is the base file"):
            write_lora_gguf(base, out, {}, alpha=1.0)
    with pytest.raises(ValueError, match="is a folder"):
        write_merged_gguf(base, tmp_path, {})
    assert base.read_bytes() == data


def test_a_failure_while_writing_leaves_the_old_file_and_no_temporary_one(
    base, tmp_path, monkeypatch
):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"the previous merge")
    real, calls = gguf_lora._tensor_bytes, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the header and four tensors are written by then
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_lora, "_tensor_bytes", failing)
    with pytest.raises(OSError, match="No space left"):
        write_merged_gguf(base, out, deltas_for(base))
    assert out.read_bytes() == b"the previous merge"
    assert sorted(os.listdir(tmp_path)) == ["base.gguf", "m.gguf"]


def test_the_merged_file_loads_as_the_merged_weights(base, tmp_path):
    """The merged file, loaded whole, gives the logits of the same values written as F32 by
    tiny_gguf's own writer — and not the base's."""
    deltas = deltas_for(base, scale=0.2)
    merged = write_merged_gguf(base, tmp_path / "m.gguf", deltas)
    read = GGUFFile(merged)
    keys, tensors = tg.tiny_llama(kinds=KINDS, header=HEADER)
    for t in tensors:  # the reference: each changed tensor as the merged file's fp32 values
        if t.name in deltas:
            t.kind, t.data = tg.T_F32, read.read(t.name).numpy().tobytes()
    reference = tmp_path / "reference.gguf"
    reference.write_bytes(tg.write(keys, tensors, alignment=64)[0])
    ids = torch.tensor([tg.prompt_ids(16)])
    with torch.no_grad():
        got = dikkat.pretrained.load(merged, weights="fp32").model(ids)
        want = dikkat.pretrained.load(reference, weights="fp32").model(ids)
        was = dikkat.pretrained.load(base, weights="fp32").model(ids)
        packed = dikkat.pretrained.load(merged).model(ids)  # the file's own formats
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max())
    torch.testing.assert_close(packed, want, rtol=0, atol=1e-3 * want.abs().max())
    assert (got - was).abs().max() > 0.1 * was.abs().max()  # the deltas change the logits


def lora_pairs(path: Path, names: tuple[str, ...], r: int = 4) -> dict:
    g, shapes = torch.Generator().manual_seed(2), GGUFFile(path).tensors
    return {
        n: (
            torch.randn(r, shapes[n].shape[1], generator=g),
            torch.randn(shapes[n].shape[0], r, generator=g),
        )
        for n in names
    }


def test_the_lora_file_is_llama_cpps_adapter(base, tmp_path):
    names = ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.1.attn_output.weight")
    pairs = lora_pairs(base, names)
    out = write_lora_gguf(base, tmp_path / "lora.gguf", pairs, alpha=8)
    reader = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "llama"
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == 8.0
    assert reader.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {f"{n}.lora_{ab}" for n in names for ab in "ab"}
    model = GGUFFile(base).tensors
    for name, (a, b) in pairs.items():
        ta, tb = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        assert ta.tensor_type == tb.tensor_type == gguf.GGMLQuantizationType.F32
        ne = list(reversed(model[name].shape))  # the base tensor's dims, fastest first
        # llama_adapter_lora_init_impl's checks: model ne[0] == a ne[0], ne[1] == b ne[1],
        # a ne[1] == b ne[0] (the rank, which get_scale reads from b)
        assert ne[0] == ta.shape[0] and ne[1] == tb.shape[1] and ta.shape[1] == tb.shape[0] == 4
        assert np.array_equal(ta.data, a.numpy()) and np.array_equal(tb.data, b.numpy())


def test_the_lora_file_adds_what_the_merged_file_adds(base, tmp_path):
    """W + alpha / r · B A from the adapter file is the F32 tensor that write_merged_gguf
    writes for the same delta (llama.cpp's scale: build_lora_mm in src/llama-graph.cpp)."""
    name, alpha = "blk.1.attn_output.weight", 6.0  # an F32 tensor: no rounding in the way
    (a, b), r = lora_pairs(base, (name,))[name], 4
    lora = gguf.GGUFReader(write_lora_gguf(base, tmp_path / "l.gguf", {name: (a, b)}, alpha=alpha))
    la, lb = (torch.from_numpy(np.array(t.data)) for t in lora.tensors)
    delta = alpha / r * (b @ a)
    merged = GGUFFile(write_merged_gguf(base, tmp_path / "m.gguf", {name: delta})).read(name)
    from_file = GGUFFile(base).read(name) + alpha / lb.shape[1] * (lb @ la)
    assert torch.equal(merged, from_file)


def test_bad_adapters_are_refused_naming_the_tensor_and_the_shapes(base, tmp_path):
    out, q = tmp_path / "l.gguf", "blk.0.attn_q.weight"
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    cases = {
        "adapters names 'blk.9.attn_q.weight', which base.gguf": {"blk.9.attn_q.weight": (a, b)},
        r"A \(4, 63\) and B \(64, 4\); .* must be \(r, 64\) and \(64, r\)": {q: (a[:, :63], b)},
        r"A \(4, 64\) and B \(63, 4\)": {q: (a, b[:63])},
        r"A \(4, 64\) and B \(64, 3\)": {q: (a, b[:, :3])},
        "holds NaN or Inf": {q: (a, b + float("nan"))},
        "'token_embd.weight': llama.cpp applies": {"token_embd.weight": (a, torch.zeros(263, 4))},
        r"of shape \(64,\): not a matrix": {"output_norm.weight": (a, b)},
    }
    for message, adapters in cases.items():
        with pytest.raises(ValueError, match=message):
            write_lora_gguf(base, out, adapters, alpha=8)
    with pytest.raises(TypeError, match=r"two float tensors, got a torch\.float32 tensor, tuple"):
        write_lora_gguf(base, out, {q: (a, (b,))}, alpha=8)
    for alpha in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha must be"):
            write_lora_gguf(base, out, {q: (a, b)}, alpha=alpha)
    assert not out.exists()
