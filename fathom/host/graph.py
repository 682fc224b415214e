"""Decode steps as one CUDA graph, captured once and replayed per token (the FlashInfer / vLLM / SGLang pattern).

A decoder's step is a fixed list of launches over static buffers, with every per-step size read on the GPU
(``fathom.host.decoder``), and so is the cache's append of one token per session
(``OffloadedCache.enqueue_append``). :class:`StepGraph` captures, for each of its layers in order, optionally the
append of the new token's K/V and then the step, as one ``torch.cuda.CUDAGraph``; a replay copies the inputs into
the static buffers and launches the whole graph at once: the host cost of a decode token no longer grows with the
number of kernel launches. Outputs equal the eager :meth:`Decoder.run` (tested).

Under the CUDA simulator there are no graphs: a "replay" runs the same recorded launches, which still checks the
property a graph needs (nothing in them depends on host state that changes between steps).

Example::

    token = StepGraph(decoder, layers=range(36), append=True)   # captured once
    out = token(q, k, v)   # q [L', S, H·G, d], k, v [L', S, H, 1, d] -> float32 [L', S, H·G, d]
"""

from __future__ import annotations

import gc
from typing import Sequence

import numpy as np
import torch
from numba import cuda

from fathom.cuda.interop import DEVICE, SIMULATED
from fathom.host.decoder import Decoder


class StepGraph:
    """The decode steps of ``layers`` (a layer may repeat), each optionally preceded by the append of one token per
    session, captured as one CUDA graph.

    Args:
        decoder: the :class:`Decoder` whose steps are captured (its buffers become the graph's inputs/outputs).
        layers: the layers, in order (default: every layer of the cache).
        append: capture the append of one token per session before each layer's step.
    """

    def __init__(self, decoder: Decoder, layers: Sequence[int] | None = None, append: bool = False):
        if not isinstance(decoder, Decoder):
            raise ValueError(f"decoder must be a Decoder, got {type(decoder).__name__}")
        cache, s = decoder.cache, decoder.cache.shape
        cache.check()
        self.layers = list(range(s.layers)) if layers is None else [int(x) for x in layers]
        if not self.layers or any(not 0 <= x < s.layers for x in self.layers):
            raise ValueError(f"layers must be a non-empty list of layers in 0..{s.layers - 1}, got {layers!r}")
        self.decoder, self.append = decoder, bool(append)
        self._unique = sorted(set(self.layers))
        self._appends = np.bincount(self.layers, minlength=s.layers)  # tokens each layer gains per replay
        n = len(self.layers)
        self.q_in = torch.zeros((n, s.sessions, s.kv_heads * decoder.group, s.head_dim), dtype=torch.float32,
                                device=DEVICE)
        shape = (n, s.groups, 1, s.head_dim)
        self.out = torch.zeros_like(self.q_in)
        self.k_in = torch.zeros(shape, dtype=torch.float32, device=DEVICE) if append else None
        self.v_in = torch.zeros(shape, dtype=torch.float32, device=DEVICE) if append else None
        sessions = cache._all_sessions
        launches = []
        for i, layer in enumerate(self.layers):  # one host copy per input at replay: the per-layer copies are inside
            if append:
                launches.append(lambda stream, i=i, layer=layer: cache.enqueue_append(
                    layer, self.k_in[i], self.v_in[i], sessions, stream))
            launches.append(lambda stream, i=i, layer=layer: decoder.q_in[layer].copy_(self.q_in[i]))
            for _, stage in decoder.stages(layer):
                launches += stage
            launches.append(lambda stream, i=i, layer=layer: self.out[i].copy_(decoder.out[layer]))
        self._launches = launches
        self._graph = None
        if SIMULATED:
            return
        # Warm up on the capture stream first (kernels compiled, cuBLAS's workspace for that stream made: neither
        # may happen inside a capture), with the appends dry: the cache does not change.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with cache.dry_run(), torch.cuda.stream(side):
            stream = cache.stream()
            for launch in launches:
                launch(stream)
        self._graph = torch.cuda.CUDAGraph()
        # No finalizer may run inside the capture: one that frees GPU memory (an earlier graph's pool, found by the
        # cycle collector) would invalidate it. Collect now, keep the collector off while capturing, and let Numba
        # defer its own frees.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with cuda.defer_cleanup(), torch.cuda.graph(self._graph, stream=side):
                stream = cache.stream()  # the capture stream, which torch makes current
                for launch in launches:
                    launch(stream)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Replay: ``q [L', S, H·G, d]`` (``[S, H·G, d]`` for one layer) and, with appends, the new token's
        ``k, v [L', S, H, 1, d]`` (``[S, H, 1, d]``) -> float32 outputs of the same leading shape (the graph's
        output buffer, overwritten by the next replay)."""
        decoder, cache, s = self.decoder, self.decoder.cache, self.decoder.cache.shape
        n = len(self.layers)
        one = q.ndim == 3 if isinstance(q, torch.Tensor) else False
        q = q[None] if one else q
        qs = (n, s.sessions, s.kv_heads * decoder.group, s.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != qs or q.device.type != DEVICE.type:
            raise ValueError(f"q must be a tensor on {DEVICE.type} of shape {qs[1:] if n == 1 else qs}")
        if self.append:
            ks = (n, s.sessions, s.kv_heads, 1, s.head_dim)
            k, v = (None if x is None else x[None] if one else x for x in (k, v))
            for name, x in (("k", k), ("v", v)):
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != ks or x.device.type != DEVICE.type:
                    raise ValueError(f"{name} must be a tensor on {DEVICE.type} of shape {ks[1:] if n == 1 else ks}")
        elif k is not None or v is not None:
            raise ValueError("this graph appends nothing: pass q only (capture with append=True to append)")
        for layer in self._unique:
            held = cache.lengths(layer)  # also: the cache open, no error flagged
            if self.append and held.max() + self._appends[layer] > s.max_tokens:
                raise ValueError(f"appending to layer {layer} exceeds max_tokens = {s.max_tokens} "
                                 f"({int(held.max())} held)")
            if not self.append and held.min() == 0:
                raise ValueError(f"a session of layer {layer} holds no tokens: nothing to attend to")
        self.q_in.copy_(q)
        if self.append:
            self.k_in.copy_(k.reshape(self.k_in.shape))
            self.v_in.copy_(v.reshape(self.v_in.shape))
        if self._graph is not None:
            self._graph.replay()
        else:
            stream = cache.stream()
            for launch in self._launches:
                launch(stream)
        if self.append:
            cache._lengths += self._appends[:, None]
        return self.out[0] if one else self.out
