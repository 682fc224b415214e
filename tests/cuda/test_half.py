"""The device conversions of ``fathom.cuda.half`` (fp16 and bf16 widened) against NumPy: every non-negative bit
pattern on a GPU, every exponent with its extreme and a middle mantissa under the simulator (a Python call per
operation there)."""

import numpy as np
from numba import cuda

from fathom.cuda.half import bf16_bits_to_f32, f16_bits_to_f32
from fathom.cuda.interop import SIMULATED


@cuda.jit
def _widen(bits, f16_out, bf16_out):
    i = cuda.grid(1)
    if i < bits.shape[0]:
        f16_out[i] = f16_bits_to_f32(np.uint32(bits[i]))
        bf16_out[i] = bf16_bits_to_f32(bits[i])


def test_fp16_and_bf16_bits_widen_exactly():
    if SIMULATED:
        bits = (np.arange(32, dtype=np.uint16)[:, None] << 10 | np.array([0, 1, 0x155, 0x3FF], np.uint16)).ravel()
    else:
        bits = np.arange(1 << 15, dtype=np.uint16)  # every non-negative fp16 pattern, and the positive bf16 ones
    f16_out, bf16_out = (np.zeros(len(bits), np.float32) for _ in range(2))
    _widen[-(-len(bits) // 128), 128](bits, f16_out, bf16_out)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)  # exponent-31 patterns other than inf: NaN either way, whatever its payload
    assert np.isnan(f16_out[nan]).all()
    np.testing.assert_array_equal(f16_out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    np.testing.assert_array_equal(bf16_out.view(np.uint32), bits.astype(np.uint32) << 16)
