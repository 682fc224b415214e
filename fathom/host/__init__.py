"""Host side of the offloaded decode step (design §8): what the host allocates, resolves and launches; the kernels are
``fathom.cuda``'s.

============  ==========================================================================================
module        what it holds or does
============  ==========================================================================================
``pinned``    page-locked, device-mapped host memory with an explicit lifetime (cuda-python)
``cache``     ``HostKVCache``: the K/V rows, landmarks and growing bit-plane stores (raw or rotated
              basis; the scales and first t planes in HBM, the rest in pinned host memory) of S sessions
              × L layers × H KV heads, and the HBM row cache of recently selected rows; appends run on the
              caller's current torch stream, with no host synchronisation
``launch``    ``Launch`` (a kernel launch with its arguments bound) and the one loop that runs a list of them
``strategy``  a method resolved once into the device work that scores the sealed tokens (plane scan,
              row scan, or none for dense)
``decoder``   the per-layer step as a fixed list of launches on the caller's current torch stream:
              ``Decoder(cache, DecoderSettings(...), group_size).run(layer, q)``
``graph``     ``StepGraph``: the appends and steps of a decode token as one CUDA graph, captured once and
              replayed per token (or enqueued into a larger capture)
============  ==========================================================================================

``tests/test_module_tables.py`` checks that this table names every module here and nothing else.
"""
