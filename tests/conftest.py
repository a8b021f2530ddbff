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

# Tiny tensors: more threads only add scheduling noise to the runtime.
torch.set_num_threads(min(2, torch.get_num_threads()))
