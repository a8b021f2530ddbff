"""``loss.png`` is drawn with every save, so a run stopped by Ctrl-C has its curves too
(docs/runs.md)."""

import json
import os
import signal

import pytest
import torch

from dikkat.runs import read_pointer
from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import PLOT_FILE, TrainConfig, Trainer

SPEC = TaskSpec(
    task="lm",
    seq_len=16,
    data=json.__file__,  # a small text of the standard library
    model_overrides={"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 16},
)
CONFIG = TrainConfig(steps=8, batch_size=2, warmup=1, eval_every=0, log_every=1, eval_batches=1)


@pytest.fixture
def task():
    torch.manual_seed(0)
    return build_task(SPEC)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_run_stopped_by_ctrl_c_has_its_loss_plot(task, tmp_path):
    t = Trainer(task, CONFIG, tmp_path)
    original = t.optimizer.step

    def step_then_interrupt(*args, **kwargs):
        result = original(*args, **kwargs)
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    t.optimizer.step = step_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        t.train(progress=False)
    assert read_pointer(tmp_path)["step"] == 3  # saved, and stopped before the end
    plot = tmp_path / PLOT_FILE
    assert plot.is_file() and plot.read_bytes()[:4] == b"\x89PNG"


def test_the_plot_is_redrawn_at_each_save(task, tmp_path):
    t = Trainer(task, CONFIG, tmp_path)
    t.train(progress=False, until=2)
    first = (tmp_path / PLOT_FILE).read_bytes()
    t.train(progress=False, until=5)  # two more logged steps: other curves
    assert (tmp_path / PLOT_FILE).read_bytes() != first
