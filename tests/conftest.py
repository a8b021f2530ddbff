"""Test-wide settings: hypothesis runs the same examples every time, and briefly.

``HYPOTHESIS_PROFILE=thorough pytest`` draws more (still derandomized) examples.
"""

import os

import torch
from hypothesis import settings

# derandomize: a failure seen once is seen again on every machine (no example database needed);
# deadline=None: the first call into a torch kernel can be slow while it warms up.
settings.register_profile(
    "dikkat", derandomize=True, max_examples=30, deadline=None, database=None, print_blob=True
)
settings.register_profile(
    "thorough", derandomize=True, max_examples=300, deadline=None, database=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dikkat"))

# The tests use tiny tensors, where a second BLAS/OpenMP thread only spins: on a 2-core machine
# that is busy with anything else, fp32 matmuls run 50× slower with 2 threads than with 1.
torch.set_num_threads(1)
