"""float32 <-> float16 and float32 <-> bf16 conversions for the kernels (device functions).

The store's block scale is ``float16(max |k|)`` with NumPy's round-to-nearest-even.
Rounding in integers makes the kernels bit-identical to ``astype(np.float16)``
without depending on how the compiler lowers fp16 conversions, and works the
same under the CUDA simulator. Widening an fp16 is exact, so it is the GPU's own
conversion (one instruction, ``HADD2.F32`` on sm_90; the plane scan widens a
scale per channel and block). Scales travel as their ``uint16`` bit patterns.
K/V rows are bf16 bit patterns: ``f32_to_bf16_bits`` rounds to them as torch's ``.to(torch.bfloat16)`` does,
``bf16_bits_to_f32`` widens them exactly.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda
from numba.cuda import libdevice

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


if config.ENABLE_CUDASIM:
    def f32_from_bits(bits):
        """The float32 whose bits are ``bits`` (uint32; simulator: through a NumPy view)."""
        return np.array([np.uint32(bits)], np.uint32).view(np.float32)[0]
else:
    @cuda.jit(device=True, inline=True)
    def f32_from_bits(bits):
        """The float32 whose bits are ``bits`` (uint32)."""
        return libdevice.int_as_float(np.int32(bits))


if config.ENABLE_CUDASIM:
    def f16_bits_to_f32(h):
        """The float32 value of fp16 bits ``h`` (simulator: through a NumPy view)."""
        return np.float32(np.array([np.uint16(h)], np.uint16).view(np.float16)[0])
else:
    @cuda.jit(device=True, inline=True)
    def f16_bits_to_f32(h):
        """The float32 value of fp16 bits ``h`` (exact: the GPU's widening conversion, one instruction)."""
        return libdevice.half2float(np.int16(h))


@cuda.jit(device=True, inline=True)
def bf16_bits_to_f32(h):
    """The float32 value of bf16 bits ``h``: the bits are the high half of the float32's (exact)."""
    return f32_from_bits(np.uint32(h) << np.uint32(16))


if config.ENABLE_CUDASIM:
    def f32_to_bits(x):
        """The bits of float32 ``x`` as uint32 (simulator: through a NumPy view)."""
        return np.array([x], np.float32).view(np.uint32)[0]
else:
    @cuda.jit(device=True, inline=True)
    def f32_to_bits(x):
        """The bits of float32 ``x`` as uint32."""
        return np.uint32(libdevice.float_as_int(x))


@cuda.jit(device=True, inline=True)
def f32_to_f16_bits(x):
    """fp16 bits of finite float32 ``x`` (signed), round to nearest even: NumPy's ``astype(np.float16)``."""
    bits = f32_to_bits(x)
    h = f32_abs_bits_to_f16_bits(bits & np.uint32(0x7FFFFFFF))
    if bits >> np.uint32(31):
        h = np.uint16(h | np.uint16(0x8000))
    return h


@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits(x):
    """bf16 bits of non-NaN float32 ``x``, round to nearest even (torch's ``.to(torch.bfloat16)``; past the largest
    bf16 it rounds to inf, as torch does)."""
    bits = f32_to_bits(x)
    return np.uint16(np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
