"""The offloaded decode step of one layer, FlashInfer style: settings fixed at plan time,
``run(layer, q) -> attention output`` per step (SPEC §8).

Steps, each a public method so they can be timed one by one (``run`` calls them in order):

0. :meth:`Decoder.check`   validate the input, wait (on the GPU) for the layer's appends, rotate the query
   into the store's basis (``q @ R``, rotated store only);
1. :meth:`Decoder.plan`    depths ``int8 [S·H, d]`` on the GPU (water-filling, or the method's fixed policy);
2. :meth:`Decoder.stage`   run list from the depths + zero-copy gather of the runs into HBM (plane methods),
   or of every sealed landmark (landmark) or K row (oracle);
3. :meth:`Decoder.scan`    scores of every query head over the sealed tokens;
4. :meth:`Decoder.select`  top-k per head (+ sink, local, tail), then :meth:`Decoder.union` of rows per KV head;
5. :meth:`Decoder.fetch`   the union's K and V rows from pinned host memory;
6. :meth:`Decoder.attend`  exact attention of each head over its own selection (torch).

No step waits for the host: all sizes are fixed by the settings and the token count.
Every method of ``fathom.methods`` runs: plane scorers (fathom with a flat budget or a per-layer plan,
σ² from the store or calibration; fathom-rotated and loki on a cache made with a basis; sparq,
double-sparsity, thumbnail), landmark, oracle (exact scores over the sealed K rows) and dense (plan,
stage, scan and top-k skipped: the union keeps every row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fathom import methods
from fathom.bits import row_bytes
from fathom.cuda.attention import selected_attention
from fathom.cuda.exact import row_scores
from fathom.cuda.gather import Staging, budget_capacity, staging_capacity
from fathom.cuda.interop import DEVICE, as_array
from fathom.cuda.plan import THREADS as PLAN_THREADS
from fathom.cuda.plan import waterfill
from fathom.cuda.rows import gather_rows, stage_rows
from fathom.cuda.scan import approx_scores
from fathom.cuda.topk import select, union_rows
from fathom.decode import step_bits
from fathom.host.cache import OffloadedCache
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.scoring import LANDMARK_TOKENS
from fathom.selection import Selection

ROWS_PER_BLOCK = 4096  # tokens per block of the row compaction
WATERFILL = (methods.Waterfill, methods.LayerWaterfill)


@dataclass(frozen=True)
class DecoderSettings:
    """What a decoder does: the method (with its budget), the selection protocol, the softmax scale
    (None: ``1/sqrt(d)``) and the CUDA block size of the selection/scan kernels."""

    method: methods.Method = field(default_factory=lambda: methods.fathom(48.0))
    selection: Selection = field(default_factory=lambda: Selection(k=512))
    scale: float | None = None
    threads: int = 256

    def __post_init__(self):
        if not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must lie in 1..1024, got {self.threads}")


class Decoder:
    """Sparse decode over an :class:`OffloadedCache` for query groups of ``group`` heads per KV head.

    Args:
        cache: the offloaded cache (its sessions, layers, KV heads, head dim and store basis).
        settings: :class:`DecoderSettings`.
        group: query heads per KV head (G).
        sigma2: calibration variances ``[L, H, d]`` in the store's basis (needed for fathom with
            ``variance='calibration'``).
        ds_rank: Double Sparsity's offline channel order ``[L, H, d]`` (needed for double-sparsity).
    """

    def __init__(self, cache: OffloadedCache, settings: DecoderSettings, group: int,
                 sigma2: np.ndarray | None = None, ds_rank: np.ndarray | None = None):
        shape = cache.shape
        if not 1 <= group <= 16:
            raise ValueError(f"group must lie in 1..16 query heads per KV head, got {group}")
        self.cache, self.settings, self.group = cache, settings, group
        self.streams, d = shape.streams, shape.head_dim
        method = settings.method
        policy = method.policy
        held = "rotated" if cache.rotated else "raw"
        if method.scorer == "planes" and method.basis != held:
            raise ValueError(f"method {method.name!r} scans the {method.basis} store but the cache holds the "
                             f"{held} store (make the cache {'with' if method.basis == 'rotated' else 'without'} "
                             f"a basis)")
        if isinstance(policy, methods.LayerWaterfill) and len(policy.budgets) != shape.layers:
            raise ValueError(f"method {method.name!r} has {len(policy.budgets)} per-layer budgets for a cache of "
                             f"{shape.layers} layers")
        self._sigma2 = None
        self._fixed = None
        self.staging = None
        self.staged_rows = None
        if isinstance(policy, WATERFILL):
            budget = policy.budget if isinstance(policy, methods.Waterfill) else max(policy.budgets)
            capacity = budget_capacity(budget, d)
            if policy.variance == "calibration":
                self._sigma2 = self._per_stream("sigma2", sigma2, np.float64)
        elif isinstance(policy, methods.QueryTopChannels):
            capacity = staging_capacity(MAX_DEPTH * policy.r, policy.r, d)
        elif policy is not None:
            fixed = self._fixed_depths(policy, ds_rank)  # [L, H, d]
            capacity = staging_capacity(int(fixed.sum(-1).max()), int((fixed > 0).sum(-1).max()), d)
            self._fixed = torch.as_tensor(np.repeat(fixed[:, None], shape.sessions, 1).reshape(
                shape.layers, self.streams, d), device=DEVICE)
        if policy is not None:
            self.staging = Staging(self.streams, d, shape.segments, shape.segment_blocks, *capacity,
                                   copy_threads=settings.threads)
        elif method.scorer in ("landmark", "exact"):
            per_row = LANDMARK_TOKENS if method.scorer == "landmark" else 1
            self.staged_rows = torch.zeros((self.streams, shape.max_tokens // per_row, d), dtype=torch.int16,
                                           device=DEVICE)
        sel = settings.selection
        sparse_rows = min(group * sel.k + sel.sink + sel.local + BLOCK - 1, shape.max_tokens)
        self.max_rows = shape.max_tokens if method.scorer == "dense" else sparse_rows
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
                        ("depths", "scores", "top_hist", "cand_idx", "cand_count", "block_rows", "row_index",
                         "head_mask", "n_rows", "k_rows", "v_rows")}
        self._arrays["winners"] = as_array(self.winners).view(np.uint32)
        self._arrays["cand_key"] = as_array(self.cand_key).view(np.uint32)

    def _per_stream(self, name: str, x: np.ndarray | None, dtype) -> torch.Tensor:
        s = self.cache.shape
        if x is None or np.shape(x) != (s.layers, s.kv_heads, s.head_dim):
            raise ValueError(f"{name} must have shape {(s.layers, s.kv_heads, s.head_dim)} for this method")
        per_stream = np.repeat(np.asarray(x, dtype)[:, None], s.sessions, 1).reshape(s.layers, self.streams, -1)
        return torch.as_tensor(per_stream, device=DEVICE)

    def _fixed_depths(self, policy, ds_rank: np.ndarray | None) -> np.ndarray:
        """Depths ``int8 [L, H, d]`` of a query-independent policy (double-sparsity, loki, thumbnail)."""
        s = self.cache.shape
        shape = (s.layers, s.kv_heads, s.head_dim)
        ranked = isinstance(policy, methods.FixedChannels) and policy.ranking == "double-sparsity"
        if ranked and (ds_rank is None or np.shape(ds_rank) != shape):
            raise ValueError(f"ds_rank must have shape {shape} for double-sparsity")
        ranks = np.asarray(ds_rank) if ranked else np.broadcast_to(np.arange(s.head_dim), shape)
        no_query = np.zeros((self.group, s.head_dim), np.float32)
        return np.array([[policy.depths(no_query, methods.HeadStats(np.ones(s.head_dim), ranks[layer, h]))
                          for h in range(s.kv_heads)] for layer in range(s.layers)], np.int8)

    # -- the step -------------------------------------------------------------------------------------------

    def check(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Validate a step's input before any kernel runs, and order the step after the layer's appends (on the
        GPU); ``q [S, H·G, d]`` -> float32 ``[S·H, G, d]`` (raw basis)."""
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
        self.cache.wait(layer)
        return q.reshape(self.streams, self.group, s.head_dim).float().contiguous()

    def plan(self, layer: int, q: torch.Tensor) -> None:
        """The query in the store's basis (``self.q_store``) and the depths of a plane method."""
        policy = self.settings.method.policy
        basis = self.cache.layer(layer).basis
        self.q_store = q if basis is None or policy is None else torch.bmm(q, basis)
        if isinstance(policy, WATERFILL):
            budget = policy.budget if isinstance(policy, methods.Waterfill) else policy.budgets[layer]
            sigma2 = self.cache.store_variance(layer) if self._sigma2 is None else self._sigma2[layer]
            waterfill(as_array(self.q_store), as_array(sigma2.contiguous()), budget, self._arrays["depths"],
                      min(self.settings.threads, PLAN_THREADS, self.cache.shape.head_dim))
        elif isinstance(policy, methods.QueryTopChannels):
            order = torch.sort(self.q_store.abs().sum(dim=1), dim=1, descending=True, stable=True).indices
            self.depths.zero_().scatter_(1, order[:, :policy.r], MAX_DEPTH)
        elif policy is not None:
            self.depths.copy_(self._fixed[layer])

    def stage(self, layer: int) -> None:
        """What the scan reads, into HBM: the active runs (planes), every sealed landmark, or every sealed K row."""
        store, scorer = self.cache.layer(layer), self.settings.method.scorer
        if self.staging is not None:
            self.staging.stage(self._arrays["depths"], store.planes_dev.reshape(store.planes_dev.size),
                               store.scales_dev.reshape(store.scales_dev.size), store.n_blocks)
        elif scorer == "landmark":
            stage_rows(store.marks_dev, as_array(self.staged_rows), store.n_blocks * BLOCK // LANDMARK_TOKENS,
                       self.settings.threads)
        elif scorer == "exact":
            stage_rows(store.keys_dev, as_array(self.staged_rows), store.n_blocks * BLOCK, self.settings.threads)

    def scan(self, layer: int, q: torch.Tensor) -> None:
        """Scores ``self.scores [S·H, G, n_sealed]`` of the sealed tokens (after :meth:`plan` and :meth:`stage`)."""
        n_blocks, scorer = self.cache.layer(layer).n_blocks, self.settings.method.scorer
        if self.staging is not None:
            st = self.staging
            approx_scores(as_array(self.q_store), self._arrays["depths"], st.active, st.n_active, st.plane_row,
                          st.scale_row, st.planes, st.scales, st.max_planes, st.max_channels, n_blocks,
                          self._arrays["scores"], self.settings.threads)
        elif scorer == "landmark":
            row_scores(q, self.staged_rows, n_blocks * BLOCK // LANDMARK_TOKENS, torch.float16, LANDMARK_TOKENS,
                       self.scores)
        elif scorer == "exact":
            row_scores(q, self.staged_rows, n_blocks * BLOCK, torch.bfloat16, 1, self.scores)

    def select(self, layer: int) -> None:
        store, sel, a = self.cache.layer(layer), self.settings.selection, self._arrays
        if self.settings.method.scorer == "dense":
            return
        select(a["scores"], store.n_blocks * BLOCK, store.n_tokens, sel.k, sel.sink, sel.local, a["top_hist"],
               a["cand_key"], a["cand_idx"], a["cand_count"], a["winners"], self.settings.threads,
               select_threads=min(4 * self.settings.threads, 1024))

    def union(self, layer: int) -> None:
        store, sel, a = self.cache.layer(layer), self.settings.selection, self._arrays
        scored = 0 if self.settings.method.scorer == "dense" else store.n_blocks * BLOCK  # dense: all rows kept
        union_rows(a["winners"], self.group, scored, store.n_tokens, sel.sink, sel.local,
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

    def scan_nbytes(self, layer: int) -> float:
        """Bytes the last step's scan read from the store (planes + scales, landmarks or K rows): a host sync.

        By the one bit accounting (``fathom.decode.step_bits``): the depths actually read, else the method's bits.
        """
        tokens = self.cache.layer(layer).n_blocks * BLOCK
        depths = self.depths.cpu().numpy() if self.staging is not None else None
        bits = np.broadcast_to(step_bits(self.settings.method, depths, self.cache.shape.head_dim), (self.streams,))
        return float(bits.sum() * tokens / 8)

    def row_nbytes(self) -> float:
        """Bytes of K and V rows the last step fetched: a host sync."""
        return float(self.n_rows.cpu().numpy().sum() * row_bytes(self.cache.shape.head_dim))

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
