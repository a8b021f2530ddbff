"""One rank of tests/training/test_ddp.py, run by ``python -m torch.distributed.run``.

``python ddp_worker.py SPEC CONFIG OUT SIDE [OPTIONS]``: trains a new run (SPEC and CONFIG as
JSON) into OUT, writing beside it, into SIDE, this process's id (``pid-RANK``) and every write into
OUT that Python's audit hooks saw from this process (``writes-RANK.json``: folders made, files
opened for writing, renames, removals). OPTIONS (JSON) may give the Trainer's ``parallel`` and
the step to stop at, ``until`` (tests/training/test_fsdp.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dikkat.tasks import TaskSpec, build_task
from dikkat.training.trainer import TrainConfig, Trainer

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree"}


def main() -> None:
    spec, config = TaskSpec(**json.loads(sys.argv[1])), TrainConfig(**json.loads(sys.argv[2]))
    out, side = Path(sys.argv[3]).resolve(), Path(sys.argv[4])
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    rank = os.environ["RANK"]
    (side / f"pid-{rank}").write_text(str(os.getpid()))
    writes: list[str] = []

    def inside(path: object) -> bool:
        if not isinstance(path, str | bytes | os.PathLike):
            return False
        where = os.path.abspath(os.fsdecode(path))  # no resolve(): its own calls are audited
        return where == str(out) or where.startswith(str(out) + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writing and inside(path):
                writes.append(f"open {path}")
        elif event in PATH_EVENTS and any(inside(a) for a in args[:2]):
            writes.append(f"{event} {args[0]}")

    sys.addaudithook(hook)
    trainer = Trainer(build_task(spec), config, out, parallel=options.get("parallel", "ddp"))
    trainer.train(progress=False, until=options.get("until"))
    (side / f"writes-{rank}.json").write_text(json.dumps(writes))


if __name__ == "__main__":
    main()
