"""Host side of the offloaded decode step (SPEC §8).

``pinned``: page-locked, device-mapped host memory with an explicit lifetime (cuda-python);
``cache``: the offloaded K/V rows and growing bit-plane segments of S sessions × L layers × H KV heads;
``decoder``: the per-layer step, ``Decoder(cache, DecoderSettings(...), group).run(layer, q)``.
"""
