"""GPU twins of the NumPy reference, each tested against it (``tests/cuda``): Numba CUDA kernels for the offloaded
decode step (driven by ``fathom.host``), and torch for the fidelity evaluation and the calibration.

================  ==============================================================  ===================================
module            what it does, and in what                                       NumPy twin in ``fathom``
================  ==============================================================  ===================================
``append``        Numba kernels: check appended keys / values and write their     ``store.PlaneStore.append``;
                  bf16 K/V rows, copy the new open block into the tail, advance   ``quantize.quantize``'s checks
                  the device lengths; a bad element raises the layer's flag
``pack``          Numba kernel: seal the blocks an append completes (quantize,    ``quantize.quantize`` +
                  bit planes and fp16 scales into the store's records, σ² sums,   ``quantize.pack_planes``;
                  fp16 landmarks)                                                 ``scoring.landmarks``
``plan``          Numba kernels: water-filling of every stream in one             ``waterfill.waterfill_batched``;
                  launch; SparQ's top channels                                    ``methods.QueryTopChannels``
``scan``          Numba kernel: approximate scores straight from the store        ``scoring.approx_scores``
                  (each plane from its tier: HBM or pinned host memory), with
                  the candidates' top-byte histogram
``exact``         Numba kernel: oracle scores over the bf16 K rows, landmark      ``scoring.exact_scores`` /
                  scores over the fp16 mean keys, with the same histogram         ``scoring.landmark_scores``
``topk``          Numba kernels: top-k per head (+ sink, local, tail) by radix    ``selection.select`` /
                  select; the ascending row list of each KV head                  ``selection.union_rows``
``attention``     Numba kernels: gather of the listed K/V rows into HBM (from     ``attention.attention``
                  the row cache's slab on a hit); exact attention of each head
                  over its rows (split softmax)
``row_cache``     Numba kernel: the HBM row cache's step — hits, LRU victims,     ``row_cache.RowCache.assign``
                  each row's source (slab, fill or bypass)
``score_keys``    the scores a scan hands the selection: float32 order keys split  ``selection.order_keys``
                  into 16-bit halves (the selection's passes read the high ones);
                  NumPy conversions, and the scans' device store
``block``         Numba device functions: block-wide prefix sum,                  —
                  order-preserving float keys, histogram flush
``half``          Numba device functions: fp32 <-> fp16 with integer              ``astype(np.float16)``
                  operations, bf16 -> fp32
``layout``        Numba device functions: the store's address arithmetic,         ``layout`` (the same source)
                  compiled from ``fathom.layout``'s own source
``interop``       zero-copy torch tensor -> Numba array views; launch bounds      —
``kernel_cache``  Numba's on-disk cache of these kernels: its folder, stale       —
                  kernels dropped when a source changes, what a process
                  compiled or loaded (``python -m fathom.integrations.warmup``)
``fidelity``      torch, any device: every method on every layer, KV head and     ``fidelity.evaluate``
                  position of a capture (``bench fidelity --device cuda``)
``calibration``   torch, any device: one layer's calibration statistics (σ²,      ``calibration.calibrate``
                  Double Sparsity's channels, the ordered KLT basis) during a
                  prefill
================  ==============================================================  ===================================

Kernels run under ``NUMBA_ENABLE_CUDASIM=1`` in CI at tiny sizes and on the GPU
with ``FATHOM_GPU=1``; ``python -m bench timing`` times them (``bench/timing.py``).
``tests/test_module_tables.py`` checks that this table names every module here and nothing else.
"""
