"""The keyword arguments transformers' layers pass to dikkat's attention: each honoured, accepted
with a reason, or refused by name — never ignored (``dikkat.hf.KEYWORDS``, docs/hf.md).

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads, ``T``/``S`` query/key length,
``D`` head dim, ``k`` keys chosen per query.

Oracles: transformers' own eager attention — a whole DeepSeek V3.2 model (sparse attention,
``indices=``) with ``attn_implementation="eager"``, and Inkling 2's ``eager_attention_forward``
for per-token sinks (``sinks=``) — in float32, on random weights built from configs.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from test_hf_attention import BACKENDS, NAMES, make
from torch import Tensor, nn

import dikkat.hf
from dikkat.hf.keywords import ACCEPTED, HONOURED, KEYWORDS, REFUSED

transformers = pytest.importorskip("transformers")

TOL = 1e-5
B, H, G, T, S, D = 2, 4, 2, 5, 7, 8


_CALL = "attention_interface("
_KEYWORD = re.compile(r"(?:^|,)\s*(\w+)\s*=(?!=)")
_COMMENT = re.compile(r"#[^\n]*")


def _top_level_arguments(text: str, start: int) -> str:
    """The text of the call's arguments from ``start`` (just past its "("), with what nested
    brackets hold left out, so that only the call's own ``name=`` remain."""
    depth, kept = 1, []
    for char in text[start:]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1:
            kept.append(char)
    return "".join(kept)


def _passed_by_installed_transformers() -> dict[str, set[str]]:
    """Every keyword name a model of the installed transformers passes explicitly to
    ``attention_interface(...)``, and the models passing it (a scan of the source text: parsing
    every modeling file would take a minute)."""
    found: dict[str, set[str]] = {}
    root = Path(transformers.__file__).parent / "models"
    for path in root.glob("*/modeling_*.py"):
        text = _COMMENT.sub("", path.read_text(encoding="utf-8"))
        at = text.find(_CALL)
        while at >= 0:
            for name in _KEYWORD.findall(_top_level_arguments(text, at + len(_CALL))):
                found.setdefault(name, set()).add(path.parent.name)
            at = text.find(_CALL, at + 1)
    return found


def test_every_keyword_the_installed_transformers_passes_has_an_entry() -> None:
    """A keyword without an entry is refused at run time anyway; this says which keywords of
    the installed transformers would be (a new release's new keyword needs a decision here)."""
    passed = _passed_by_installed_transformers()
    assert {"s_aux", "sinks", "indices", "sliding_window", "softcap"} <= passed.keys()
    parameters = set(inspect.signature(dikkat.hf.attention_function()).parameters)
    missing = {k: sorted(v)[:3] for k, v in passed.items() if k not in KEYWORDS.keys() | parameters}
    assert missing == {}


def test_the_list_holds_the_functions_own_keywords_and_says_what_each_is() -> None:
    parameters = list(inspect.signature(dikkat.hf.attention_function()).parameters)
    assert parameters[:5] == ["module", "query", "key", "value", "attention_mask"]
    for name in parameters[5:-1]:  # dropout, scaling (the last is **kwargs)
        assert KEYWORDS[name].does == HONOURED
    assert {k.does for k in KEYWORDS.values()} == {HONOURED, ACCEPTED, REFUSED}
    assert all(len(k.what) > 20 for k in KEYWORDS.values())
    assert dikkat.hf.KEYWORDS is KEYWORDS


def test_docs_hf_md_lists_every_keyword() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text(encoding="utf-8")
    assert [name for name in KEYWORDS if f"`{name}`" not in page] == []


def test_an_unknown_keyword_is_refused_by_name() -> None:
    """A model forwards unknown keyword arguments of its call down to attention (transformers'
    **kwargs); dikkat refuses the first it does not know, naming it and the layer."""
    model, ids, mask = make("llama")
    model.set_attn_implementation(NAMES["tiled"])
    with torch.no_grad():
        model(ids, attention_mask=mask)  # the keywords Llama passes are all known
        with pytest.raises(ValueError, match=r"LlamaAttention\[0\] passed frobnicate=True"):
            model(ids, attention_mask=mask, frobnicate=True)


class _Layer(nn.Module):
    """What the attention function reads of a layer: its name, index and grouping."""

    def __init__(self, is_causal: bool = False) -> None:
        super().__init__()
        self.layer_idx = 0
        self.is_causal = is_causal
        self.num_key_value_groups = H // G


def _qkv(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, D, generator=g),
        torch.randn(B, G, S, D, generator=g),
        torch.randn(B, G, S, D, generator=g),
    )


def _additive(allowed: Tensor) -> Tensor:
    """A float 4-D mask as transformers' callers build them: 0 where allowed, the dtype's min
    elsewhere."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cu_seq_lens_q", torch.tensor([0, 3, 5])),
        ("cu_seq_lens_k", torch.tensor([0, 3, 7])),
        ("max_length_q", 3),
        ("seq_idx", torch.zeros(B, T, dtype=torch.int32)),
        ("block_indices", torch.zeros(B, 1, T, 2, dtype=torch.long)),
        ("deterministic", True),
    ],
)
def test_refused_keywords_are_refused_when_set(name: str, value: object) -> None:
    attend = dikkat.hf.attention_function("reference")
    q, k, v = _qkv()
    mask = _additive(torch.ones(B, 1, T, S, dtype=torch.bool))
    with pytest.raises(
        ValueError, match=rf"_Layer\[0\] passed {name}=.*\({re.escape(KEYWORDS[name].what)}"
    ):
        attend(_Layer(), q, k, v, mask, **{name: value})
    unset = None if value is not True else False
    out, _ = attend(_Layer(), q, k, v, mask, **{name: unset})  # unset: nothing to refuse
    assert out.shape == (B, T, H, D)


def test_a_window_without_a_mask_and_two_kinds_of_sinks_are_refused() -> None:
    attend = dikkat.hf.attention_function("reference")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sliding_window=3 but no attention mask"):
        attend(_Layer(), q, k, v, None, sliding_window=3)
    with pytest.raises(ValueError, match="both s_aux= and sinks="):
        attend(_Layer(), q, k, v, None, s_aux=torch.zeros(H), sinks=torch.zeros(B, H, T, 1))


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_per_token_sinks_equal_transformers_eager(backend: str) -> None:
    """``sinks=`` (B, H, T, 1), one logit per head and query (Inkling 2's, computed from the
    hidden states), and its gradient, equal transformers' eager attention with them; without
    dikkat's sinks the answer differs (it was eager's without sinks before)."""
    eager = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    attend = dikkat.hf.attention_function(backend)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None].expand(B, 1, T, S)
    mask = _additive(allowed)
    results = []
    for run in (attend, eager.eager_attention_forward):
        q, k, v = (t.requires_grad_() for t in _qkv(seed=1))
        sinks = (2 * torch.randn(B, H, T, 1, generator=torch.manual_seed(2))).requires_grad_()
        out, _ = run(_Layer(), q, k, v, mask, scaling=0.5, dropout=0.0, sinks=sinks)
        dout = torch.randn(out.shape, generator=torch.manual_seed(3))
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
        results.append((out.detach(), *grads))
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), *results, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL, msg=name)
    without, _ = attend(_Layer(), *_qkv(seed=1), mask, scaling=0.5)
    assert float((without - results[1][0]).abs().max()) > 0.1


# --- indices= (sparse attention) ------------------------------------------------------------------


def deepseek_v32() -> nn.Module:
    """DeepSeek V3.2 with DeepSeek Sparse Attention: each query attends to the top-k keys its
    indexer picks (index_topk = 3 of up to 10). Through a name other than eager or sdpa the layer
    passes them as ``indices=`` rather than folding them into the mask."""
    config = transformers.DeepseekV32Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, head_dim=12,
        index_topk=3, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV32ForCausalLM(config).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_indices_equal_eager(backend: str) -> None:
    """The caller builds the 4-D mask (DeepSeek V3.2's indexer slices it, so it must be a
    tensor): the layer's top-k ``indices=`` reach dikkat beside it and are honoured — the logits
    equal eager's, which folds them into its mask — where dropping them ran the layer dense."""
    model = deepseek_v32()
    ids = torch.randint(1, 97, (2, 10), generator=torch.manual_seed(1))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None].expand(2, 1, 10, 10)
    mask = _additive(causal)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(NAMES[backend])
        with dikkat.hf.recording() as calls:
            got = model(ids, attention_mask=mask).logits
    assert len(calls) == 2
    assert float((got - want).abs().max()) <= TOL
    assert float(want.abs().max()) > 0.01


def test_indices_are_checked_and_minus_one_selects_nothing() -> None:
    attend = dikkat.hf.attention_function("reference")
    q, k, v = _qkv(seed=4)
    indices = torch.tensor([[0, 2, -1], [1, 6, 6], [3, -1, -1], [4, 5, 0], [6, 1, 2]])  # (T, k)
    indices = indices.expand(B, T, 3)
    out, weights = attend(
        _Layer(), q, k, v, None, scaling=1.0, indices=indices, output_attentions=True
    )
    chosen = torch.zeros(T, S, dtype=torch.bool)
    for t, row in enumerate(indices[0]):
        chosen[t, row[row >= 0]] = True
    scores = (q @ k.repeat_interleave(H // G, 1).transpose(-2, -1)).masked_fill(~chosen, -math.inf)
    want = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(weights, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, (want @ v.repeat_interleave(H // G, 1)).transpose(1, 2))
    for bad, error, message in [
        (indices.float(), TypeError, "not an integer tensor"),
        (
            indices[:, :4],
            ValueError,
            r"of shape \(2, 4, 3\); dikkat takes \(B, T, k\) = \(2, 5, k\)",
        ),
        (indices + 1, ValueError, "from 0 to 7, but there are 7 keys"),
        (indices - 1, ValueError, "from -2 to 5"),
    ]:
        with pytest.raises(error, match=message):
            attend(_Layer(), q, k, v, None, indices=bad)
