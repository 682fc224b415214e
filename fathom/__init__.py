"""Fathom: per-query read depth for sparse decoding over offloaded KV caches.

``fathom`` holds the NumPy reference of every concept (the oracle),
``fathom.cuda`` the Numba CUDA kernels of the same names and ``fathom.host``
pinned host memory, segments and CUDA streams. The method is specified in ``docs/design.md``;
sections are cited as "design §n" throughout (§10: the reference API).
"""

__version__ = "0.1.0"
