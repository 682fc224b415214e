"""Decode steps as one CUDA graph, captured once and replayed per token (the FlashInfer / vLLM / SGLang pattern).

A decoder's step is a fixed list of launches over static buffers, with every per-step size read on the GPU
(``fathom.host.decoder``), and so is the cache's append of one token per session
(``HostKVCache.enqueue_append``). :class:`StepGraph` captures, for each of its layers in order, optionally the
append of the new token's K/V and then the step, as one ``torch.cuda.CUDAGraph``; a replay copies the inputs into
the static buffers and launches the whole graph at once: the host cost of a decode token no longer grows with the
number of kernel launches. Outputs equal the eager :meth:`Decoder.run` (tested).

Capturing costs milliseconds: no garbage collection is forced (the launches hold no reference cycles, so a graph
is freed when its last reference goes; the collector is only kept off during the capture, where a finalizer
freeing GPU memory would invalidate it) and torch's cache of GPU memory is not emptied.

:meth:`StepGraph.enqueue` puts the same launches on the current stream without a graph, for a larger capture that
contains them (a whole model's decode token, ``fathom.integrations.transformers``).

Under the CUDA simulator there are no graphs: a "replay" runs the same recorded launches, which still checks the
property a graph needs (nothing in them depends on host state that changes between steps).

Example::

    token = StepGraph(decoder, layers=range(36), append=True)
    out = token(q, k, v)   # captured at this first call, replayed at every later one
    # q [L', S, H·G, d], k, v [L', S, H, 1, d] -> float32 [L', S, H·G, d]
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch
from numba import cuda

from fathom import _checks
from fathom.cuda.interop import DEVICE, SIMULATED
from fathom.host.cache import FLOAT_DTYPES  # what run and append take: the buffers' copy would cast anything
from fathom.host.decoder import Decoder
from fathom.host.launch import Launch, run_launches


class StepGraph:
    """The decode steps of ``layers`` (a layer may repeat), each optionally preceded by the append of one token per
    session, captured as one CUDA graph.

    Args:
        decoder: the :class:`Decoder` whose steps are captured (its buffers become the graph's inputs/outputs).
        layers: the layers, in order (default: every layer of the cache).
        append: capture the append of one token per session before each layer's step.
        pool: a ``torch.cuda.graph_pool_handle()`` shared with other graphs replayed in capture order (None: own).
    """

    def __init__(self, decoder: Decoder, layers: Sequence[int] | None = None, append: bool = False, pool=None):
        if not isinstance(decoder, Decoder):
            raise ValueError(f"decoder must be a Decoder, got {type(decoder).__name__}")
        cache, s = decoder.cache, decoder.cache.shape
        cache.check()
        self.layers = list(range(s.layers)) if layers is None else list(layers)
        if not self.layers or any(not _checks.is_integer(x) or not 0 <= x < s.layers for x in self.layers):
            raise ValueError(f"layers must be a non-empty list of layers in 0..{s.layers - 1}, got {layers!r}")
        self.layers = [int(x) for x in self.layers]
        self.decoder, self.append = decoder, bool(append)
        self._unique = sorted(set(self.layers))
        self._appends = np.bincount(self.layers, minlength=s.layers)  # tokens each layer gains per replay
        n = len(self.layers)
        self.q_in = torch.zeros((n, s.sessions, s.kv_heads * decoder.group_size, s.head_dim), dtype=torch.float32,
                                device=DEVICE)
        self.out = torch.zeros_like(self.q_in)
        shape = (n, s.streams, 1, s.head_dim)
        self.k_in = torch.zeros(shape, dtype=torch.float32, device=DEVICE) if append else None
        self.v_in = torch.zeros(shape, dtype=torch.float32, device=DEVICE) if append else None
        self._launches = _token_launches(decoder, self.layers, self.q_in, self.k_in, self.v_in, self.out)
        self._pool = pool
        self._graph = None  # captured at the first replay: a graph used only through enqueue() never is

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Replay: ``q [L', S, H·G, d]`` (``[S, H·G, d]`` for one layer) and, with appends, the new token's
        ``k, v [L', S, H, 1, d]`` (``[S, H, 1, d]``) -> float32 outputs of the same leading shape (the graph's
        output buffer, overwritten by the next replay)."""
        self.check(q, k, v)
        out = self.replay(q, k, v)
        return out[0] if q.ndim == 3 else out

    def check(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
        """Refuse what :meth:`replay` would get wrong, before any copy: shapes, devices, the cache open with no
        error flagged, room for the appends, tokens to attend to."""
        decoder, cache, s = self.decoder, self.decoder.cache, self.decoder.cache.shape
        n = len(self.layers)
        one = isinstance(q, torch.Tensor) and q.ndim == 3
        qs = (n, s.sessions, s.kv_heads * decoder.group_size, s.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q[None].shape if one else q.shape) != qs \
                or q.device.type != DEVICE.type or q.dtype not in FLOAT_DTYPES:
            raise ValueError(f"q must be a float32, bf16 or fp16 tensor on {DEVICE.type} of shape "
                             f"{qs[1:] if n == 1 else qs}")
        if self.append:
            ks = (n, s.sessions, s.kv_heads, 1, s.head_dim)
            for name, x in (("k", k), ("v", v)):
                if not isinstance(x, torch.Tensor) or tuple(x[None].shape if one else x.shape) != ks \
                        or x.device.type != DEVICE.type or x.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"{name} must be a float32, bf16 or fp16 tensor on {DEVICE.type} of shape "
                                     f"{ks[1:] if n == 1 else ks}")
        elif k is not None or v is not None:
            raise ValueError("this graph appends nothing: pass q only (capture with append=True to append)")
        for layer in self._unique:
            held = cache.lengths(layer)  # also: the cache open, no error flagged
            if self.append and held.max() + self._appends[layer] > s.max_tokens:
                raise ValueError(f"appending to layer {layer} exceeds max_tokens = {s.max_tokens} "
                                 f"({int(held.max())} held)")
            if not self.append and held.min() == 0:
                raise ValueError(f"a session of layer {layer} holds no tokens: nothing to attend to")

    def replay(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`__call__` without its checks (the caller made them, e.g. once per decode token for every layer):
        copy the inputs in, replay, record the appends in the cache's host mirror. Returns ``out`` ``[L', ...]``."""
        if self._graph is None and not SIMULATED:
            self._graph = capture(self.decoder.cache, self._launches, self._pool)
        self._copy_inputs(q, k, v)
        if self._graph is not None:
            self._graph.replay()
        else:
            run_launches(self._launches, self.decoder.cache.stream())
        if self.append:
            self.decoder.cache.advance(self._appends)
        return self.out

    def enqueue(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """The same work as :meth:`replay`, launched one by one on the current stream and **not** recorded in the
        host mirror: for a larger CUDA graph that contains it, whose replays then advance the cache
        (``cache.advance``). Returns ``out``."""
        self._copy_inputs(q, k, v)
        run_launches(self._launches, self.decoder.cache.stream())
        return self.out

    def _copy_inputs(self, q, k, v) -> None:
        self.q_in.copy_(q.reshape(self.q_in.shape))
        if self.append:
            self.k_in.copy_(k.reshape(self.k_in.shape))
            self.v_in.copy_(v.reshape(self.v_in.shape))


def _token_launches(decoder: Decoder, layers: list[int], q_in, k_in, v_in, out) -> list[Launch]:
    """The launches of one replay. They close over the buffers, never over a StepGraph: no reference cycle keeps a
    dropped graph (and its memory) alive until the next garbage collection."""
    cache = decoder.cache
    launches: list[Launch] = []
    # one copy per input at replay; each layer's step reads and writes the graph's own buffers (no copy a layer)
    for i, layer in enumerate(layers):
        if k_in is not None:
            launches.append(lambda stream, i=i, layer=layer: cache.enqueue_append(layer, k_in[i], v_in[i], None,
                                                                                   stream))
        launches += decoder.launches_on(layer, q_in[i], out[i])
    return launches


@contextmanager
def _collector_off():
    """Python's cycle collector off inside (restored after): no finalizer may free GPU memory during a capture."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def capture(cache, launches: list[Launch], pool=None) -> torch.cuda.CUDAGraph:
    """``launches`` as one CUDA graph. They are first run once on the capture stream with the cache's appends dry
    (kernels compiled, cuBLAS's workspace made for that stream: neither may happen inside a capture; the cache
    does not change), then captured with Numba's frees deferred and the collector off."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with cache.dry_run(), torch.cuda.stream(side):
        run_launches(launches, cache.stream())
    graph = torch.cuda.CUDAGraph()
    with _collector_off(), cuda.defer_cleanup(), torch.cuda.stream(side):
        graph.capture_begin(pool=pool)
        try:
            run_launches(launches, cache.stream())  # the capture stream, which torch makes current
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph
