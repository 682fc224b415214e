"""Host side of the offloaded decode step (SPEC §8).

``pinned``: page-locked, device-mapped host memory with an explicit lifetime (cuda-python);
``cache``: the offloaded K/V rows, landmarks and growing bit-plane segments (raw or rotated basis, in host memory
or HBM) of S sessions × L layers × H KV heads, appended on a side stream;
``decoder``: the per-layer step, ``Decoder(cache, DecoderSettings(...), group).run(layer, q)``.
"""
