"""Training tasks and their registry: ``lm`` (GPT), ``mlm`` (BERT), ``translate`` (the
encoder-decoder), ``digits`` (a ViT), ``shapes`` (a DETR-style detector).

Importing this package registers every built-in task; a new task is one module that defines a
:class:`Task` and calls :func:`register_task` (see :mod:`dikkat.tasks.base`).
"""

from dikkat.tasks import digits, lm, mlm, shapes, translate  # noqa: F401 — each registers itself
from dikkat.tasks.base import (
    DEFAULT_RECIPE,
    Task,
    TaskInfo,
    TaskSpec,
    build_task,
    register_task,
    step_generator,
    task_info,
    task_names,
)

__all__ = [
    "DEFAULT_RECIPE",
    "Task",
    "TaskInfo",
    "TaskSpec",
    "build_task",
    "register_task",
    "step_generator",
    "task_info",
    "task_names",
]
