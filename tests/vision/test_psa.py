"""The PSA family against a plain fp64 re-derivation of Ultralytics' math (convolutions as sums
over kernel offsets, attention as explicit per-head loops) and its state-dict layout (key names
and shapes typed out). tests/vision/test_psa_ultralytics.py runs Ultralytics' own modules."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dikkat.vision import C2PSA, Attention, Bottleneck, C3k2, Conv, PSABlock

BACKENDS = ("reference", "sdpa", "tiled", "auto")
StateDict = dict[str, Tensor]

# --- the re-derivation ----------------------------------------------------------------------------


def conv2d(x: Tensor, w: Tensor, stride: int, groups: int) -> Tensor:
    """out[b, o, y, x] = Σ_{i, dy, dx} w[o, i, dy, dx] · pad(x)[b, group(o)·cin + i, s·y + dy, …]"""
    B, C, H, W = x.shape
    cout, cin, k, _ = w.shape
    p = k // 2
    xp = torch.zeros(B, C, H + 2 * p, W + 2 * p, dtype=x.dtype)
    xp[:, :, p : p + H, p : p + W] = x
    Ho, Wo = (H + 2 * p - k) // stride + 1, (W + 2 * p - k) // stride + 1
    wg = w.reshape(groups, cout // groups, cin, k, k)
    out = torch.zeros(B, groups, cout // groups, Ho, Wo, dtype=x.dtype)
    for dy in range(k):
        for dx in range(k):
            window = xp[:, :, dy : dy + stride * Ho : stride, dx : dx + stride * Wo : stride]
            window = window.reshape(B, groups, cin, Ho, Wo)
            out += torch.einsum("bgihw,goi->bgohw", window, wg[..., dy, dx])
    return out.reshape(B, cout, Ho, Wo)


def conv_bn(x: Tensor, sd: StateDict, prefix: str, *, s: int = 1, g: int = 1, act: bool = True):
    """Conv → BatchNorm (eval: running statistics, eps 1e-3) → SiLU."""
    y = conv2d(x, sd[prefix + "conv.weight"], s, g)
    mean, var, gamma, beta = (
        sd[prefix + "bn." + name].view(1, -1, 1, 1)
        for name in ("running_mean", "running_var", "weight", "bias")
    )
    y = (y - mean) / torch.sqrt(var + 1e-3) * gamma + beta
    return y / (1 + torch.exp(-y)) if act else y


def attention_math(x: Tensor, sd: StateDict, prefix: str, heads: int, ratio: float) -> Tensor:
    B, C, H, W = x.shape
    N, hd = H * W, C // heads
    kd = int(hd * ratio)
    qkv = conv_bn(x, sd, prefix + "qkv.", act=False).reshape(B, -1, N)
    v_all = torch.zeros(B, C, N, dtype=x.dtype)
    out = torch.zeros(B, C, N, dtype=x.dtype)
    for b in range(B):
        for h in range(heads):
            base = h * (2 * kd + hd)  # per head: kd query channels, kd key channels, hd values
            q = qkv[b, base : base + kd]  # (kd, N)
            k = qkv[b, base + kd : base + 2 * kd]  # (kd, N)
            v = qkv[b, base + 2 * kd : base + 2 * kd + hd]  # (hd, N)
            for i in range(N):
                scores = torch.stack([(q[:, i] * kd**-0.5 * k[:, j]).sum() for j in range(N)])
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[b, h * hd : (h + 1) * hd, i] = (v * weights).sum(dim=1)
            v_all[b, h * hd : (h + 1) * hd] = v
    v_map = v_all.reshape(B, C, H, W)
    y = out.reshape(B, C, H, W) + conv_bn(v_map, sd, prefix + "pe.", g=C, act=False)
    return conv_bn(y, sd, prefix + "proj.", act=False)


def psablock_math(x: Tensor, sd: StateDict, prefix: str, heads: int) -> Tensor:
    x = x + attention_math(x, sd, prefix + "attn.", heads, 0.5)
    hidden = conv_bn(x, sd, prefix + "ffn.0.")
    return x + conv_bn(hidden, sd, prefix + "ffn.1.", act=False)


def bottleneck_math(x: Tensor, sd: StateDict, prefix: str) -> Tensor:
    return x + conv_bn(conv_bn(x, sd, prefix + "cv1."), sd, prefix + "cv2.")


def c2psa_math(x: Tensor, sd: StateDict, n: int, c: int) -> Tensor:
    y = conv_bn(x, sd, "cv1.")
    a, b = y[:, :c], y[:, c:]
    for i in range(n):
        b = psablock_math(b, sd, f"m.{i}.", max(c // 64, 1))
    return conv_bn(torch.cat([a, b], dim=1), sd, "cv2.")


def c3k2_math(x: Tensor, sd: StateDict, n: int, c: int) -> Tensor:
    y = conv_bn(x, sd, "cv1.")
    parts = [y[:, :c], y[:, c:]]
    for i in range(n):
        z = bottleneck_math(parts[-1], sd, f"m.{i}.0.")
        parts.append(psablock_math(z, sd, f"m.{i}.1.", max(c // 64, 1)))
    return conv_bn(torch.cat(parts, dim=1), sd, "cv2.")


# --- Ultralytics-style state dicts: keys and shapes as Ultralytics names them ---------------------


def conv_keys(prefix: str, c1: int, c2: int, k: int = 1, g: int = 1) -> dict[str, tuple]:
    return {
        prefix + "conv.weight": (c2, c1 // g, k, k),
        prefix + "bn.weight": (c2,),
        prefix + "bn.bias": (c2,),
        prefix + "bn.running_mean": (c2,),
        prefix + "bn.running_var": (c2,),
        prefix + "bn.num_batches_tracked": (),
    }


def attention_keys(prefix: str, dim: int, heads: int, ratio: float = 0.5) -> dict[str, tuple]:
    kd = int(dim // heads * ratio)
    return {
        **conv_keys(prefix + "qkv.", dim, dim + 2 * kd * heads),
        **conv_keys(prefix + "proj.", dim, dim),
        **conv_keys(prefix + "pe.", dim, dim, k=3, g=dim),
    }


def psablock_keys(prefix: str, c: int, heads: int) -> dict[str, tuple]:
    return {
        **attention_keys(prefix + "attn.", c, heads),
        **conv_keys(prefix + "ffn.0.", c, 2 * c),
        **conv_keys(prefix + "ffn.1.", 2 * c, c),
    }


def c2psa_keys(c1: int, n: int) -> dict[str, tuple]:
    c = c1 // 2
    keys = {**conv_keys("cv1.", c1, 2 * c), **conv_keys("cv2.", 2 * c, c1)}
    for i in range(n):
        keys |= psablock_keys(f"m.{i}.", c, max(c // 64, 1))
    return keys


def c3k2_keys(c1: int, c2: int, n: int) -> dict[str, tuple]:
    c = c2 // 2
    keys = {**conv_keys("cv1.", c1, 2 * c), **conv_keys("cv2.", (2 + n) * c, c2)}
    for i in range(n):
        keys |= conv_keys(f"m.{i}.0.cv1.", c, c // 2, k=3)
        keys |= conv_keys(f"m.{i}.0.cv2.", c // 2, c, k=3)
        keys |= psablock_keys(f"m.{i}.1.", c, max(c // 64, 1))
    return keys


def random_state(keys: dict[str, tuple], seed: int) -> StateDict:
    """Random weights and random BN statistics, of a scale that keeps activations near 1."""
    g = torch.Generator().manual_seed(seed)
    sd: StateDict = {}
    for name, shape in keys.items():
        if name.endswith("num_batches_tracked"):
            sd[name] = torch.tensor(5)
        elif name.endswith("conv.weight"):
            fan_in = shape[1] * shape[2] * shape[3]
            sd[name] = torch.randn(shape, generator=g, dtype=torch.float64) / fan_in**0.5
        elif name.endswith(("running_var", "bn.weight")):
            sd[name] = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        else:
            sd[name] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.2
    return sd


def loaded(module: torch.nn.Module, sd: StateDict) -> torch.nn.Module:
    module.double().load_state_dict(sd, strict=True)  # fp64 before loading: no rounding
    return module.eval()


def image(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- tests ----------------------------------------------------------------------------------------


def test_state_dict_keys_are_ultralytics():
    assert dict.fromkeys(C2PSA(256, 256, n=2).state_dict()) == dict.fromkeys(c2psa_keys(256, 2))
    assert dict.fromkeys(C3k2(64, 128, n=2).state_dict()) == dict.fromkeys(c3k2_keys(64, 128, 2))
    for name, shape in c3k2_keys(64, 128, 2).items():
        assert tuple(C3k2(64, 128, n=2).state_dict()[name].shape) == shape, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_matches_the_math(backend: str):
    keys = attention_keys("", 16, 2, ratio=0.25)  # hd 8, kd 2: keys narrower than values
    sd = random_state(keys, seed=1)
    x = image((2, 16, 3, 4))
    out = loaded(Attention(16, num_heads=2, attn_ratio=0.25, backend=backend), sd)(x)
    torch.testing.assert_close(out, attention_math(x, sd, "", 2, 0.25), rtol=1e-10, atol=1e-10)


def test_conv_and_bottleneck_match_the_math():
    sd = random_state(conv_keys("", 6, 8, k=3, g=2), seed=2)
    x = image((1, 6, 7, 5))
    out = loaded(Conv(6, 8, 3, 2, g=2), sd)(x)
    torch.testing.assert_close(out, conv_bn(x, sd, "", s=2, g=2), rtol=1e-10, atol=1e-10)
    sd = random_state({**conv_keys("cv1.", 8, 4, k=3), **conv_keys("cv2.", 4, 8, k=3)}, seed=3)
    x = image((1, 8, 4, 4))
    torch.testing.assert_close(loaded(Bottleneck(8, 8), sd)(x), bottleneck_math(x, sd, ""))


def test_c2psa_matches_the_math():
    sd = random_state(c2psa_keys(256, 2), seed=4)  # c = 128: two heads of 64, key dim 32
    x = image((1, 256, 3, 3))
    out = loaded(C2PSA(256, 256, n=2), sd)(x)
    torch.testing.assert_close(out, c2psa_math(x, sd, 2, 128), rtol=1e-10, atol=1e-10)


def test_c3k2_matches_the_math():
    sd = random_state(c3k2_keys(16, 32, 2), seed=5)  # c = 16: one head (max(16 // 64, 1))
    x = image((2, 16, 3, 2))
    out = loaded(C3k2(16, 32, n=2), sd)(x)
    torch.testing.assert_close(out, c3k2_math(x, sd, 2, 16), rtol=1e-10, atol=1e-10)


def test_fp32_matches_the_fp64_math():
    sd = random_state(c3k2_keys(16, 32, 1), seed=6)
    x = image((1, 16, 4, 4))
    model = C3k2(16, 32, n=1)
    model.load_state_dict(sd, strict=True)
    out = model.eval()(x.float())
    torch.testing.assert_close(out.double(), c3k2_math(x, sd, 1, 16), rtol=0, atol=1e-5)


def test_backends_give_the_same_output():
    sd = random_state(c2psa_keys(256, 1), seed=7)
    x = image((2, 256, 4, 5))
    outs = [loaded(C2PSA(256, 256, backend=b), sd)(x) for b in BACKENDS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-10, atol=1e-10)
    model = loaded(C2PSA(256, 256), sd)
    model.m[0].attn.backend = "tiled"  # switchable on a built block
    torch.testing.assert_close(model(x), outs[0], rtol=1e-10, atol=1e-10)


def test_batch_norm_uses_running_statistics_in_eval_mode():
    model = loaded(PSABlock(16, num_heads=1), random_state(psablock_keys("", 16, 1), seed=8))
    bn = model.ffn[0].bn
    assert (bn.eps, bn.momentum) == (1e-3, 0.03)
    x = image((3, 16, 3, 3))
    torch.testing.assert_close(model(x)[:1], model(x[:1]))  # each image on its own
    model.train()
    assert not torch.allclose(model(x)[:1], model(x[:1]))  # batch statistics now


def test_heads_follow_the_width():
    assert C2PSA(256, 256).m[0].attn.num_heads == 2
    assert C2PSA(64, 64).m[0].attn.num_heads == 1  # max(32 // 64, 1)
    attn = C3k2(256, 512).m[0][1].attn
    assert (attn.num_heads, attn.head_dim, attn.key_dim) == (4, 64, 32)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: C2PSA(64, 128), "c1=64 and c2=128"),
        (lambda: Attention(10, num_heads=3), "num_heads=3 does not divide dim=10"),
        (lambda: Attention(4, num_heads=4), "key_dim"),
        (lambda: Attention(8, num_heads=2, backend="linear"), "'linear'"),
        (lambda: Conv(6, 8, g=4), "g=4"),
        (lambda: C3k2(16, 32, c3k=True, attn=False), "c3k=True"),
        (lambda: C2PSA(64, 64, n=0), "n must be a positive int"),
    ],
)
def test_bad_arguments_say_what_is_wrong(build, words: str):
    with pytest.raises(ValueError, match=words):
        build()


def test_wrong_input_names_the_shape():
    with pytest.raises(ValueError, match=r"128 input channels, got x of shape \(1, 64, 4, 4\)"):
        C2PSA(128, 128)(torch.randn(1, 64, 4, 4))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        C3k2(16, 16)(torch.randn(16, 4, 4))
