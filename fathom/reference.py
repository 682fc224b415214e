"""The NumPy reference of Fathom (design §10): the oracle every fast path is tested against.

Takes and returns NumPy arrays; bad input raises ``ValueError`` naming the argument.
"""

from fathom.bits import scan_bits
from fathom.quantize import dequantize, pack_planes, quantize, unpack_planes
from fathom.waterfill import per_layer_plan, waterfill, waterfill_batched

__all__ = [
    "dequantize",
    "pack_planes",
    "per_layer_plan",
    "quantize",
    "scan_bits",
    "unpack_planes",
    "waterfill",
    "waterfill_batched",
]
