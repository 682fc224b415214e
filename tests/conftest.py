import os
import sys

import pytest
from hypothesis import settings

# The Numba CUDA kernels run under the simulator unless FATHOM_GPU=1 asks for the device. This must take
# effect before numba is first imported, so it lives in the root conftest, loaded before any test module.
ON_GPU = os.environ.get("FATHOM_GPU") == "1"
if not ON_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    # The simulator runs a CTA's threads as Python threads while its own loop polls them, holding the GIL, until
    # every one waits at a barrier; at the default 5 ms switch interval a thread let through a barrier waits out the
    # poller's slice. At 0.5 ms the simulated kernels run about 3x faster (a row-cache decoder test: 99 -> 33 s).
    sys.setswitchinterval(5e-4)

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
