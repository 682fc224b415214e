"""float32 <-> float16 conversion done with integer operations (device functions).

The store's block scale is ``float16(max |k|)`` with NumPy's round-to-nearest-even.
Rounding in integers makes the kernels bit-identical to ``astype(np.float16)``
without depending on how the compiler lowers fp16 conversions, and works the
same under the CUDA simulator. Scales travel as their ``uint16`` bit patterns.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

F16_INF = 0x7C00


@cuda.jit(device=True, inline=True)
def f32_abs_bits_to_f16_bits(a):
    """fp16 bits of a non-negative finite float32 given by its bits ``a`` (uint32), round to nearest even."""
    exp = np.int32((a >> np.uint32(23)) & np.uint32(0xFF))
    mant = np.uint32(a & np.uint32(0x7FFFFF))
    e = exp - np.int32(112)  # rebias 127 -> 15
    if e >= 31:
        return np.uint16(F16_INF)
    if e <= 0:  # fp16 subnormal (or zero): the implicit bit joins the shifted mantissa
        if e < -10:
            return np.uint16(0)
        full = mant | np.uint32(0x800000)
        shift = np.uint32(14 - e)
        h = full >> shift
        rem = full & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
    else:
        h = (np.uint32(e) << np.uint32(10)) | (mant >> np.uint32(13))
        rem = mant & np.uint32(0x1FFF)
        half = np.uint32(0x1000)
    if rem > half or (rem == half and (h & np.uint32(1)) == np.uint32(1)):
        h += np.uint32(1)  # a carry into the exponent is right, up to inf
    return np.uint16(h)


@cuda.jit(device=True, inline=True)
def f16_bits_to_f32(h):
    """The float32 value of non-negative fp16 bits ``h`` (exact; inf for 0x7C00)."""
    e = np.int32((h >> 10) & 0x1F)
    m = np.int32(h & 0x3FF)
    if e == 31:
        return np.float32(np.inf)
    if e == 0:
        return np.float32(m) * np.float32(2.0**-24)
    # (1024 + m) · 2^e · 2^-25: every factor and product is exact in float32
    return np.float32(1024 + m) * np.float32(np.int64(1) << e) * np.float32(2.0**-25)
