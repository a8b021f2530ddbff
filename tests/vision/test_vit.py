"""ViT: patches, shapes, errors, pooling, save/load, attention maps and backends."""

import math

import pytest
import torch

from dikkat.models import GPT
from dikkat.vision import ViT, ViTConfig
from dikkat.vision.vit import patchify
from helpers import cpu_backends

SMALL = ViTConfig(d_model=32, n_layers=2, n_heads=4)


def model(pool: str = "cls", seed: int = 0, **overrides) -> ViT:
    torch.manual_seed(seed)
    return ViT(ViTConfig(**{**vars(SMALL), "pool": pool, **overrides})).eval()


@pytest.mark.parametrize("patch, overlap", [(4, 0), (2, 0), (2, 1), (4, 1), (2, 3)])
def test_patches_read_the_window_around_each_cell(patch, overlap):
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ours = patchify(images, patch, overlap)  # (B, N, Ch·k·k)
    k, g = patch + 2 * overlap, 8 // patch
    padded = torch.zeros(2, 3, 8 + 2 * overlap, 8 + 2 * overlap, dtype=torch.float64)
    padded[:, :, overlap : overlap + 8, overlap : overlap + 8] = images
    for row in range(g):
        for col in range(g):  # the cell starts at (row·P, col·P); its window `overlap` before
            window = padded[:, :, row * patch : row * patch + k, col * patch : col * patch + k]
            assert torch.equal(ours[:, row * g + col], window.reshape(2, -1))
    assert ours.shape == (2, g * g, 3 * k * k)


def test_patchify_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"side divisible by patch_size=3, got \(2, 1, 8, 8\)"):
        patchify(torch.rand(2, 1, 8, 8), 3)
    with pytest.raises(ValueError, match=r"got \(2, 1, 8, 6\)"):
        patchify(torch.rand(2, 1, 8, 6), 2)
    with pytest.raises(ValueError, match="overlap must be an int ≥ 0, got -1"):
        patchify(torch.rand(2, 1, 8, 8), 2, -1)
    with pytest.raises(ValueError, match="patch_size must be an int ≥ 1, got 0"):
        patchify(torch.rand(2, 1, 8, 8), 0)
    with pytest.raises(TypeError, match="images must be a tensor"):
        patchify([[0.0]], 2)


def test_overlap_widens_only_the_patch_embedding():
    plain, wide = model(), model(patch_overlap=1)
    assert wide.patch_embed.weight.shape == (32, 16)  # 4×4 windows, one channel
    assert wide.config.n_tokens == plain.config.n_tokens == 17
    extra = sum(p.numel() for p in wide.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 32 * (16 - 4)
    assert wide(torch.rand(3, 1, 8, 8)).shape == (3, 10)


def test_patch_embedding_init_scales_with_its_fan_in():
    torch.manual_seed(0)
    m = ViT(ViTConfig.preset("digits"))  # 4×4 windows of one channel: fan-in 16
    w = m.patch_embed.weight.detach()
    bound = 1 / math.sqrt(16)  # PyTorch's Linear default: uniform in ±1/√fan_in
    assert w.abs().max() <= bound
    assert abs(float(w.std()) - bound / math.sqrt(3)) < 0.05 * bound
    other = m.blocks[0].mlp.up.weight.detach()  # everything else: N(0, 0.02)
    assert abs(float(other.std()) - 0.02) < 0.002


@pytest.mark.parametrize("pool, tokens", [("cls", 17), ("mean", 16)])
def test_shapes(pool, tokens):
    m = model(pool)
    x = torch.rand(3, 1, 8, 8)
    assert m(x).shape == (3, 10)
    assert m(x, return_hidden=True).shape == (3, 32)
    assert m.embed(x).shape == (3, tokens, 32)
    assert m.config.n_tokens == tokens
    assert (m.cls_token is not None) == (pool == "cls")


def test_presets():
    digits = ViTConfig(d_model=128, n_layers=4, patch_size=2, patch_overlap=1)
    assert ViTConfig.preset("digits") == digits
    assert ViTConfig.preset("vit-base-16").patch_overlap == 0  # the paper's disjoint patches
    assert ViTConfig.preset("digits", pool="mean").pool == "mean"
    with pytest.raises(ValueError, match="unknown ViT preset 'huge'"):
        ViTConfig.preset("huge")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"patch_size": 3}, "image_size=8 is not divisible by patch_size=3"),
        ({"patch_overlap": -1}, "patch_overlap must be an int ≥ 0, got -1"),
        ({"pool": "max"}, "pool must be 'cls' or 'mean', got 'max'"),
        ({"d_model": 30, "n_heads": 4}, "d_model=30 is not divisible by n_heads=4"),
        ({"channels": 0}, "channels must be a positive int, got 0"),
        ({"dropout": 1.5}, "dropout must be in"),
    ],
)
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**fields)


def test_a_float_size_is_a_type_error():
    with pytest.raises(TypeError, match=r"patch_overlap must be an int ≥ 0, got 1.0 \(float\)"):
        ViTConfig(patch_overlap=1.0)


def test_image_errors_name_the_shapes():
    m = model()
    with pytest.raises(
        ValueError, match=r"images have 3 channels, the model 1: got \(2, 3, 8, 8\)"
    ):
        m(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"images must have shape \(B, 1, 8, 8\), got \(2, 8, 8\)"):
        m(torch.rand(2, 8, 8))
    with pytest.raises(ValueError, match=r"got \(2, 1, 16, 16\)"):
        m(torch.rand(2, 1, 16, 16))
    with pytest.raises(TypeError, match="images must be a float tensor"):
        m(torch.zeros(2, 1, 8, 8, dtype=torch.long))


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_save_load_round_trip(tmp_path, pool):
    m = model(pool, seed=3)
    x = torch.rand(4, 1, 8, 8)
    m.save(tmp_path / "vit")
    back = ViT.load(tmp_path / "vit").eval()
    assert back.config == m.config
    assert torch.equal(back(x), m(x))
    with pytest.raises(ValueError, match=r"holds a 'ViT', not a GPT|not a valid GPT config"):
        GPT.load(tmp_path / "vit")


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_pooling_reads_what_it_says(pool):
    m = model(pool)
    x = torch.rand(3, 1, 8, 8)
    h = m.embed(x)
    for block in m.blocks:
        h = block(h)
    h = m.norm_f(h)  # (B, T, C)
    expected = h[:, 0] if pool == "cls" else h.mean(dim=1)
    torch.testing.assert_close(m(x, return_hidden=True), expected)
    torch.testing.assert_close(m(x), m.head(expected))


def test_cls_and_mean_pooling_are_different_models():
    cls, mean = model("cls"), model("mean")
    assert (
        sum(p.numel() for p in cls.parameters()) - sum(p.numel() for p in mean.parameters())
        == 2 * 32
    )  # the class token and its position
    x = torch.rand(2, 1, 8, 8)
    shifted = torch.roll(x, 1, dims=-1)  # a class token attends to the content; so does the mean
    assert not torch.allclose(cls(x), cls(shifted))
    assert not torch.allclose(mean(x), mean(shifted))


def _reference_rows(m: ViT, x: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √D) by hand from each block's own projections: (L, B, H, T)."""
    h = m.embed(x)
    rows = []
    for block in m.blocks:
        attn = block.attn
        a = block.norm1(h)
        B, T, _ = a.shape
        q = attn.q_proj(a).view(B, T, attn.n_heads, -1).transpose(1, 2)  # (B, H, T, D)
        k = attn.k_proj(a).view(B, T, attn.n_heads, -1).transpose(1, 2)
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)  # (B,H,T,T)
        rows.append(w[:, :, 0] if m.cls_token is not None else w.mean(dim=2))
        h = block(h)
    return torch.stack(rows)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_attention_maps_match_the_reference_and_sum_to_one(pool):
    m = model(pool).double()
    x = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    maps = m.attention_maps(x)
    T = 17 if pool == "cls" else 16
    assert maps.weights.shape == (2, 3, 4, T)
    torch.testing.assert_close(maps.weights.sum(-1), torch.ones(2, 3, 4, dtype=torch.float64))
    torch.testing.assert_close(maps.weights, _reference_rows(m, x), rtol=1e-10, atol=1e-12)
    grid = maps.patches()
    assert grid.shape == (2, 3, 4, 4, 4)
    # patch (row 1, col 2) is token 1·4 + 2 (after the class token, if any)
    assert torch.equal(grid[..., 1, 2], maps.weights[..., 6 + (pool == "cls")])


def test_attention_maps_leave_training_mode_alone():
    m = model()
    m.train()
    m.attention_maps(torch.rand(1, 1, 8, 8))
    assert m.training


@pytest.mark.parametrize("backend", cpu_backends(exact_only=True))
def test_every_attention_backend_gives_the_same_logits(backend):
    reference = model(seed=1).double()
    torch.manual_seed(1)
    other = ViT(reference.config, backend=backend).double().eval()
    other.load_state_dict(reference.state_dict())
    assert all(b.attn.backend == backend for b in other.blocks)
    x = torch.rand(4, 1, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(other(x), reference(x), rtol=1e-10, atol=1e-12)
    ref_maps = reference.attention_maps(x).weights
    torch.testing.assert_close(other.attention_maps(x).weights, ref_maps, rtol=1e-10, atol=1e-12)
    assert all(b.attn.backend == backend for b in other.blocks)  # restored after the maps
