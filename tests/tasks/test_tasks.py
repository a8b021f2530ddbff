"""Each model family learns its task (docs/contract.md §11): short runs that must beat a
baseline."""

import pytest
import torch

from dikkat.tasks import TaskSpec, build_task, step_generator
from dikkat.text import load_tokenizer
from dikkat.training.trainer import TrainConfig, Trainer, resume_trainer

SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2}


@pytest.fixture(scope="module")
def mlm_task():
    return build_task(
        TaskSpec(
            task="mlm",
            seq_len=64,
            max_bytes=300_000,
            model_overrides={"d_model": 64, "n_layers": 2, "n_heads": 4},
        )
    )


def test_mlm_masks_15_percent_then_80_10_10(mlm_task):
    b = mlm_task.batch("train", step_generator(0, 0), 256)
    x, y = b["x"], b["y"]
    chosen = y != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    as_mask = (x == mlm_task.mask_id) & chosen
    unchanged = (x == y) & chosen
    assert abs(as_mask.sum().item() / chosen.sum().item() - 0.8) < 0.02
    # the 10 % "random" may draw the original token by chance (1/256), so unchanged is ≈ 10 %
    assert abs(unchanged.sum().item() / chosen.sum().item() - 0.1) < 0.02
    assert not ((x == mlm_task.mask_id) & ~chosen).any()  # only chosen tokens are masked


def test_mlm_learns_beyond_the_commonest_token(mlm_task):
    untrained = mlm_task.evaluate(mlm_task.model.eval())
    Trainer(
        mlm_task, TrainConfig(steps=300, batch_size=32, lr=3e-3, warmup=50, eval_every=0)
    ).train(progress=False)
    m = mlm_task.evaluate(mlm_task.model.eval())
    # the baselines, measured on the same masked tokens: the best context-free guesses (the
    # unigram distribution's loss, always the commonest token) and the untrained model
    assert untrained["masked_loss"] > m["unigram_loss"], untrained
    # it uses the context: far below the best context-free loss
    assert m["masked_loss"] < m["unigram_loss"] - 0.3, (
        f"masked loss {m['masked_loss']:.3f}, unigram baseline {m['unigram_loss']:.3f}, "
        f"untrained {untrained['masked_loss']:.3f}"
    )
    assert m["masked_accuracy"] > m["most_common_token_accuracy"], (
        f"masked accuracy {m['masked_accuracy']:.3f}, always the commonest token "
        f"{m['most_common_token_accuracy']:.3f}, untrained {untrained['masked_accuracy']:.3f}"
    )


def test_translate_learns_held_out_numbers():
    from dikkat.tasks.translate import exact_match

    task = build_task(TaskSpec(task="translate", model_overrides={"d_model": 64, "n_heads": 4}))
    before = exact_match(task.model.eval(), task.heldout[:100], task.tokenizer)
    Trainer(task, TrainConfig(steps=400, batch_size=64, lr=3e-3, warmup=30, eval_every=0)).train(
        progress=False
    )
    score = exact_match(task.model.eval(), task.heldout[:100], task.tokenizer)
    # the baseline, measured: the untrained model translates none of them
    assert before == 0.0
    # held-out numbers, never seen in training
    assert score > 0.9, f"exact match {score:.2f} after training, untrained {before:.2f}"


def test_bpe_tokenizer_is_trained_saved_and_reused(tmp_path):
    spec = TaskSpec(
        task="lm",
        tokenizer="bpe",
        vocab_size=300,
        seq_len=32,
        max_bytes=100_000,
        model_overrides={**SMALL, "max_len": 32},
    )
    task = build_task(spec)
    assert task.tokenizer.vocab_size == 300 and task.model.config.vocab_size == 300
    assert task.report_scale < 1  # a BPE token covers more than one byte: nats/byte < nats/token
    text = "def main():\n    return 0\n"
    assert task.tokenizer.decode(task.tokenizer.encode(text)) == text
    Trainer(task, TrainConfig(steps=2, batch_size=2, eval_every=0), tmp_path).train(progress=False)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == task.tokenizer.encode(text)
    resumed = resume_trainer(tmp_path, steps=3)  # reuses the saved BPE, no retraining
    assert resumed.task.tokenizer.encode(text) == task.tokenizer.encode(text)
    x = torch.randint(0, 300, (1, 8))
    assert torch.equal(resumed.model.eval()(x), task.model.eval()(x))
