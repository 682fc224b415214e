"""Where a decoding loop keeps its sessions' K/V: the NumPy reference or the offloaded GPU cache.

Both hold S ragged sessions × L layers × H KV heads (every session at its own
length), take torch tensors and give the attention output back as float32 torch:

* :class:`ReferenceSessions` (CPU): per (layer, session, KV head) a growing
  :class:`~fathom.decode.HeadIndex` — raw bit-plane store, the rotated one when
  the method scans it, exact float32 keys — and exact float32 values; a step
  is :func:`~fathom.decode.decode_step` of each query group, so it equals the
  reference decode by construction. Appends only seal new blocks: nothing
  sealed is re-quantized, and only new blocks are dequantized for the scorer.
* :class:`OffloadedSessions` (GPU): :class:`fathom.host.cache.OffloadedCache`
  (bf16 rows and bit planes in pinned host memory) and
  :class:`fathom.host.decoder.Decoder`; full K/V never come back to the GPU.

``append(layer, session, k, v)`` adds ``m`` tokens to one session
(``k, v [H, m, d]``); ``step(layer, q, k, v)`` appends one token to every
session (``k, v [S, H, d]``) and decodes ``q [S, H·G, d] -> [S, H·G, d]``.

Example (the reference at its most faithful: dense is exact attention)::

    >>> import torch
    >>> from fathom import methods
    >>> from fathom.integrations.sessions import ReferenceSessions, SessionShape
    >>> from fathom.selection import Selection
    >>> shape = SessionShape(sessions=1, layers=1, kv_heads=1, group=2, head_dim=8)
    >>> sessions = ReferenceSessions(shape, methods.dense(), Selection(k=0), scale=8 ** -0.5)
    >>> k, v = torch.randn(2, 1, 5, 8)
    >>> sessions.append(0, 0, k, v)
    >>> q, k1, v1 = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    >>> out = sessions.step(0, q, k1, v1)
    >>> keys, values = torch.cat([k[0], k1[0]]), torch.cat([v[0], v1[0]])
    >>> dense = torch.softmax(q[0] @ keys.T * 8 ** -0.5, -1) @ values
    >>> bool(torch.allclose(out[0], dense, atol=1e-6)), sessions.lengths(0).tolist()
    (True, [6])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fathom.calibration import Calibration
from fathom.decode import HeadIndex, decode_step
from fathom.methods import HeadStats, Method
from fathom.growing import GrowingRows
from fathom.selection import Selection


@dataclass(frozen=True)
class SessionShape:
    """``sessions`` × ``layers`` × ``kv_heads`` streams of ``head_dim``; ``group`` query heads per KV head;
    ``max_tokens`` per session (the offloaded cache reserves it up front; the reference grows)."""

    sessions: int
    layers: int
    kv_heads: int
    group: int
    head_dim: int
    max_tokens: int | None = None

    def __post_init__(self):
        for name in ("sessions", "layers", "kv_heads", "group", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


def scans_rotated(method: Method) -> bool:
    """Whether ``method`` scans the rotated store (fathom-rotated, loki): the store then needs a basis."""
    return method.scorer == "planes" and method.basis == "rotated"


class ReferenceSessions:
    """The NumPy reference: a growing :class:`HeadIndex` and exact values per (layer, session, KV head).

    Args:
        shape: sizes (``max_tokens`` unused: the reference grows).
        method, selection, scale: the decode step (``scale``: the model's softmax scale).
        calibration: per (layer, KV head) stats over the ``shape.layers`` layers; needed by rotated-store
            methods (their basis), double-sparsity (its channels) and ``variance="calibration"``.
    """

    def __init__(self, shape: SessionShape, method: Method, selection: Selection, scale: float,
                 calibration: Calibration | None = None):
        if scans_rotated(method) and calibration is None:
            raise ValueError(f"method {method.name!r} scans the rotated store: a calibration (its basis) is needed")
        self.shape, self.method, self.selection, self.scale = shape, method, selection, scale
        d = shape.head_dim

        def head_index(layer: int, head: int) -> HeadIndex:
            if calibration is None:  # HeadStats.layer still names the layer (per-layer plans read it)
                stats = {b: HeadStats(np.ones(d), np.arange(d), layer=layer) for b in ("raw", "rotated")}
            else:
                stats = {b: calibration.head_stats(layer, head, b) for b in ("raw", "rotated")}
            basis = calibration.basis[layer, head] if scans_rotated(method) else None
            return HeadIndex(d, stats, basis)

        self.indexes = [[[head_index(layer, h) for h in range(shape.kv_heads)] for _ in range(shape.sessions)]
                        for layer in range(shape.layers)]
        self.values: list[list[list[GrowingRows]]] | None = None  # made on the first append (the value width)

    def lengths(self, layer: int) -> np.ndarray:
        """Tokens held by each session of ``layer``, int64 ``[S]``."""
        return np.array([len(heads[0].keys) for heads in self.indexes[layer]], np.int64)

    def append(self, layer: int, session: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``m`` tokens to one session: ``k [H, m, d]``, ``v [H, m, dv]`` (kept as float32)."""
        if self.values is None:
            self.values = [[[GrowingRows(v.shape[-1]) for _ in range(self.shape.kv_heads)]
                            for _ in range(self.shape.sessions)] for _ in range(self.shape.layers)]
        k, v = _numpy(k), _numpy(v)
        for h in range(self.shape.kv_heads):
            self.indexes[layer][session][h].append(k[h])
            self.values[layer][session][h].append(v[h])

    def step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append ``k, v [S, H, d]`` to every session, then decode ``q [S, H·G, d]`` -> float32 ``[S, H·G, dv]``."""
        G = self.shape.group
        for s in range(self.shape.sessions):
            self.append(layer, s, k[s, :, None], v[s, :, None])
        queries = _numpy(q)
        out = np.zeros(queries.shape[:2] + (v.shape[-1],), np.float32)
        for s in range(self.shape.sessions):
            for h in range(self.shape.kv_heads):
                index = self.indexes[layer][s][h]
                step = decode_step(queries[s, h * G:(h + 1) * G], index.keys, self.values[layer][s][h].array, index,
                                   self.method, self.selection, self.scale, layer)
                out[s, h * G:(h + 1) * G] = step.output
        return torch.from_numpy(out).to(q.device)

    def close(self) -> None:
        """Nothing to release (host memory is garbage collected)."""


class OffloadedSessions:
    """The GPU path: :class:`fathom.host.cache.OffloadedCache` and :class:`fathom.host.decoder.Decoder`, each
    layer's step (with the append of its token) captured once as a :class:`fathom.host.graph.StepGraph`.

    Arguments as :class:`ReferenceSessions`; ``shape.max_tokens`` is required (pinned memory is reserved up front).
    A step's output is the graph's buffer, valid until the layer's next step. Call :meth:`close` to release the
    pinned memory.
    """

    def __init__(self, shape: SessionShape, method: Method, selection: Selection, scale: float,
                 calibration: Calibration | None = None):
        from fathom.host.cache import CacheShape, OffloadedCache
        from fathom.host.decoder import Decoder, DecoderSettings

        if shape.max_tokens is None:
            raise ValueError("shape.max_tokens is needed: the offloaded cache reserves its memory up front")
        rotated = scans_rotated(method)
        if rotated and calibration is None:
            raise ValueError(f"method {method.name!r} scans the rotated store: a calibration (its basis) is needed")
        self.shape = shape
        cache_shape = CacheShape(sessions=shape.sessions, layers=shape.layers, kv_heads=shape.kv_heads,
                                 head_dim=shape.head_dim, max_tokens=shape.max_tokens)
        self.cache = OffloadedCache(cache_shape, basis=calibration.basis if rotated else None)
        sigma2 = ds_rank = None
        if calibration is not None:
            sigma2 = calibration.sigma2_rotated if rotated else calibration.sigma2_raw
            ds_rank = calibration.ds_rank
        self.decoder = Decoder(self.cache, DecoderSettings(method, selection, scale=scale), group=shape.group,
                               sigma2=sigma2, ds_rank=ds_rank)
        self.graphs: dict = {}  # layer -> its captured step (a StepGraph), made on the layer's first step

    def lengths(self, layer: int) -> np.ndarray:
        return self.cache.lengths(layer)

    def append(self, layer: int, session: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.append(layer, k[None], v[None], sessions=[session])

    def step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer not in self.graphs:
            from fathom.host.graph import StepGraph

            self.graphs[layer] = StepGraph(self.decoder, layers=[layer], append=True)
        return self.graphs[layer](q, k[:, :, None], v[:, :, None])

    def close(self) -> None:
        """Release the pinned host memory."""
        self.cache.close()


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A torch tensor as a C-contiguous float32 NumPy array on the host."""
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
