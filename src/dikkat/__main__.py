"""``python -m dikkat``: the ``dikkat`` command (what ``torchrun -m dikkat`` runs)."""

import sys

from dikkat.cli import main

sys.exit(main())
