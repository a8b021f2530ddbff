"""Inference copies (``inference_model``): the fp32 fast path against fp64, what a copy shares
with its model (nothing that a write can reach), tied weights and row blocks inside a copy, and
generations in different formats side by side on one model, interleaved or in threads.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from dikkat import kernels as native
from dikkat import masks
from dikkat.core.tuning import for_device
from dikkat.generation import generate, iter_generate
from dikkat.layers import Block, BlockConfig, Linear, LinearRows
from dikkat.models import GPT, GPTConfig
from dikkat.weights import (
    InferenceLinear,
    inference_model,
    int8_linear,
    onednn_linear_available,
    quantize_int8,
)
from dikkat.weights.held import BATCH_ROWS as _BATCH_ROWS
from helpers import scramble

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN not available")

V = 61


def formats_apart(seed: int = 0) -> GPT:
    """A GPT whose weight formats decode different tokens: the rows of its (untied) output head
    share a large offset, which cancels between the fp32 logits but which bf16's and int8's
    rounding, relative to each row's size, turns into noise of the logits' own size."""
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=V, max_len=48, d_model=32, n_layers=2, n_heads=4, position="rope",
        tie_embeddings=False,
    )  # fmt: skip
    model = scramble(GPT(config), seed)
    with torch.no_grad():
        model.lm_head.weight.add_(64.0)
    return model


def prompts(seed: int = 0) -> list[list[int]]:
    return torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the fp32 copy: oneDNN's packed weights ------------------------------------------------------


@needs_onednn
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 7, 24), (5, 24)])
def test_the_fp32_copy_equals_the_plain_product(transposed, shape):
    torch.manual_seed(0)
    m = Linear(24, 40)
    if transposed:  # a weight whose memory is laid out (in, out): packing reads any strides
        m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())
    x = torch.randn(shape)
    expected = F.linear(x.double(), m.weight.double(), m.bias.double())
    copy = inference_model(m)
    got = copy(x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # few rows (decoding) multiply the weight itself (one row in the native kernel where it is
    # built, whatever the tuning says), more rows a packed copy of it
    one_native = x.numel() == 24 and not transposed and native.linear_rows_op() is not None
    plain = one_native or x.numel() <= 24 * for_device(x.device).plain_gemv_max_rows
    assert copy.copies == (frozenset() if plain else {(0, 40, 1)})


@needs_onednn
def test_a_batched_copy_lays_a_second_copy_out_for_many_rows():
    """batched=True: products of more than two rows use a copy laid out for batches (the same
    numbers up to rounding); an unbatched copy multiplies every shape through one layout."""
    torch.manual_seed(0)
    m = Linear(24, 40)
    x = torch.randn(8, 24)
    expected = F.linear(x.double(), m.weight.double(), m.bias.double())
    for batched, layouts in ((False, {1}), (True, {_BATCH_ROWS})):
        copy = inference_model(m, batched=batched)
        got = copy(x)
        assert {rows for *_, rows in copy.copies} == layouts
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    int8 = inference_model(m, "int8", batched=True)
    int8(x), int8(x[:1])
    assert int8.copies == frozenset()  # a copy with no oneDNN layout is made once, up front


@needs_onednn
def test_the_fp32_copy_takes_the_plain_path_while_autograd_records_the_input():
    copy = inference_model(Linear(4, 3))
    x = torch.randn(5, 4, requires_grad=True)
    copy(x).sum().backward()  # oneDNN's op has no backward
    assert x.grad is not None and copy.copies == frozenset()
    assert not any(p.requires_grad for p in copy.parameters())


@needs_onednn
@pytest.mark.parametrize(("start", "stop"), [(0, 16), (16, 24), (24, 40), (0, 40)])
def test_row_blocks_of_a_copy_equal_the_plain_rows(start, stop):
    torch.manual_seed(1)
    m = Linear(24, 40)
    rows = LinearRows(m, start, stop)
    x = torch.randn(3, 24)
    expected = F.linear(x.double(), m.weight[start:stop].double(), m.bias[start:stop].double())
    copy = inference_model(rows)
    assert isinstance(copy.source, InferenceLinear)
    got = copy(x)
    assert copy.source.copies == {(start, stop, 1)}
    torch.testing.assert_close(rows(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_copy_of_a_block_packs_the_fused_weight_and_the_cross_attention_rows():
    torch.manual_seed(0)
    block = Block(BlockConfig(d_model=32, n_heads=4, n_kv_heads=2, cross_attention=True)).eval()
    x, ctx = torch.randn(1, 3, 32), torch.randn(1, 4, 32)
    with torch.no_grad():
        plain = block(x, masks.causal(), context=ctx)
    copy = inference_model(block)
    packed = copy(x, masks.causal(), context=ctx)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)
    attn, cross = copy.attn.qkv_proj, copy.cross_attn.qkv_proj
    assert attn.copies == {(0, attn.out_features, 1)}  # the whole fused weight, once
    # cross-attention: its q rows (on x), its k and v rows (on the context), each packed
    sizes = copy.cross_attn.qkv_sizes
    q_end, k_end = sizes[0], sizes[0] + sizes[1]
    assert {(a, b) for a, b, _ in cross.copies} == {(0, q_end), (q_end, k_end), (k_end, sum(sizes))}
    for name in ("q_proj", "k_proj", "v_proj"):  # the rows read the copy's layer, not the model's
        assert getattr(copy.cross_attn, name).source is cross
    assert isinstance(block.cross_attn.qkv_proj, Linear)  # the block is untouched


# --- the fp32 copy: one row in dikkat's native kernel --------------------------------------------


@pytest.fixture
def native_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of x that the fp32 copies' native kernel multiplies (eager products)."""
    kernel = native.linear_rows_op()
    if kernel is None:  # the machines the suite runs on build it
        pytest.skip("no native kernels here")
    calls: list[tuple[int, ...]] = []

    def counted(x, w, b):
        calls.append(tuple(x.shape))
        return kernel(x, w, b)

    monkeypatch.setitem(native._KERNELS, "linear_rows", counted)
    return calls


@pytest.mark.parametrize("shape", [(24,), (1, 24), (1, 1, 24)])
@pytest.mark.parametrize(("start", "stop"), [(0, 40), (8, 21)])
def test_one_fp32_row_is_multiplied_by_the_native_kernel(native_calls, shape, start, stop):
    torch.manual_seed(0)
    m = Linear(24, 40)
    x = torch.randn(shape)
    want = F.linear(x.double(), m.weight[start:stop].double(), m.bias[start:stop].double())
    got = inference_model(LinearRows(m, start, stop))(x)
    assert native_calls == [(1, 24)] and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_other_products_keep_to_torchs(native_calls):
    torch.manual_seed(0)
    m = Linear(24, 40)
    copy = inference_model(m)
    copy(torch.randn(2, 24)), copy(torch.randn(1, 2, 24))  # two rows
    copy(torch.randn(1, 24, requires_grad=True)).sum().backward()  # autograd records it
    inference_model(Linear(24, 40).double())(torch.randn(1, 24, dtype=torch.float64))
    m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())  # rows not contiguous
    inference_model(m)(torch.randn(1, 24))
    assert native_calls == []


def test_a_compiled_one_row_product_calls_the_native_kernel():
    """In a graph torch.compile traces with one row the kernel is an op of the graph; with two
    rows, ``F.linear``."""
    if native.linear_rows_op() is None:
        pytest.skip("no native kernels here")
    torch.manual_seed(0)
    copy = inference_model(Linear(24, 40))
    for rows in (1, 2):
        targets: list = []

        def record(gm: torch.fx.GraphModule, inputs: list, targets: list = targets):
            targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        x = torch.randn(rows, 24)
        got = torch.compile(copy, backend=record, dynamic=False, fullgraph=True)(x)
        torch.testing.assert_close(got, copy(x), atol=1e-6, rtol=1e-6)
        op = torch.ops.dikkat_native.linear_rows
        in_graph = op in targets or op.default in targets
        assert in_graph == (rows == 1), targets
        torch._dynamo.reset()


# --- a copy is a snapshot ------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_a_copy_leaves_the_model_as_it_was_and_later_writes_do_not_reach_it(weights):
    model = formats_apart(seed=1).train()
    ids = torch.tensor(prompts(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = inference_model(model, weights)
    assert not copy.training and model.training
    assert not any(isinstance(m, InferenceLinear) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())
    assert not any(p.requires_grad for p in copy.parameters())
    first = copy(ids)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # every weight of the model, the embeddings and norms too
        changed = model.eval()(ids)
    assert not torch.allclose(changed, first, atol=0.1)  # the writes were real
    assert torch.equal(copy(ids), first)


def test_a_tied_output_embedding_stays_tied_in_an_fp32_copy_and_is_quantised_in_int8():
    torch.manual_seed(2)
    config = GPTConfig(vocab_size=V, max_len=16, d_model=32, n_layers=1, n_heads=4)
    model = scramble(GPT(config), 2)
    assert model.lm_head.weight is model.tok_emb.weight
    ids = torch.tensor(prompts(2))
    fp32 = inference_model(model)
    assert fp32.lm_head.weight is fp32.tok_emb.weight  # one parameter, as in the model
    assert fp32.tok_emb.weight is not model.tok_emb.weight
    with torch.no_grad():
        torch.testing.assert_close(fp32(ids), model(ids), atol=1e-4, rtol=1e-5)
    int8 = inference_model(model, "int8")
    hidden = int8(ids, return_hidden=True)  # (B, T, C)
    want = int8_linear(hidden, quantize_int8(model.tok_emb.weight))  # the embedding, quantised
    assert torch.equal(int8.lm_head(hidden), want)
    assert torch.equal(int8.tok_emb.weight, model.tok_emb.weight)  # the input side as it was


def test_a_copy_is_used_as_it_is_for_its_own_format_and_refuses_another():
    model = formats_apart()
    copy = inference_model(model, "int8")
    assert inference_model(copy) is copy and inference_model(copy, "int8") is copy
    assert generate(copy, prompts(), 6) == generate(model, prompts(), 6, weights="int8")
    with pytest.raises(ValueError, match=r"already an inference copy \(weights='int8'.*'bf16'"):
        inference_model(copy, "bf16")
    with pytest.raises(ValueError, match="batched=True"):
        inference_model(copy, batched=True)
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        copy.double()


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"weights must be one of 'fp32', .*got 'int4'"):
        inference_model(Linear(4, 4), "int4")
    with pytest.raises(TypeError, match="batched must be True or False"):
        inference_model(Linear(4, 4), batched=1)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        inference_model([Linear(4, 4)])


# --- generations in different formats, side by side ---------------------------------------------


def test_interleaved_streams_in_two_formats_each_keep_their_own():
    """Two ``iter_generate`` streams on one model, fp32 and int8, stepped in turn: each yields
    what it yields alone (a mode switched on the model's layers would hand the second stream's
    format to the first from its second step)."""
    model = formats_apart()
    formats = ("fp32", "int8")
    alone = {
        w: [t.tolist() for t in iter_generate(model, prompts(), 10, weights=w)] for w in formats
    }
    assert alone["fp32"] != alone["int8"]  # the formats are told apart by their tokens
    streams = {w: iter_generate(model, prompts(), 10, weights=w) for w in formats}
    together: dict[str, list] = {w: [] for w in formats}
    for _ in range(10):
        for w, stream in streams.items():
            together[w].append(next(stream).tolist())
    assert together == alone


def test_threads_generating_in_three_formats_each_get_their_own():
    """Three threads, one model, fp32 / bf16 / int8, stepped in lockstep (a hook makes every
    forward wait for the others): each thread's tokens are its format's alone."""
    model = formats_apart()
    formats = ("fp32", "bf16", "int8")
    alone = {w: model.generate(prompts(), 8, weights=w) for w in formats}
    assert len({str(v) for v in alone.values()}) == 3  # pairwise different
    barrier = threading.Barrier(3, timeout=30)

    def lockstep(*_: object) -> None:
        barrier.wait()

    handle = model.register_forward_pre_hook(lockstep)
    got: dict[str, object] = {}

    def run(w: str) -> None:
        try:
            got[w] = model.generate(prompts(), 8, weights=w)
        except BaseException as e:  # reported below, not lost in the thread
            got[w] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(w,)) for w in formats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    handle.remove()
    assert not any(t.is_alive() for t in threads)
    assert got == alone
