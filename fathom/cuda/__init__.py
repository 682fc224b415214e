"""Numba CUDA twins of the reference, each tested against it (``tests/cuda``).

=============  =========================================================  ====================================
module         what it does on the GPU                                    reference twin
=============  =========================================================  ====================================
``pack``       quantize keys + pack bit planes and fp16 scales            ``quantize.quantize`` + ``pack_planes``
``plan``       water-filling of every query group, one launch             ``waterfill.waterfill_batched``
``gather``     run list from the depths; zero-copy gather into HBM        ``store.PlaneStore.runs`` / ``read``
``scan``       approximate scores from the staged planes                  ``scoring.approx_scores``
``topk``       top-k per head (+ sink, local, tail); union row list       ``selection.select`` / ``union_rows``
``landmark``   fp16 mean key of each sealed 8-token block                 ``scoring.landmarks``
``exact``      scores from staged rows (oracle, landmark), in torch       ``scoring.exact_scores`` / ``landmark_scores``
``rows``       gather of the winners' K/V rows; staging of every sealed   —
               landmark / K row; append of new rows
``attention``  exact attention over each head's rows (torch)              ``attention.attention``
``half``       fp32 <-> fp16 bit conversions with integer operations      ``astype(np.float16)``
``interop``    zero-copy torch tensor -> Numba array views                —
=============  =========================================================  ====================================

Kernels run under ``NUMBA_ENABLE_CUDASIM=1`` in CI at tiny sizes and on the GPU
with ``FATHOM_GPU=1``; ``python -m bench timing`` times them (``bench/timing.py``).
"""
