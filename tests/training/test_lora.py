"""LoRA adapters (dikkat.training.lora) against PEFT on the same tiny Hugging Face model, adapter
and batch: the forward, the loss and every adapter's gradient, in fp32; and the adapters on a
GGUF file's packed weights against the same model dequantised, in fp64."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dikkat
from dikkat.pretrained.families import by_gguf_architecture, by_hf_model_type
from dikkat.training.lora import FrozenLinear, LoraConfig, LoraLinear, add_lora
from dikkat.training.peft_format import load_peft_state, lora_config_of, peft_config, peft_state

sys.path.insert(0, str(Path(__file__).parents[1] / "pretrained"))
from tiny_hf import save_tiny

peft = pytest.importorskip("peft")
from tiny_gguf import LAYERS, tiny_llama_file  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _gguf(path: Path, kind: str) -> Path:
    """The tiny llama GGUF with every matrix of the blocks in ``kind``."""
    from gguf import GGMLQuantizationType

    t = GGMLQuantizationType[kind].value
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    tiny_llama_file(path, kinds={f"blk.{i}.{n}.weight": t for i in range(LAYERS) for n in names})
    return path


def _peft_model(family: str, folder: Path, config: LoraConfig) -> torch.nn.Module:
    """A PEFT model of a tiny HF model with random A and B (B is zero at PEFT's own start,
    where every adapter is invisible)."""
    hf = save_tiny(family, folder)
    torch.manual_seed(3)
    pc = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.targets),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(hf, pc).float()


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama3", ALL), ("qwen3", ("q_proj", "v_proj")), ("gemma2", ("k_proj", "o_proj", "up_proj"))],
)
def test_matches_peft(tmp_path: Path, family: str, targets: tuple[str, ...]) -> None:
    config = LoraConfig(rank=4, alpha=8.0, targets=targets)
    theirs = _peft_model(family, tmp_path, config)
    lm = dikkat.pretrained.load(tmp_path)
    hf_type = theirs.base_model.model.config.model_type
    sites = add_lora(lm.model, by_hf_model_type(hf_type, "test"), config)
    ours = lm.model.train()
    theirs.train()
    state = peft.get_peft_model_state_dict(theirs)
    load_peft_state(sites, state, "peft")
    assert len(sites) == len(targets) * len(ours.blocks)

    ids = torch.randint(2, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt whose tokens are not trained
    want = theirs(input_ids=ids, labels=labels)
    logits = ours(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=1e-5, atol=1e-6)

    want.loss.backward()
    loss.backward()
    grads = {k: p.grad for k, p in theirs.named_parameters() if p.requires_grad}
    for s in sites:
        key = f"base_model.model.{s.hf}"
        for part, ours_p in (("A", s.layer.lora_A[s.name]), ("B", s.layer.lora_B[s.name])):
            theirs_g = grads[f"{key}.lora_{part}.default.weight"]
            # relative to the whole gradient: single elements near zero differ in fp32 rounding
            assert (ours_p.grad - theirs_g).norm() <= 1e-5 * theirs_g.norm(), (key, part)
    # what is frozen gets no gradient; only the adapters train
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # and the adapter comes back out as PEFT wrote it
    out = peft_state(sites)
    assert out.keys() == state.keys()
    assert all(torch.equal(out[k], state[k]) for k in out)


def test_adapter_config_read_by_peft(tmp_path: Path) -> None:
    """adapter_config.json as dikkat writes it is a config PEFT reads, and back."""
    import json

    config = LoraConfig(rank=6, alpha=12.0, dropout=0.05, targets=("q_proj", "o_proj"))
    written = peft_config(config, "some/base")
    (tmp_path / "adapter_config.json").write_text(json.dumps(written))
    theirs = peft.LoraConfig.from_pretrained(tmp_path)
    assert (theirs.r, theirs.lora_alpha, theirs.lora_dropout) == (6, 12.0, 0.05)
    assert set(theirs.target_modules) == {"q_proj", "o_proj"}
    assert lora_config_of(written, "x") == config
    with pytest.raises(ValueError, match="use_dora"):
        lora_config_of({**written, "use_dora": True}, "x")
    with pytest.raises(ValueError, match="pattern"):
        lora_config_of({**written, "target_modules": "all-linear"}, "x")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "F16"])
def test_packed_base_gradients_match_the_dequantised_model(tmp_path: Path, kind: str) -> None:
    """On a GGUF file's packed (or 16-bit) weights, the adapters' forward and gradients equal
    those of the same model with every weight dequantised, computed in fp64."""
    path = _gguf(tmp_path / "tiny.gguf", kind)
    config = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))
    family = by_gguf_architecture("llama", "test")
    packed = dikkat.pretrained.load(path).model
    plain = dikkat.pretrained.load(path, weights="fp32").model.double()
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    sites = [add_lora(m, family, config) for m in (packed, plain)]
    with torch.no_grad():
        for a, b in zip(*sites, strict=True):
            b.layer.lora_B[b.name].normal_(generator=torch.Generator().manual_seed(b.block))
            a.layer.lora_B[a.name].copy_(b.layer.lora_B[b.name])
            a.layer.lora_A[a.name].copy_(b.layer.lora_A[b.name])
    ids = torch.randint(0, packed.config.vocab_size, (1, 12), generator=torch.Generator())
    losses = [F.cross_entropy(m(ids)[0, :-1].double(), ids[0, 1:]) for m in (packed, plain)]
    for loss in losses:
        loss.backward()
    # the packed product rounds x to 16 bits per block of 32 (Q8_0, Q4_0): the loss agrees to
    # that rounding, the gradients (which see the same rounding only through the loss) alike
    tol = 1e-5 if kind == "F16" else 2e-3  # F16: fp32 arithmetic against fp64
    torch.testing.assert_close(losses[0], losses[1], rtol=tol, atol=tol)
    for a, b in zip(*sites, strict=True):
        for ga, gb in ((a.layer.lora_A[a.name].grad, b.layer.lora_A[b.name].grad),
                       (a.layer.lora_B[a.name].grad, b.layer.lora_B[b.name].grad)):  # fmt: skip
            assert ga is not None and gb is not None
            assert (ga.double() - gb).norm() <= 10 * tol * gb.norm() + 1e-9


def test_every_frozen_layer_passes_gradients(tmp_path: Path) -> None:
    """The output layer and the un-adapted projections are wrapped, so the earliest block's
    adapters get a gradient (a packed layer without a backward would stop it silently)."""
    path = _gguf(tmp_path / "tiny.gguf", "Q8_0")
    model = dikkat.pretrained.load(path).model
    sites = add_lora(model, by_gguf_architecture("llama", "t"), LoraConfig(targets=("q_proj",)))
    assert isinstance(model.lm_head, FrozenLinear)
    assert all(isinstance(b.mlp.down, FrozenLinear) for b in model.blocks)
    with torch.no_grad():
        for s in sites:
            s.layer.lora_B[s.name].fill_(0.1)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    F.cross_entropy(model(ids)[0], ids[0]).backward()
    first = sites[0].layer
    assert isinstance(first, LoraLinear) and first.lora_A["q_proj"].grad.abs().sum() > 0


def test_refusals(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "tiny.gguf", "Q8_0")
    family = by_gguf_architecture("llama", "t")
    with pytest.raises(ValueError, match=r"\['qkv'\] are not modules of a llama block"):
        add_lora(dikkat.pretrained.load(path).model, family, LoraConfig(targets=("qkv",)))
    model = dikkat.pretrained.load(path).model
    add_lora(model, family, LoraConfig())
    with pytest.raises(ValueError, match="adapters already"):
        add_lora(model, family, LoraConfig())
    with pytest.raises(ValueError, match="int8"):
        add_lora(dikkat.pretrained.load(path, weights="int8").model, family, LoraConfig())
    for bad, match in (
        ({"rank": 0}, "rank"),
        ({"alpha": 0.0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"targets": ()}, "distinct"),
        ({"targets": ("q_proj", "q_proj")}, "distinct"),
    ):
        with pytest.raises(ValueError, match=match):
            LoraConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a pretrained Decoder, got Linear"):
        add_lora(torch.nn.Linear(2, 2), family, LoraConfig())
    with pytest.raises(TypeError, match="tuple of module names"):
        LoraConfig(targets="q_proj")  # type: ignore[arg-type]


def test_the_fused_product_equals_the_plain_operations(tmp_path: Path) -> None:
    """The one-step product (adapters added into the frozen product's columns) and the plain
    operations it replaces give the same output and gradients; with dropout, training draws
    masks (the plain path) and evaluation is the fused product again."""
    from dikkat.weights.packed_layers import PackedLinear

    path = _gguf(tmp_path / "tiny.gguf", "Q8_0")
    model = dikkat.pretrained.load(path).model
    add_lora(model, by_gguf_architecture("llama", "t"), LoraConfig(rank=3, targets=ALL))
    layer = model.blocks[0].attn.qkv_proj
    assert isinstance(layer, LoraLinear) and isinstance(layer.base, PackedLinear)
    with torch.no_grad():
        for B in layer.lora_B.values():
            B.normal_(generator=torch.Generator().manual_seed(4))
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    outs, grads = [], []
    for run in (layer.forward, layer._unfused):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        y = run(x)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters()
                                         if p.requires_grad)])  # fmt: skip
    # the same sums in another order: to fp32's rounding of the whole
    assert (outs[0] - outs[1]).norm() <= 1e-6 * outs[1].norm()
    for a, b in zip(*grads, strict=True):
        assert (a - b).norm() <= 1e-5 * b.norm()

    dropped = LoraLinear(layer.base, layer.spans, LoraConfig(rank=3, dropout=0.5, targets=ALL))
    dropped.load_state_dict(layer.state_dict())
    dropped.eval()
    torch.testing.assert_close(dropped(x), outs[0])
    dropped.train()
    torch.manual_seed(0)
    assert not torch.allclose(dropped(x), outs[0])  # masks drawn
