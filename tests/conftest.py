"""Test-wide settings: hypothesis runs the same examples every time, and briefly.

``HYPOTHESIS_PROFILE=thorough pytest`` draws more (still derandomized) examples.
"""

import importlib.util
import os
import sys

# Inductor compiles in the test's own process, not in the pool of worker processes it would
# start in each one: such pools have hung other projects' test runs (pytorch/pytorch#148651,
# flaky results with fork and threads; #162199, a five-minute wait at exit after a cold start),
# and on 2 cores shared by two test processes the pool has no core to spare anyway. The variable
# is read when torch._inductor.config is first imported, so it is set before torch is.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Pretrained models and the commands decode eagerly in the tests: a compiled step costs a
# minute on a model's first run on a machine. tests/models/test_aot_step.py compiles its own.
os.environ.setdefault("DIKKAT_COMPILE", "0")

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


def _import_triton_for_its_interpreter() -> None:
    """Without CUDA, the triton kernels' tests run them in triton's interpreter, which must be on
    (TRITON_INTERPRET=1) when triton is first imported, or triton's own functions are built for
    a GPU — and torch.compile imports triton on a CPU too, so a test of flex would import it
    first. So triton is imported here, interpreted, and the variable turned off again: only
    tests/core/test_triton*.py turn it back on while they run, so that in every other test the
    triton backend declines CPU tensors, as it does outside the tests."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is None:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()
