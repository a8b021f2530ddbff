"""The training loop: schedule, optimizer groups, exact resume, checkpoints and their errors."""

import json
import math

import pytest
import torch

from dikkat.runs import checkpoint_dir
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import (
    LOG_FILE,
    PLOT_FILE,
    STATE_FILE,
    TrainConfig,
    Trainer,
    lr_factor,
    make_optimizer,
    resume_trainer,
)
from dikkat.weights import inference_model, onednn_linear_available

SPEC = TaskSpec(
    task="lm",
    seq_len=32,
    max_bytes=200_000,
    model_overrides={"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1, "max_len": 32},
)
CONFIG = TrainConfig(steps=12, batch_size=4, warmup=3, eval_every=6, log_every=1, eval_batches=2)


@pytest.fixture(scope="module")
def lm_task():
    return build_task(SPEC)


def fresh(task):
    """The module's task with a freshly initialised model (the corpus is reused)."""
    torch.manual_seed(SPEC.seed)
    task.model = type(task.model)(task.model.config)
    return task


def test_schedule_is_linear_warmup_then_cosine():
    c = TrainConfig(steps=110, warmup=10, min_lr_ratio=0.1)
    for s in range(10):
        assert lr_factor(s, c) == pytest.approx((s + 1) / 10)
    for s in (10, 35, 60, 110):
        progress = (s - 10) / 100
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr_factor(s, c) == pytest.approx(expected)
    assert lr_factor(110, c) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices(lm_task):
    opt = make_optimizer(lm_task.model, CONFIG)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == CONFIG.weight_decay and no_decay["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in lm_task.model.parameters())


def test_resume_continues_exactly(lm_task, tmp_path):
    """N steps straight == N/2 steps, save, resume, N/2 steps (dropout on, so RNG state counts)."""
    straight = Trainer(fresh(lm_task), CONFIG, tmp_path / "a")
    a = straight.train(progress=False)
    first = Trainer(fresh(lm_task), CONFIG, tmp_path / "b")
    stopped = first.train(progress=False, until=CONFIG.steps // 2)
    assert stopped.steps == CONFIG.steps // 2
    assert (checkpoint_dir(tmp_path / "b") / STATE_FILE).exists()
    resumed = resume_trainer(tmp_path / "b")
    assert resumed.step == CONFIG.steps // 2
    b = resumed.train(progress=False)
    losses = lambda t: [r["loss"] for r in t.history if "loss" in r]  # noqa: E731
    assert losses(straight) == losses(resumed)  # bit for bit, every step
    assert a.val_loss == b.val_loss
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_run_folder_has_log_plot_and_a_loadable_model(lm_task, tmp_path):
    t = Trainer(fresh(lm_task), CONFIG, tmp_path)
    result = t.train(progress=False)
    records = [json.loads(line) for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, CONFIG.steps + 1))
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert records[-1]["val_loss"] == result.val_loss
    assert (tmp_path / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = type(t.model).load(tmp_path)
    x = torch.randint(0, 256, (1, 8))
    assert torch.equal(model.eval()(x), t.model.eval()(x))


def test_loss_goes_down(lm_task):
    t = Trainer(
        fresh(lm_task),
        TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup=5, eval_every=0, log_every=5),
    )
    # the baseline: the untrained model's validation loss, about ln 256 (uniform over bytes)
    untrained = t.evaluate()
    assert abs(untrained - math.log(256)) < 0.5, untrained
    result = t.train(progress=False)
    losses = [r["loss"] for r in t.history if "loss" in r]
    assert losses[-1] < 0.8 * losses[0], losses
    assert result.val_loss < 0.8 * untrained, (
        f"validation loss {result.val_loss:.3f} after training, untrained {untrained:.3f}"
    )


@pytest.mark.skipif(not onednn_linear_available(), reason="no packed weights without oneDNN")
def test_inference_after_training_uses_the_trained_weights(lm_task):
    """Generation packs the weights into an inference copy; the fused AdamW steps that follow
    write the model's weights without bumping their version counters, and a copy made after
    them multiplies the trained weights."""
    t = Trainer(fresh(lm_task), TrainConfig(steps=3, batch_size=2, lr=1e-2, warmup=1, eval_every=0))
    x = torch.randint(0, 256, (1, 8))
    t.model.generate(x.tolist(), 2)  # packs every weight, of a copy
    t.train(progress=False)
    twin = type(t.model)(t.model.config)
    twin.load_state_dict(t.model.state_dict())
    trained, twin_copy = inference_model(t.model), inference_model(twin)
    torch.testing.assert_close(trained(x), twin_copy(x), rtol=0, atol=0)


def test_bf16_autocast_trains(lm_task):
    t = Trainer(fresh(lm_task), TrainConfig(steps=3, batch_size=2, bf16=True, eval_every=0))
    result = t.train(progress=False)
    assert math.isfinite(result.val_loss)
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # weights stay fp32


def test_resume_errors(lm_task, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a dikkat training run"):
        resume_trainer(tmp_path)
    Trainer(fresh(lm_task), CONFIG, tmp_path).train(progress=False, until=2)
    state = checkpoint_dir(tmp_path) / STATE_FILE
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"trainer_state\.pt is damaged"):
        resume_trainer(tmp_path)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        resume_trainer(tmp_path, verify=False)  # torch's own check of the file
    state.write_bytes(good)
    weights = checkpoint_dir(tmp_path) / "model.safetensors"
    other = Trainer(fresh(lm_task), CONFIG, tmp_path / "other")
    other.train(progress=False, until=3)
    weights.write_bytes((checkpoint_dir(tmp_path / "other") / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged"):
        resume_trainer(tmp_path)


def test_bad_configs():
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr must be"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="task must be one of"):
        TaskSpec(task="chat")
    with pytest.raises(ValueError, match="tokenizer must be"):
        TaskSpec(tokenizer="words")


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_ctrl_c_finishes_the_step_then_saves(lm_task, tmp_path):
    """SIGINT during a step: the step completes, the run is saved, and resume continues exactly."""
    import os
    import signal

    t = Trainer(fresh(lm_task), CONFIG, tmp_path)
    original = t.optimizer.step

    def step_then_interrupt(*args, **kwargs):
        result = original(*args, **kwargs)
        if t.step == 4:  # mid-step: after the weight update, before the step count moves
            os.kill(os.getpid(), signal.SIGINT)
        return result

    t.optimizer.step = step_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        t.train(progress=False)
    assert t.step == 5  # the interrupted step was finished, not torn
    resumed = resume_trainer(tmp_path)
    assert resumed.step == 5
    resumed.train(progress=False)
    straight = Trainer(fresh(lm_task), CONFIG, tmp_path / "straight")
    straight.train(progress=False)
    losses = lambda tr: [r["loss"] for r in tr.history if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(straight)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (3, TypeError, "device must be a device name"),
        ("nope", ValueError, "not a device torch knows"),
        pytest.param(
            "cuda",
            ValueError,
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
    ],
)
def test_a_device_that_cannot_train_is_refused_by_name(lm_task, device, error, match):
    with pytest.raises(error, match=match):
        Trainer(fresh(lm_task), CONFIG, device=device)
