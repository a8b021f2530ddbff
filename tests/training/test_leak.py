"""docs/contract.md §5: training without the causal mask gives a fake loss and a worse model."""

import math

from dikkat.training.leak import leak_demo

UNIFORM = math.log(256)  # nats/byte of guessing bytes uniformly: what the untrained GPT scores


def test_unmasked_training_loss_is_fake():
    r = leak_demo(
        steps=200, batch_size=16, seq_len=48, max_bytes=500_000, sample_tokens=20, progress=False
    )
    said = f"masked {r.masked}, unmasked {r.unmasked}, uniform {UNIFORM:.3f}"
    # the baseline each is measured against: the honest model learned (beats uniform guessing)
    assert r.masked.causal_val_loss < UNIFORM - 1.0, said
    # first half: without the mask the training loss falls far below the honest one ...
    assert r.unmasked.train_loss < 0.5 * r.masked.train_loss, said
    # ... second half: evaluated causally (as generation works) the leaky model is worse
    assert r.unmasked.causal_val_loss > r.masked.causal_val_loss + 0.3, said
    assert r.masked.sample.startswith("def ") and r.unmasked.sample.startswith("def ")
