"""``python -m dikkat.cli``: the same as the ``dikkat`` command."""

import sys

from dikkat.cli import main

sys.exit(main())
