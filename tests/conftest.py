import os

import pytest
from hypothesis import settings

# The Numba CUDA kernels run under the simulator unless FATHOM_GPU=1 asks for the device. This must take
# effect before numba is first imported, so it lives in the root conftest, loaded before any test module.
ON_GPU = os.environ.get("FATHOM_GPU") == "1"
if not ON_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# One BLAS / OpenMP / torch thread per process (before NumPy or torch is first imported): CI runs two pytest-xdist
# workers on two cores, where a second thread per worker only contends (the NumPy fidelity runs were ~2x slower).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# CI runs on 2 cores: keep property tests small and free of wall-clock deadlines.
settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (mapped pinned memory, timing) need a real device: skipped under the simulator."""
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: set FATHOM_GPU=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
