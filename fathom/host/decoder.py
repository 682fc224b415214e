"""The offloaded decode step of one layer, FlashInfer style: settings fixed at plan time,
``run(layer, q) -> attention output`` per step (SPEC §8).

Steps, each a public method so they can be timed one by one (``run`` calls them in order):

1. :meth:`Decoder.plan`    depths ``int8 [S·H, d]`` on the GPU (water-filling, or the method's fixed policy);
2. :meth:`Decoder.stage`   run list from the depths + zero-copy gather of the runs into HBM;
3. :meth:`Decoder.scan`    approximate scores of every query head;
4. :meth:`Decoder.select`  top-k per head (+ sink, local, tail), then :meth:`Decoder.union` of rows per KV head;
5. :meth:`Decoder.fetch`   the union's K and V rows from pinned host memory;
6. :meth:`Decoder.attend`  exact attention of each head over its own selection (torch).

No step waits for the host: all sizes are fixed by the settings and the token count.
Supported methods (``fathom.methods``): plane scorers on the raw basis — fathom
(water-filling, σ² from the store or calibration), sparq, double-sparsity,
thumbnail. Rotated stores, landmark, oracle and dense are not on the GPU path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fathom import methods
from fathom.cuda.attention import selected_attention
from fathom.cuda.gather import Staging, budget_capacity, staging_capacity
from fathom.cuda.interop import DEVICE, as_array
from fathom.cuda.plan import waterfill
from fathom.cuda.rows import gather_rows
from fathom.cuda.scan import approx_scores
from fathom.cuda.topk import select, union_rows
from fathom.host.cache import OffloadedCache
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.selection import Selection

ROWS_PER_BLOCK = 4096  # tokens per block of the row compaction


@dataclass(frozen=True)
class DecoderSettings:
    """What a decoder does: the method (with its budget), the selection protocol, the softmax scale
    (None: ``1/sqrt(d)``) and the CUDA block size of the selection/scan kernels."""

    method: methods.Method = field(default_factory=lambda: methods.fathom(48.0))
    selection: Selection = field(default_factory=lambda: Selection(k=512))
    scale: float | None = None
    threads: int = 256

    def __post_init__(self):
        m = self.method
        if m.scorer != "planes" or m.basis != "raw":
            raise ValueError(f"method {m.name!r} is not on the GPU path (plane scorers on the raw basis only)")
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must lie in 1..1024, got {self.threads}")


class Decoder:
    """Sparse decode over an :class:`OffloadedCache` for query groups of ``group`` heads per KV head.

    Args:
        cache: the offloaded cache (its sessions, layers, KV heads and head dim).
        settings: :class:`DecoderSettings`.
        group: query heads per KV head (G).
        sigma2: calibration variances ``[L, H, d]`` (needed for fathom with ``variance='calibration'``).
        ds_rank: Double Sparsity's offline channel order ``[L, H, d]`` (needed for double-sparsity).
    """

    def __init__(self, cache: OffloadedCache, settings: DecoderSettings, group: int,
                 sigma2: np.ndarray | None = None, ds_rank: np.ndarray | None = None):
        shape = cache.shape
        if not 1 <= group <= 16:
            raise ValueError(f"group must lie in 1..16 query heads per KV head, got {group}")
        self.cache, self.settings, self.group = cache, settings, group
        self.streams, d = shape.streams, shape.head_dim
        policy = settings.method.policy
        self._sigma2 = None
        self._fixed = None
        if isinstance(policy, methods.Waterfill):
            capacity = budget_capacity(policy.budget, d)
            if policy.variance == "calibration":
                self._sigma2 = self._per_stream("sigma2", sigma2, np.float64)
        elif isinstance(policy, methods.QueryTopChannels):
            capacity = staging_capacity(MAX_DEPTH * policy.r, policy.r, d)
        else:
            fixed = self._fixed_depths(policy, ds_rank)  # [L, H, d]
            capacity = staging_capacity(int(fixed.sum(-1).max()), int((fixed > 0).sum(-1).max()), d)
            self._fixed = torch.as_tensor(np.repeat(fixed[:, None], shape.sessions, 1).reshape(
                shape.layers, self.streams, d), device=DEVICE)
        self.staging = Staging(self.streams, d, shape.segments, shape.segment_blocks, *capacity,
                               copy_threads=settings.threads)
        sel = settings.selection
        self.max_rows = min(group * sel.k + sel.sink + sel.local + BLOCK - 1, shape.max_tokens)
        self.depths = torch.zeros((self.streams, d), dtype=torch.int8, device=DEVICE)
        self.scores = torch.zeros((self.streams, group, shape.max_tokens), dtype=torch.float32, device=DEVICE)
        self.top_hist = torch.zeros((self.streams, group, 256), dtype=torch.int32, device=DEVICE)
        self.cand_key = torch.zeros((self.streams, group, shape.max_tokens), dtype=torch.int32, device=DEVICE)
        self.cand_idx = torch.zeros_like(self.cand_key)
        self.cand_count = torch.zeros((self.streams, group), dtype=torch.int32, device=DEVICE)
        self.winners = torch.zeros((self.streams, shape.max_tokens), dtype=torch.int32, device=DEVICE)  # uint32 bits
        self.block_rows = torch.zeros((self.streams, math.ceil(shape.max_tokens / ROWS_PER_BLOCK)),
                                      dtype=torch.int32, device=DEVICE)
        self.row_index = torch.zeros((self.streams, self.max_rows), dtype=torch.int32, device=DEVICE)
        self.head_mask = torch.zeros((self.streams, self.max_rows), dtype=torch.int32, device=DEVICE)
        self.n_rows = torch.zeros(self.streams, dtype=torch.int32, device=DEVICE)
        self.k_rows = torch.zeros((self.streams, self.max_rows, d), dtype=torch.int16, device=DEVICE)
        self.v_rows = torch.zeros_like(self.k_rows)
        self._arrays = {name: as_array(getattr(self, name)) for name in
                        ("depths", "scores", "top_hist", "cand_idx", "cand_count", "block_rows", "row_index", "head_mask", "n_rows", "k_rows",
                         "v_rows")}
        self._arrays["winners"] = as_array(self.winners).view(np.uint32)
        self._arrays["cand_key"] = as_array(self.cand_key).view(np.uint32)

    def _per_stream(self, name: str, x: np.ndarray | None, dtype) -> torch.Tensor:
        s = self.cache.shape
        if x is None or np.shape(x) != (s.layers, s.kv_heads, s.head_dim):
            raise ValueError(f"{name} must have shape {(s.layers, s.kv_heads, s.head_dim)} for this method")
        per_stream = np.repeat(np.asarray(x, dtype)[:, None], s.sessions, 1).reshape(s.layers, self.streams, -1)
        return torch.as_tensor(per_stream, device=DEVICE)

    def _fixed_depths(self, policy, ds_rank: np.ndarray | None) -> np.ndarray:
        """Depths ``int8 [L, H, d]`` of a query-independent policy (double-sparsity, thumbnail)."""
        s = self.cache.shape
        shape = (s.layers, s.kv_heads, s.head_dim)
        if isinstance(policy, methods.FixedChannels) and (ds_rank is None or np.shape(ds_rank) != shape):
            raise ValueError(f"ds_rank must have shape {shape} for double-sparsity")
        ranks = np.broadcast_to(np.arange(s.head_dim), shape) if ds_rank is None else np.asarray(ds_rank)
        no_query = np.zeros((self.group, s.head_dim), np.float32)
        return np.array([[policy.depths(no_query, methods.HeadStats(np.ones(s.head_dim), ranks[layer, h]))
                          for h in range(s.kv_heads)] for layer in range(s.layers)], np.int8)

    # -- the step -------------------------------------------------------------------------------------------

    def check(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Validate a step's input before any kernel runs; ``q [S, H·G, d]`` -> float32 ``[S·H, G, d]``."""
        s = self.cache.shape
        if not 0 <= layer < s.layers:
            raise ValueError(f"layer must lie in 0..{s.layers - 1}, got {layer}")
        if not isinstance(q, torch.Tensor) or q.device.type != DEVICE.type:
            raise ValueError(f"q must be a torch tensor on {DEVICE.type}")
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"q must be float32, bf16 or fp16, got {q.dtype}")
        if tuple(q.shape) != (s.sessions, s.kv_heads * self.group, s.head_dim):
            raise ValueError(f"q must have shape {(s.sessions, s.kv_heads * self.group, s.head_dim)}, "
                             f"got {tuple(q.shape)}")
        n = self.cache.n_tokens(layer)
        if self.settings.selection.k > n:
            raise ValueError(f"k = {self.settings.selection.k} exceeds the context of {n} tokens")
        return q.reshape(self.streams, self.group, s.head_dim).float().contiguous()

    def plan(self, layer: int, q: torch.Tensor) -> None:
        policy = self.settings.method.policy
        if isinstance(policy, methods.Waterfill):
            sigma2 = self.cache.store_variance(layer) if self._sigma2 is None else self._sigma2[layer]
            waterfill(as_array(q), as_array(sigma2.contiguous()), policy.budget, self._arrays["depths"])
        elif isinstance(policy, methods.QueryTopChannels):
            order = torch.sort(q.abs().sum(dim=1), dim=1, descending=True, stable=True).indices[:, :policy.r]
            self.depths.zero_().scatter_(1, order, MAX_DEPTH)
        else:
            self.depths.copy_(self._fixed[layer])

    def stage(self, layer: int) -> None:
        store = self.cache.layer(layer)
        self.staging.stage(self._arrays["depths"], store.planes_dev.reshape(store.planes_dev.size),
                           store.scales_dev.reshape(store.scales_dev.size), store.n_blocks)

    def scan(self, layer: int, q: torch.Tensor) -> None:
        st = self.staging
        approx_scores(as_array(q), self._arrays["depths"], st.active, st.n_active, st.plane_row, st.scale_row,
                      st.planes, st.scales, st.max_planes, st.max_channels, self.cache.layer(layer).n_blocks,
                      self._arrays["scores"], self.settings.threads)

    def select(self, layer: int) -> None:
        store, sel, a = self.cache.layer(layer), self.settings.selection, self._arrays
        select(a["scores"], store.n_blocks * BLOCK, store.n_tokens, sel.k, sel.sink, sel.local, a["top_hist"],
               a["cand_key"], a["cand_idx"], a["cand_count"], a["winners"], self.settings.threads,
               select_threads=min(4 * self.settings.threads, 1024))

    def union(self, layer: int) -> None:
        store, sel, a = self.cache.layer(layer), self.settings.selection, self._arrays
        union_rows(a["winners"], self.group, store.n_blocks * BLOCK, store.n_tokens, sel.sink, sel.local,
                   a["block_rows"], a["row_index"], a["head_mask"], a["n_rows"], self.settings.threads,
                   ROWS_PER_BLOCK)

    def selected(self, n: int) -> np.ndarray:
        """The last step's selection over a context of ``n`` tokens as bool ``[S·H, G, n]`` (a host copy)."""
        mask = np.zeros((self.streams, self.group, n), bool)
        rows, heads, counts = self.row_index.cpu().numpy(), self.head_mask.cpu().numpy(), self.n_rows.cpu().numpy()
        for g in range(self.streams):
            bits = (heads[g, :counts[g], None] >> np.arange(self.group)) & 1
            mask[g][:, rows[g, :counts[g]]] = bits.T.astype(bool)
        return mask

    def fetch(self, layer: int) -> None:
        store, a = self.cache.layer(layer), self._arrays
        gather_rows(a["row_index"], a["n_rows"], store.keys_dev, store.values_dev, a["k_rows"], a["v_rows"],
                    self.settings.threads)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        s = self.cache.shape
        scale = self.settings.scale if self.settings.scale is not None else 1.0 / math.sqrt(s.head_dim)
        out = selected_attention(q, self.k_rows.view(torch.bfloat16), self.v_rows.view(torch.bfloat16),
                                 self.head_mask, self.n_rows, scale)
        return out.reshape(s.sessions, s.kv_heads * self.group, s.head_dim)

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """One decode step of ``layer``: ``q [S, H·G, d]`` -> float32 attention output ``[S, H·G, d]``."""
        q = self.check(layer, q)
        self.plan(layer, q)
        self.stage(layer)
        self.scan(layer, q)
        self.select(layer)
        self.union(layer)
        self.fetch(layer)
        return self.attend(q)
