"""Numba CUDA twins of the reference (pack, plan, gather, scan, top-k), each tested against it.

Kernels keep the reference's names; they run under ``NUMBA_ENABLE_CUDASIM=1``
in CI at tiny sizes and on the GPU under the ``gpu`` test marker.
"""
