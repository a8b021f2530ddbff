"""``dikkat.pretrained.load`` of GPT-2 GGUF files as llama.cpp's converter writes them from a
Hugging Face GPT-2 checkpoint: a tiny random ``GPT2LMHeadModel`` is converted here the way
``convert_hf_to_gguf.py`` (class ``GPT2Model``) does — gguf-py's own name map for
``MODEL_ARCH.GPT2``, the Conv1D weights transposed, the causal-mask buffers and the tied
``lm_head`` left out, the header keys it writes — and the model it is loaded into is compared with
the transformers model itself in fp64. The write path (``dikkat export``) is tested in
tests/interop/test_gguf_gpt.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dikkat
from dikkat.models import GPT
from dikkat.weights import HalfEmbedding, HalfLinear, PackedEmbedding, PackedLinear

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = ["def add(a, b):\n    return a + b\n", "the quick brown fox — café 42 🦊"]
END = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE with GPT-2's end-of-text token, learnt from a little text."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    text = "\n".join(TEXTS) * 30 + (transformers.__doc__ or "")
    tok.train_from_iterator([text], vocab_size=320, min_frequency=2, show_progress=False,
                            special_tokens=[END])  # fmt: skip
    return tok


@pytest.fixture(scope="module")
def hf(bpe) -> Any:
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=bpe.get_vocab_size(), n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # initialisers leave LayerNorms at (1, 0) and biases at 0: vary them
        for name, p in model.named_parameters():
            if ".ln_" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.double()


def rounded(t: np.ndarray, qtype: Any) -> np.ndarray:
    """``t`` as a ``qtype`` tensor holds it (quantised and dequantised by gguf)."""
    return gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype)


def convert(hf_model: Any, bpe: Any, path: Path, qtype: Any = None, *, header=None, drop=(),
            extra=None, tokens: list[str] | None = None) -> Path:  # fmt: skip
    """Write ``hf_model`` as llama.cpp's converter does (its matrices in ``qtype``, if given)."""
    import json

    c = hf_model.config
    writer = gguf.GGUFWriter(path, "gpt2")
    keys = {
        "block_count": c.n_layer,
        "context_length": c.n_ctx,
        "embedding_length": c.n_embd,
        "feed_forward_length": 4 * c.n_embd,  # the converter's, whatever n_inner says
        "attention.head_count": c.n_head,
    } | (header or {})
    for key, value in keys.items():
        writer.add_uint32(f"gpt2.{key}", value)
    writer.add_float32("gpt2.attention.layer_norm_epsilon", c.layer_norm_epsilon)
    spec = json.loads(bpe._tokenizer.to_str())
    vocab = {i: t for t, i in bpe.get_vocab().items()}
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    tokens = tokens or [vocab[i] for i in range(len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # what the converter names GPT-2's pre-tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(bpe.token_to_id(END))
    writer.add_eos_token_id(bpe.token_to_id(END))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, c.n_layer)
    for name, t in hf_model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # mask buffers; lm_head is tied, and not in the checkpoint's file
        data = t.float().numpy()
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = data.T.copy()  # Conv1D's (in, out) → (out, in)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new in drop:
            continue
        if qtype is None or data.ndim == 1:
            writer.add_tensor(new, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(new, data.astype(np.float16))
        else:
            writer.add_tensor(new, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(forward: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        with torch.no_grad():
            out.append(int(forward(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def test_a_converted_gpt2_loads_as_a_gpt_equal_to_transformers(hf, bpe, tmp_path):
    path = convert(hf, bpe, tmp_path / "gpt2.gguf")
    lm = dikkat.pretrained.load(path)
    assert isinstance(lm.model, GPT)
    c = lm.model.config
    assert (c.max_len, c.d_model, c.n_layers, c.n_heads) == (64, 32, 2, 4)
    assert c.vocab_size == bpe.get_vocab_size() > 256
    assert c.tie_embeddings and c.norm_eps == 1e-5 and c.activation == "gelu_tanh"
    assert "gpt2, 2 layers, width 32, 4 heads over 4" in repr(lm)
    ids = lm.tokenizer.encode(TEXTS[1])
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf(x).logits
        assert (lm.model(x).double() - want).abs().max() < 1e-5
        exact = dikkat.pretrained.load(path, dtype=torch.float64).model(x)
    assert (exact - want).abs().max() < 1e-10
    assert want.abs().max() > 0.1
    assert greedy(lm.model, ids, 10) == greedy(lambda t: hf(t).logits, ids, 10)


def test_the_converted_tokenizer_encodes_as_the_checkpoint_s(hf, bpe, tmp_path):
    lm = dikkat.pretrained.load(convert(hf, bpe, tmp_path / "gpt2.gguf"))
    for text in [*TEXTS, f"a{END}b"]:
        assert lm.tokenizer.encode(text) == bpe.encode(text).ids, text
    end = bpe.token_to_id(END)
    assert lm.tokenizer.eos_id == end and end in lm.tokenizer.eos_ids
    assert not lm.tokenizer.add_bos
    assert lm.chat_template is None


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
def test_quantised_tensors_are_dequantised(qtype, hf, bpe, tmp_path):
    kind = gguf.GGMLQuantizationType[qtype]
    path = convert(hf, bpe, tmp_path / "gpt2.gguf", kind)
    file = dikkat.pretrained.GGUFFile(path)
    assert file.tensors["blk.0.attn_qkv.weight"].kind_name == qtype
    ref = type(hf)(hf.config).double().eval()  # hf's weights as the file holds them
    state = {}
    for name, t in hf.state_dict().items():
        if t.dim() == 2:  # every matrix is stored in kind; Conv1D's in the (out, in) layout
            conv = name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
            data = (t.T if conv else t).float().numpy()
            held = torch.from_numpy(np.asarray(rounded(data, kind), dtype=np.float64))
            t = held.T if conv else held
        state[name] = t
    ref.load_state_dict(state)
    ref.lm_head.weight = ref.transformer.wte.weight
    x = torch.tensor([bpe.encode(TEXTS[0]).ids])
    with torch.no_grad():
        got = dikkat.pretrained.load(path, dtype=torch.float64, weights="fp32").model(x)
        want, unrounded = ref(x).logits, hf(x).logits
        packed = dikkat.pretrained.load(path).model  # the default: the file's blocks kept
        kept = packed(x)
    assert (got - want).abs().max() < 1e-10
    assert (got - unrounded).abs().max() > 1e-7  # the file's rounding is there
    if qtype == "F16":  # kept in 16 bits, multiplied in fp32
        layers = [m for m in packed.modules() if isinstance(m, HalfLinear)]
        assert len(layers) == 4 * packed.config.n_layers + 1
        assert isinstance(packed.tok_emb, HalfEmbedding)
        assert packed.lm_head.table is packed.tok_emb.table
        assert packed.pos_emb.weight.dtype == torch.float32  # added, not looked up: expanded
        assert (kept.double() - want).abs().max() < 1e-5 * want.abs().max()
        return
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * packed.config.n_layers + 1  # qkv, out, up, down; the tied head
    assert isinstance(packed.tok_emb, PackedEmbedding)
    assert packed.lm_head.parts[0] is packed.tok_emb.packed
    # the packed product rounds the activations to 16 bits per block of 32
    assert (kept.double() - want).abs().max() < 1e-3 * want.abs().max()


def test_files_that_do_not_fit_are_refused(hf, bpe, tmp_path):
    load = dikkat.pretrained.load
    with pytest.raises(ValueError, match=r"missing \['blk.1.ffn_up.bias'\]"):
        load(convert(hf, bpe, tmp_path / "a.gguf", drop={"blk.1.ffn_up.bias"}))
    extra = {"blk.0.attn_q_norm.weight": np.ones(32, dtype=np.float32)}
    with pytest.raises(ValueError, match=r"not used by dikkat \['blk.0.attn_q_norm.weight'\]"):
        load(convert(hf, bpe, tmp_path / "b.gguf", extra=extra))
    n = bpe.get_vocab_size()
    tokens = [f"t{i}" for i in range(n - 2)] + [END]
    with pytest.raises(
        ValueError, match=f"holds {n - 1} tokens, but token_embd.weight has {n} rows"
    ):
        load(convert(hf, bpe, tmp_path / "c.gguf", tokens=tokens))
    with pytest.raises(ValueError, match=r"gpt2\.attention\.key_length = 16"):
        load(convert(hf, bpe, tmp_path / "d.gguf", header={"attention.key_length": 16}))
    with pytest.raises(
        ValueError,
        match=r"attn_qkv.weight' is \(96, 32\), but the header's sizes make it \(64, 32\)",
    ):
        load(convert(hf, bpe, tmp_path / "e.gguf", header={"attention.head_count_kv": 2}))
    with pytest.raises(ValueError, match=r"\.gguf: d_model=32 is not divisible by n_heads=5"):
        load(convert(hf, bpe, tmp_path / "f.gguf", header={"attention.head_count": 5}))
