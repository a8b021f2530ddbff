"""The decode step compiled ahead of time (dikkat.models.aot_step): the eager step's logits for
every cache length from one package, loaded again without compiling (in a fresh process,
without importing dynamo), a damaged package refused, the key following what the compiled code
depends on, and the eager step where nothing compiles."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from step_models import build, build_half

from dikkat.cli.common import compiles
from dikkat.generation.generate import decode_step, prefill
from dikkat.models import Decoder, DecoderConfig, aot_cache, aot_package
from dikkat.models.aot_step import (
    AotPoolStep,
    AotStep,
    StepCompileError,
    compile_by_default,
    compiled_pool_step,
    compiled_step,
)
from dikkat.models.static_step import PoolStep, StaticStep

FAMILIES = ["llama", "gemma3", "gemma2", "gpt2"]


def _matches_eager(model, step_of, slots: int) -> None:
    ids = torch.randint(0, 64, (1, 5))
    eager, static = model.new_cache(1, slots), model.new_cache(1, slots)
    tokens = prefill(model, ids, eager).argmax(-1)
    prefill(model, ids, static)
    step = step_of(static)
    for slot in range(5, slots):  # past the 4-key window of the sliding layers
        want = decode_step(model, tokens, eager, slot)
        got = step(tokens, slot)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        tokens = want.argmax(-1)


@pytest.mark.parametrize("family", ["llama"])
def test_a_model_held_in_16_bits_compiles_to_its_eager_logits(family):
    """Its 16-bit tables are the package's constants, bound to the model's own (no copy)."""
    model = build_half(family, seed=0)
    step = AotStep(model, model.new_cache(1, 12))
    record = json.loads(step.package.with_suffix(".json").read_text())
    assert "tok_emb.table" in record["constants"].values()
    assert record["version"] == aot_package.VERSION and len(record["lineage"]) == 24
    _matches_eager(model, lambda cache: AotStep(model, cache), 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_package_gives_the_eager_logits_at_every_cache_length(family):
    """In dikkat's cache, as a user's: tests/models/test_static_step.py's models are the same,
    and share the packages (built by whichever test comes first)."""
    model = build(family)
    first = AotStep(model, model.new_cache(1, 12))
    assert first.package.is_file()
    _matches_eager(model, lambda cache: AotStep(model, cache), 12)
    again = AotStep(model, model.new_cache(1, 20))
    assert not again.built and again.package == first.package  # loaded, not compiled
    assert again._runner is first._runner  # once for the model: a chat's next turn reuses it
    _matches_eager(model, lambda cache: AotStep(model, cache), 20)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_pool_package_serves_batches_that_change(family):
    """The batch step over pools of slots (the serving engine's): rows join, leave and grow,
    and each batch gets the eager pool step's logits and writes, from one package."""
    model = build(family)
    layout = model.cache_layout()
    shape = (64, layout.kv_heads, layout.head_dim)
    keys = [torch.randn(shape) for _ in range(layout.n_layers)]
    values = [torch.randn(shape) for _ in range(layout.n_layers)]
    eager_keys, eager_values = [k.clone() for k in keys], [v.clone() for v in values]
    eager = PoolStep(model, eager_keys, eager_values)
    compiled = AotPoolStep(model, keys, values)
    slots = torch.randperm(64)[:48].view(3, 16)
    tokens, positions = torch.tensor([3, 9, 6]), torch.tensor([5, 2, 7])
    for rows in ([0, 1, 2], [0, 2], [1], [0, 1, 2], [2]):
        r = torch.tensor(rows)
        S = int(positions[r].max()) + 1
        args = (tokens[r], positions[r], slots[r, :S])
        want = eager(*args)
        got = compiled(*args)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        tokens[r] = want.argmax(-1)
        positions[r] += 1
    for a, b in zip(keys + values, eager_keys + eager_values, strict=True):  # the same writes
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    again = AotPoolStep(model, keys, values)
    assert not again.built and again._runner is compiled._runner


def test_a_mixture_runs_the_experts_of_the_model_its_package_is_bound_to():
    """The experts' op finds its layer by the router the package hands it: another model of the
    same shapes loads the same package and gets its own routing and experts."""
    first = build("qwen3moe", seed=0)
    step = AotStep(first, first.new_cache(1, 10))
    _matches_eager(first, lambda cache: AotStep(first, cache), 10)
    second = build("qwen3moe", seed=1)
    again = AotStep(second, second.new_cache(1, 10))
    assert again.package == step.package and not again.built
    _matches_eager(second, lambda cache: AotStep(second, cache), 10)


def test_a_model_whose_tensors_are_replaced_is_bound_again():
    """The next step of a model whose tensors were replaced (a new parameter, as ``.to()``
    makes) reads the new ones; a step made before keeps the old ones alive, not dangling."""
    model = build("llama")
    before = AotStep(model, model.new_cache(1, 8))
    old = model.norm_f.weight
    model.norm_f.weight = torch.nn.Parameter(torch.full_like(old, 2.0), requires_grad=False)
    after = AotStep(model, model.new_cache(1, 8))
    assert after._runner is not before._runner
    _matches_eager(model, lambda cache: AotStep(model, cache), 10)
    assert any(t is old for t in before._package.bound.tensors.values())  # held, not dangling
    del old
    assert torch.isfinite(before(torch.tensor([1]), 0)).all()


def test_a_fresh_process_loads_the_package_without_the_compiler():
    model = build("llama")
    AotStep(model, model.new_cache(1, 8))  # built by the test above, or here
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from step_models import build, build_half
        from dikkat.models.aot_step import AotStep
        from dikkat.models.static_step import StaticStep
        model = build("llama", seed=1)  # other weights, the same structure: the same package
        cache = model.new_cache(1, 8)
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        before = set(sys.modules)  # (building a model here may import sympy: a pretrained
        step = AotStep(model, cache)  # model is built on the meta device, which does not)
        added = set(sys.modules) - before
        eager_cache = model.new_cache(1, 8)
        model(torch.tensor([[1, 2, 3]]), cache=eager_cache)
        got = step(torch.tensor([4]), 3)
        want = StaticStep(model, eager_cache)(torch.tensor([4]), 3)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got, want)
        heavy = ("torch._dynamo", "torch._inductor", "sympy")
        print(step.built, *(m in added for m in heavy))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"] * 4  # loaded, importing no compiler, no sympy


def test_a_damaged_package_is_not_loaded(tmp_path, capsys):
    model = build("llama")
    shared = AotStep(model, model.new_cache(1, 8)).package
    for path in (shared, shared.with_suffix(".json")):  # a copy of its own to damage
        shutil.copy(path, tmp_path / path.name)
    step = AotStep(model, model.new_cache(1, 8), folder=tmp_path)
    assert not step.built
    data = step.package.read_bytes()
    step.package.write_bytes(data[: len(data) // 2])
    assert step._package.load() is None
    assert "unusable" in capsys.readouterr().err
    step.package.write_bytes(data)
    assert step._package.load() is not None


def test_the_key_follows_what_the_code_depends_on():
    base = build("llama")
    windows = (None, None)
    key = aot_package.step_key(base, windows)
    assert aot_package.step_key(build("llama", seed=1), windows) == key  # other weights' values
    assert aot_package.step_key(base, (4, None)) != key  # another window
    wider = Decoder(DecoderConfig(vocab_size=64, d_model=48, n_heads=4, n_kv_heads=2, n_layers=2))
    assert aot_package.step_key(wider.eval(), windows) != key  # other shapes
    small = build("llama")
    with torch.no_grad():  # a tensor small enough to be written into the code: by value
        small.blocks[0].attn_norm.weight.data = torch.ones(32)[:16].clone()
    assert aot_package.step_key(small, windows) != key


def test_a_build_removes_the_packages_it_makes_useless(tmp_path):
    """Those of an older layout and those of its lineage under another key (another dikkat or
    PyTorch built them for the same model); another model's stay, and so do files it cannot
    read."""

    def plant(name: str, entry: object) -> Path:
        (tmp_path / f"{name}.pt2").write_bytes(b"x" * 1000)
        (tmp_path / f"{name}.json").write_text(json.dumps(entry))
        return tmp_path / f"{name}.pt2"

    v = aot_package.VERSION
    mine = plant("step-new", {"version": v, "lineage": "L1"})
    older = plant("step-old", {"version": v, "lineage": "L1"})
    failed = plant("pool-old", {"version": v, "lineage": "L1", "failed": "no compiler"})
    layout = plant("step-v1", {"version": v - 1, "package": {}})
    other = plant("step-other", {"version": v, "lineage": "L2"})
    (tmp_path / "notes.json").write_text("not json")
    freed = aot_cache.prune(tmp_path, "L1", mine)
    gone = [older, failed, layout]
    assert not [p for p in gone if p.exists() or p.with_suffix(".json").exists()]
    assert mine.exists() and other.exists() and (tmp_path / "notes.json").exists()
    assert freed == sum(1000 + len(json.dumps(e)) for e in (
        {"version": v, "lineage": "L1"}, {"version": v, "lineage": "L1", "failed": "no compiler"},
        {"version": v - 1, "package": {}}))  # fmt: skip


def test_a_process_that_finds_the_package_being_built_waits_and_loads_it(monkeypatch, capsys):
    """Another process holds the package's lock (here another open file, as flock sees it): the
    step says it waits, and once the lock is let go loads what was built, compiling nothing."""
    fcntl = pytest.importorskip("fcntl")
    import threading

    first = build("llama")
    built = AotStep(first, first.new_cache(1, 12)).package  # built or loaded: it is there
    model = build("llama", seed=1)  # another model object of the same key: not loaded yet
    calls: list[str] = []
    real_load = aot_package.Package.load

    def load(self):
        calls.append("load")
        return None if len(calls) == 1 else real_load(self)  # first: not there yet

    monkeypatch.setattr(aot_package.Package, "load", load)
    monkeypatch.setattr(aot_package.Package, "_compile", lambda self: calls.append("compile"))
    with built.with_suffix(".lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        threading.Timer(0.5, fcntl.flock, (other, fcntl.LOCK_UN)).start()
        step = AotStep(model, model.new_cache(1, 12))
    assert calls == ["load", "load"] and step.package == built and not step.built
    assert "another process is compiling this step; waiting" in capsys.readouterr().err


def test_where_nothing_compiles_it_decodes_eagerly_and_says_why(monkeypatch, tmp_path, capsys):
    model = build("gpt2", seed=2)
    monkeypatch.setenv("DIKKAT_CACHE", str(tmp_path))  # no package there

    tries = []

    def no_compiler(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(aot_package.Package, "_build", no_compiler)
    cache = model.new_cache(1, 8)
    step = compiled_step(model, cache)
    assert type(step) is StaticStep
    assert "decoding eagerly" in capsys.readouterr().err
    with pytest.raises(StepCompileError, match=r"no C\+\+ compiler.*delete"):
        AotStep(model, cache)  # the failure is remembered: not compiled again at each decode
    assert len(tries) == 1
    pools = [torch.zeros(8, 4, 8) for _ in range(2)]  # the batch step: torch.compile's instead
    pool_step = compiled_pool_step(model, pools, [p.clone() for p in pools])
    assert type(pool_step) is PoolStep and pool_step._compiled
    assert "compiles in each process instead" in capsys.readouterr().err


def test_a_package_this_pytorch_cannot_load_is_compiled_again(monkeypatch, capsys):
    model = build("llama")
    step = AotStep(model, model.new_cache(1, 8))

    def refuses(package):
        raise RuntimeError("Error in dlopen: undefined symbol")

    monkeypatch.setattr(aot_package, "_runner", refuses)
    assert step._package.load() is None  # not a crash: the caller builds it again
    assert "does not load (RuntimeError: Error in dlopen" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written_leaves_the_eager_step(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DIKKAT_CACHE", str(blocker / "cache"))  # mkdir fails under a file
    model = build("gpt2", seed=3)
    step = compiled_step(model, model.new_cache(1, 8))
    assert type(step) is StaticStep
    assert "the cache cannot keep it" in capsys.readouterr().err


def test_a_batch_is_no_case_for_it():
    model = build("llama")
    with pytest.raises(StepCompileError, match="one row"):
        AotStep(model, model.new_cache(2, 8))


def test_compiled_by_default_unless_told(monkeypatch):
    monkeypatch.delenv("DIKKAT_COMPILE", raising=False)
    assert compile_by_default()
    assert compiles(argparse.Namespace(eager=False, compile=False))
    assert not compiles(argparse.Namespace(eager=True, compile=False))
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("DIKKAT_COMPILE", off)
        assert not compile_by_default()
    assert not compiles(argparse.Namespace(eager=False, compile=False))
    assert compiles(argparse.Namespace(eager=False, compile=True))
