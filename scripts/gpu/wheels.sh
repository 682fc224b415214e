#!/usr/bin/env bash
# Here (a machine with a registry), from the project root: the wheels a device call carries in .whl/ (git-excluded).
# numpy 2.4.6 because numba-cuda 0.30.4 calls np.row_stack, gone in the GPU image's numpy 2.5; gguf for the loader's
# conversion of a staged model (../shared/GPU.md). The GPU machine runs CPython 3.12.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl numpy==2.4.6
python -m pip download --quiet --no-deps -d .whl gguf
ls -l .whl
