"""What a training run returns, and the error that stops a diverging one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainResult:
    """What a run reached."""

    steps: int
    train_loss: float  # last logged training loss, reported unit
    val_loss: float  # final validation loss, reported unit
    unit: str
    seconds: float  # wall time of this call
    tokens_per_second: float
    metrics: dict[str, float]
    out_dir: Path | None


class DivergedError(FloatingPointError):
    """The loss or the gradient norm stopped being finite; the step was not applied."""

    @classmethod
    def at(
        cls, step: int, what: str, saved_step: int | None, out_dir: Path | None
    ) -> DivergedError:
        """The error of step ``step`` (``what`` was not finite) naming the checkpoint kept."""
        kept = (
            f"the last checkpoint (step {saved_step}) in {out_dir} is untouched"
            if saved_step is not None
            else "nothing was saved"
        )
        return cls(
            f"training diverged at step {step}: {what}; the step was not applied and "
            f"{kept}. Try a lower lr or a longer warmup."
        )


class SaveError(OSError):
    """Writing the run folder failed (a full disk, a folder made read-only or removed). A
    checkpoint is all or nothing (:mod:`dikkat.runs`): the last one stays current and whole.
    ``errno`` is the failed write's."""

    def __init__(self, error: OSError, what: str, out_dir: Path, saved_step: int | None) -> None:
        kept = (
            f"the last checkpoint (step {saved_step}) is whole and current: --resume continues "
            "from it once the cause is fixed"
            if saved_step is not None
            else "no checkpoint of this run was saved"
        )
        self.message = f"could not write {what} in {out_dir}: {error.strerror or error}; {kept}"
        super().__init__(error.errno, self.message)

    def __str__(self) -> str:
        return self.message
