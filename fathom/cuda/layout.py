"""The store's address arithmetic (``fathom.layout``) compiled as device functions: the same source, not a copy."""

from __future__ import annotations

from numba import cuda

from fathom import layout

record_offset = cuda.jit(device=True, inline=True)(layout.record_offset)
plane_in_near = cuda.jit(device=True, inline=True)(layout.plane_in_near)
scales_in_near = cuda.jit(device=True, inline=True)(layout.scales_in_near)
plane_word = cuda.jit(device=True, inline=True)(layout.plane_word)
scale_index = cuda.jit(device=True, inline=True)(layout.scale_index)
