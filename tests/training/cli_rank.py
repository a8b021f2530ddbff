"""One rank of ``dikkat train`` under PyTorch's launcher (tests/training/test_ddp.py), which says,
as the rank leaves its process group, how many DistributedDataParallel objects are still alive.

There must be none: a DDP wrapper freed after its group was destroyed destroys the group inside
its reducer's destructor, with the GIL held, and can hang the rank at its end
(:func:`dikkat.training.parallel.release`).

``python cli_rank.py train ARGS``: ``dikkat train ARGS``, printing
``DDP objects alive at release: N``.
"""

from __future__ import annotations

import gc
import sys

from torch.nn.parallel import DistributedDataParallel

from dikkat.cli import main
from dikkat.training import parallel

leave = parallel.release


def counted(ranks: parallel.Ranks) -> None:
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    print(f"DDP objects alive at release: {alive}", flush=True)
    leave(ranks)


if __name__ == "__main__":
    parallel.release = counted  # what dikkat.cli.train imports when the command runs
    sys.exit(main(sys.argv[1:]))
