"""Fathom inside other libraries' decoding loops: :mod:`fathom.integrations.transformers` (``FathomCache``).

================  ==========================================================================================
module            what it holds or does
================  ==========================================================================================
``transformers``  ``FathomCache`` and its ``FathomLayer``: the import path users read (it re-exports the public
                  names of ``settings``, ``attention`` and ``prefill``)
``settings``      ``FathomSettings`` (validated), the model's attention shapes (``ModelShape``; under tensor
                  parallelism this rank's share of the KV heads), loading the calibration given (cut to the
                  rank's heads)
``attention``     the ``"fathom"`` attention function registered with transformers; switching a model to it
                  and back
``prefill``       ``Prompt`` and ``prefill``: one dense prefill for several caches; what every prefill reads
                  off the prompt
``decoding``      ``Decoding``: the state the layers of one cache share (sessions, the prefill's bookkeeping,
                  calibration and plan from the prompt)
``sessions``      ragged sessions on the NumPy reference or the offloaded cache (``fathom.host``), and their pool
``token_graph``   the whole decode token as one CUDA graph (``custom_generate=decode``)
``warmup``        ``python -m fathom.integrations.warmup``: every kernel the offloaded backend launches for a
                  head dim and group size compiled into Numba's disk cache at deploy time
================  ==========================================================================================

``tests/test_module_tables.py`` checks that this table names every module here and nothing else.
"""
