"""The PSA family against Ultralytics' own modules: the same weights give the same outputs.

The ``ultralytics`` wheel is downloaded from the package index (no install: it would pull in
OpenCV and more), and only its ``nn/modules`` files are imported, under stand-ins for the two
helpers they take from ``ultralytics.utils``. Without the index the test skips. The version is
pinned so that a change upstream shows as a change of this pin, not as a silent drift.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import zipfile

import pytest
import torch

from dikkat.vision import C2PSA, Attention, Bottleneck, C3k2, Conv, PSABlock

VERSION = "8.4.190"
FILES = ("conv.py", "utils.py", "transformer.py", "block.py")


@pytest.fixture(scope="module")
def ultralytics(tmp_path_factory):
    """Ultralytics' ``nn.modules.block`` (with conv), imported from the downloaded wheel."""
    where = tmp_path_factory.mktemp("ultralytics")
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"ultralytics=={VERSION}", "--no-deps",
             "--quiet", "-d", str(where)],
            capture_output=True, timeout=180,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer in 3 minutes")
    wheels = list(where.glob("ultralytics-*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"ultralytics {VERSION} could not be downloaded: {got.stderr[-300:]!r}")
    modules = where / "modules"
    modules.mkdir()
    with zipfile.ZipFile(wheels[0]) as z:
        for name in FILES:
            (modules / name).write_bytes(z.read(f"ultralytics/nn/modules/{name}"))

    stand_ins = {
        "ultralytics": types.ModuleType("ultralytics"),
        "ultralytics.utils": types.ModuleType("ultralytics.utils"),
        "ultralytics.utils.torch_utils": types.ModuleType("ultralytics.utils.torch_utils"),
        "ultralytics.nn": types.ModuleType("ultralytics.nn"),
        "ultralytics.nn.modules": types.ModuleType("ultralytics.nn.modules"),
    }
    torch_utils = stand_ins["ultralytics.utils.torch_utils"]
    torch_utils.TORCH_1_11 = True  # type: ignore[attr-defined]
    torch_utils.fuse_conv_and_bn = None  # type: ignore[attr-defined] — fusing is not tested
    stand_ins["ultralytics.nn.modules"].__path__ = [str(modules)]  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        loaded = {}
        for name in FILES:
            full = f"ultralytics.nn.modules.{name[:-3]}"
            spec = importlib.util.spec_from_file_location(full, modules / name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
            loaded[name[:-3]] = module
        yield types.SimpleNamespace(**loaded)
    finally:
        for name in [*stand_ins, *(f"ultralytics.nn.modules.{f[:-3]}" for f in FILES)]:
            if saved.get(name) is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]


def _settled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """As Ultralytics builds it (its ``initialize_weights`` sets every BatchNorm to eps 1e-3 and
    momentum 0.03 when a model is built), with random weights and BatchNorm statistics instead
    of the init's identity; evaluation mode."""
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eps, m.momentum = 1e-3, 0.03
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point():
                if name.endswith("running_var"):
                    t.copy_(torch.rand(t.shape, generator=g) + 0.5)
                else:
                    t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return module.eval()


CASES = [
    ("Conv 3×3 stride 2", lambda m: m.conv.Conv(8, 16, 3, 2), lambda: Conv(8, 16, 3, 2), 8, 12),
    ("Bottleneck", lambda m: m.block.Bottleneck(8, 8), lambda: Bottleneck(8, 8), 8, 10),
    ("Attention", lambda m: m.block.Attention(64, 2), lambda: Attention(64, 2), 64, 6),
    ("PSABlock", lambda m: m.block.PSABlock(64, num_heads=2),
     lambda: PSABlock(64, num_heads=2), 64, 5),
    ("C2PSA", lambda m: m.block.C2PSA(128, 128, n=2), lambda: C2PSA(128, 128, n=2), 128, 4),
    ("C3k2 with attention", lambda m: m.block.C3k2(64, 64, 1, attn=True),
     lambda: C3k2(64, 64, 1, attn=True), 64, 5),
    ("C3k2 with Bottlenecks", lambda m: m.block.C3k2(16, 32, 2, attn=False),
     lambda: C3k2(16, 32, 2, attn=False), 16, 6),
]  # fmt: skip


@pytest.mark.parametrize("name, theirs, ours, channels, side", CASES, ids=[c[0] for c in CASES])
def test_the_same_weights_give_ultralytics_outputs(ultralytics, name, theirs, ours, channels, side):
    torch.manual_seed(0)
    reference = _settled(theirs(ultralytics), seed=1).double()
    mine = ours().double().eval()
    mine.load_state_dict(reference.state_dict())  # strict: the same names and shapes
    x = torch.randn(2, channels, side, side, dtype=torch.float64)
    with torch.no_grad():
        want, got = reference(x), mine(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-10 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_every_backend_serves_the_psa_attention(ultralytics, backend):
    """fp32 through the fast backends stays within fp32 rounding of Ultralytics' fp32."""
    torch.manual_seed(0)
    reference = _settled(ultralytics.block.C2PSA(128, 128, n=1), seed=2)
    mine = C2PSA(128, 128, n=1, backend=backend).eval()
    mine.load_state_dict(reference.state_dict())
    x = torch.randn(2, 128, 8, 8)
    with torch.no_grad():
        want, got = reference(x), mine(x)
        exact = reference.double()(x.double())
    error = (got.double() - exact).abs().max().item()
    theirs_error = (want.double() - exact).abs().max().item()
    assert error <= 2 * theirs_error + 1e-6, (error, theirs_error)
