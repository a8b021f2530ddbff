"""What each spawned rank of tests/hf/test_hf_ring.py runs: tiny Hugging Face models (random
weights, fp64, the same on every rank from one seed) with their sequence split over the ranks by
dikkat.hf.register_ring, against the same model on the whole sequence in this process with
dikkat's fp64 reference attention (and transformers' eager, whose softmax is fp32, within 1e-6)
— the logits gathered from the ranks, and the gradients of a loss summed over them — and the
calls the ring must refuse, on every rank together. An assertion raises in the child, which
fails the test."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn

import dikkat.hf
from dikkat.distributed import gather_sequence, shard_positions, shard_sequence
from spawning import gloo_group

N, B, V = 21, 2, 97  # 21 tokens: 6, 5, 5, 5 per zigzag chunk, 11 and 10 per contiguous shard
TOL = 1e-10  # fp64, against dikkat's reference attention in one process
# Gemma 2's RMSNorm computes in fp32 even for fp64 weights, so the ranks' shares of its weights'
# gradients, summed in another order than one process sums them, agree to fp32's rounding only
GRAD_TOL = {"gemma2": 1e-8}
EAGER_TOL = 1e-6  # transformers' eager attention takes its softmax in fp32
REFERENCE = dikkat.hf.register("dikkat_reference", backend="reference")
NAMES = {layout: dikkat.hf.register_ring(f"dikkat_ring_{layout}", layout=layout)
         for layout in ("zigzag", "contiguous")}  # fmt: skip


def _small(**extra: object) -> dict:
    return dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                **extra)  # fmt: skip


def llama(**extra: object) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_small(**extra)))


def mistral() -> nn.Module:  # a window of 4 keys, shorter than every shard
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_small(sliding_window=4)))


def gemma2(softcap: float | None = None) -> nn.Module:  # a window of 4 on every other layer
    config = transformers.Gemma2Config(
        **_small(head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=softcap),
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "llama, bidirectional": lambda: llama(is_causal=False),
    "mistral": mistral,
    "gemma2": gemma2,
}


def build(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make().double().eval()


def batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    """ids (B, N), and the next token of each as its label (−100, ignored, for the last)."""
    ids = torch.randint(1, V, (B, N), generator=torch.Generator().manual_seed(seed))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    return ids, labels


def loss_of(logits: Tensor, labels: Tensor) -> Tensor:
    """The loss of the whole batch's next tokens, as a sum that the ranks' shares add up to."""
    total = B * (N - 1)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                       ignore_index=-100) / total  # fmt: skip


def check_model(name: str, make: Callable[[], nn.Module], layout: str) -> None:
    where = f"{name}, {layout}, rank {dist.get_rank()}"
    model = build(make)
    params = [p for p in model.parameters() if p.requires_grad]
    ids, labels = batch()
    model.set_attn_implementation(REFERENCE)
    ref = model(ids, use_cache=False).logits  # (B, N, V), one process, the whole sequence
    ref_grads = torch.autograd.grad(loss_of(ref, labels), params)
    assert ref.abs().max() > 0.1, where  # the comparison is not trivially true
    model.set_attn_implementation("eager")  # transformers' own, its softmax in fp32
    eager = model(ids, use_cache=False).logits.detach()
    torch.testing.assert_close(eager, ref.detach(), rtol=EAGER_TOL, atol=EAGER_TOL, msg=where)

    model.set_attn_implementation(NAMES[layout])
    local = model(shard_sequence(ids, 1, layout), position_ids=shard_positions(N, layout)[None],
                  use_cache=False).logits  # (B, T, V): this rank's tokens  # fmt: skip
    got = gather_sequence(local.detach(), 1, layout)
    torch.testing.assert_close(got, ref.detach(), rtol=TOL, atol=TOL, msg=where)
    grads = torch.autograd.grad(loss_of(local, shard_sequence(labels, 1, layout)), params)
    tol = GRAD_TOL.get(name, TOL)
    for p, g, want in zip(model.named_parameters(), grads, ref_grads, strict=True):
        dist.all_reduce(g)  # each rank's loss is its tokens' share: the gradients add up
        torch.testing.assert_close(g, want, rtol=tol, atol=tol, msg=f"d {p[0]}: {where}")
    assert max(g.abs().max() for g in ref_grads) > 1e-3, where


def expect_refusal(call: Callable[[], object], *needles: str) -> None:
    try:
        call()
    except ValueError as e:
        assert all(n in str(e) for n in needles), f"rank {dist.get_rank()}: {e}"
    else:
        raise AssertionError(f"rank {dist.get_rank()}: no ValueError (expected {needles})")


def check_refusals(rank: int) -> None:
    ids, _ = batch()
    z = {"layout": "zigzag"}
    ids_z, pos_z = shard_sequence(ids, 1, **z), shard_positions(N, **z)[None]
    model = build(llama)
    model.set_attn_implementation(NAMES["zigzag"])

    def run(**kwargs: object) -> Callable[[], object]:
        return lambda: model(**{"input_ids": ids_z, "position_ids": pos_z, "use_cache": False,
                                **kwargs})  # fmt: skip

    expect_refusal(run(use_cache=True), "LlamaAttention[0]", "use_cache=True")
    expect_refusal(run(output_attentions=True), "output_attentions")
    # a keyword dikkat does not know (the model forwards its call's extras to attention)
    expect_refusal(run(frobnicate=True), "LlamaAttention[0] passed frobnicate=True")
    # right padding: the last two tokens, in zigzag on rank 0 (it holds the last chunk)
    pad = shard_sequence((torch.arange(N) < N - 2).long().expand(B, N), 1, **z)
    expect_refusal(run(attention_mask=pad), "padding" if rank == 0 else "rank(s) [0]")
    T = ids_z.shape[1]
    expect_refusal(run(attention_mask=torch.ones(B, 1, T, T, dtype=torch.bool)), "4-D")
    # two packed sequences of 9 and 12 tokens: positions that restart are not global
    packed = shard_sequence(torch.cat([torch.arange(9), torch.arange(12)])[None], 1, **z)
    expect_refusal(run(position_ids=packed), "not this rank's global positions")

    # no position_ids: contiguous rank 0's local positions are global, rank 1's are not
    c = {"layout": "contiguous"}
    model.set_attn_implementation(NAMES["contiguous"])
    no_positions = lambda: model(shard_sequence(ids, 1, **c), use_cache=False)  # noqa: E731
    expect_refusal(no_positions, "not this rank's global" if rank == 1 else "rank(s) [1]")

    model = build(lambda: llama(attention_dropout=0.1)).train()
    model.set_attn_implementation(NAMES["zigzag"])
    expect_refusal(run(), "dropout=0.1")

    model = build(lambda: gemma2(softcap=50.0))
    model.set_attn_implementation(NAMES["zigzag"])
    expect_refusal(run(), "Gemma2Attention[0]", "softcap")

    # Gemma 2 does not pass use_cache to its layers: its first call fills a cache with this
    # rank's keys alone, and a call that continues from that cache is refused
    model = build(gemma2)
    model.set_attn_implementation(REFERENCE)
    ref = model(ids, use_cache=False).logits.detach()
    model.set_attn_implementation(NAMES["zigzag"])
    first = model(ids_z, position_ids=pos_z)
    got = gather_sequence(first.logits.detach(), 1, **z)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg="gemma2 with a cache")
    cache = first.cache
    nxt = dict(position_ids=torch.full((1, 1), N), cache=cache)
    expect_refusal(lambda: model(ids[:, :1], **nxt), "KV cache")

    bert = build(lambda: transformers.BertModel(transformers.BertConfig(
        **_small(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))  # fmt: skip
    bert.set_attn_implementation(NAMES["zigzag"])
    expect_refusal(lambda: bert(ids_z), "BertSelfAttention[", "no position_ids")

    t5 = build(lambda: transformers.T5Model(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        dropout_rate=0.0)))  # fmt: skip
    t5.set_attn_implementation(NAMES["zigzag"])
    expect_refusal(lambda: t5(ids_z, decoder_input_ids=ids_z, use_cache=False), "position_bias")


def check_shard_positions() -> None:
    for layout in ("zigzag", "contiguous"):
        for n in (N, 3):  # 3 < 2·2 chunks: a rank holds an empty chunk
            want = shard_sequence(torch.arange(n), 0, layout)
            assert torch.equal(shard_positions(n, layout), want), (layout, n)
    expect_refusal(lambda: shard_positions(-1), "n must be a non-negative int")
    expect_refusal(lambda: shard_positions(N, "stripes"), "layout", "stripes")


def run(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        check_shard_positions()
        for layout in ("zigzag", "contiguous"):
            for name, make in MODELS.items():
                check_model(name, make, layout)
        check_refusals(rank)
