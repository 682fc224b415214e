"""The offloaded decode step of one layer, FlashInfer style: settings fixed at construction, ``run(layer, q)`` per
step (design §8).

The method is resolved once (``fathom.host.strategy``) and every layer's step is built once, at construction, as a
list of launches whose arguments never change: static buffers, and sizes that vary from step to step (each
session's context, sealed blocks, rows kept) read from device memory by the kernels, which launch at grids fixed
by the cache's capacity and exit early where there is nothing to do. So a step needs no host synchronisation and
no allocation, every launch goes to the caller's current torch stream, and the same list is what a CUDA graph
captures (``fathom.host.graph``). The stages, in order (each can be timed: :meth:`Decoder.run`'s ``on_stage``):

=============  ===================================================================================================
``plan``       the query in the store's basis (rotated store) and the read depths: water-filling, SparQ's top
               channels, or the method's fixed depths
``scan``       scores of every sealed token straight from the store (planes, K rows or landmarks), with the
               top-byte histogram of the candidates
``select``     each head's top-k (+ sink, local, tail) — reads the scores once
``union``      the ascending row list of each KV head, with each row's head mask
``slots``      with the cache's row cache (``CacheShape.row_cache_rows``): each listed row's source, its slot
               (a hit) or host memory (``fathom.cuda.row_cache``); no launch without one
``attention``  exact attention of each head over its own selection, each listed row (dense: every row) read from
               its source: the row cache's slab on a hit, pinned host memory otherwise (a fill also writes the
               slab)
=============  ===================================================================================================

Every method of ``fathom.methods`` runs: plane scorers (fathom with a flat budget or a per-layer plan, σ² from the
store or from calibration; fathom-rotated and loki on a cache made with a basis; fathom-mixed on a cache whose
basis is the identity on the heads that chose raw channels, each stream's σ² from its head's basis' default; sparq,
double-sparsity, thumbnail), landmark, oracle and dense.

Example::

    decoder = Decoder(cache, DecoderSettings(methods.fathom(48), Selection(k=512)), group_size=4)
    out = decoder.run(layer, q)   # q [S, H·G, d] -> float32 [S, H·G, d], each session at its own length
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fathom import _checks, methods
from fathom.bits import row_bytes, tier_scan_bits
from fathom.cuda.attention import CHUNK_ROWS, plan_attention
from fathom.cuda.block import RADIX
from fathom.cuda.interop import DEVICE, SIMULATED, as_array, multiprocessors
from fathom.cuda.row_cache import assign_slots, parts_pay, scratch_shapes
from fathom.cuda.score_keys import HALVES, key_columns
from fathom.cuda.scan import MAX_HEADS as MAX_GROUP_SIZE  # query heads a scan CTA accumulates
from fathom.cuda.scan import SCAN_WARPS, WIDEST_WARPS
from fathom.cuda.topk import TIES_PER_HEAD, list_ctas_for, pass_tokens_for, select, union_blocks, union_rows
from fathom.decode import step_bits
from fathom.host.cache import FLOAT_DTYPES, STATE, HostKVCache
from fathom.host.launch import Launch, run_launches
from fathom.host.strategy import PlaneScan, StepBuffers, resolve
from fathom.quantize import BLOCK
from fathom.selection import Selection

STAGES = ("plan", "scan", "select", "union", "slots", "attention")  # a step's stages in order (run's on_stage)
# Launch sizes: the simulator runs every thread as a Python thread, so its defaults are the smallest that work.
DEFAULT_SCAN_WARPS = 1 if SIMULATED else SCAN_WARPS
DEFAULT_THREADS = 32 if SIMULATED else 256
# The ties kernel: one CTA per (query head, stream). When it walked a head's whole candidate list, 1,024 threads took
# 531 µs of a 128k token and 2.1 ms of a 16-session one, 256 threads 1,010 µs and 3.0 ms (whole tokens on an H100,
# 2026-12-06): the bench's layer-0 heads put up to ~10^5 candidates in it (``python -m bench.select_probe
# --census``). The list passes now walk the lists with many CTAs a head and the kernel breaks only the ties by index
# (``fathom.cuda.topk``); its thread count is not yet re-timed.
DEFAULT_TIES_THREADS = 32 if SIMULATED else 1024


@dataclass(frozen=True)
class DecoderSettings:
    """What a decoder does: the method (with its budget), the selection protocol, the softmax scale (None:
    ``1/sqrt(d)``), and launch sizes: ``scan_warps`` warps per CTA of the plane scan (at most 32; compiled for as
    many CTAs an SM as make 32 warps: ``fathom.cuda.scan.resident_ctas``), ``threads`` per
    CTA of the selection's passes over the scores and of the row compaction, ``ties_threads`` per CTA of the
    selection's ties kernel (one CTA per query head and stream)."""

    method: methods.Method = field(default_factory=lambda: methods.fathom(48.0))
    selection: Selection = field(default_factory=lambda: Selection(k=512))
    scale: float | None = None
    scan_warps: int = DEFAULT_SCAN_WARPS
    threads: int = DEFAULT_THREADS
    ties_threads: int = DEFAULT_TIES_THREADS

    def __post_init__(self):
        if not isinstance(self.method, methods.Method):
            raise ValueError(f"method must be a fathom.methods.Method, got {type(self.method).__name__}")
        if self.method.predicts:
            raise ValueError(f"method {self.method.name!r} scores through fathom.prediction, which the offloaded step "
                             "does not run (the reference backend and the fidelity bench do)")
        if not isinstance(self.selection, Selection):
            raise ValueError(f"selection must be a fathom.selection.Selection, got {type(self.selection).__name__}")
        if self.scale is not None and not (_checks.is_real(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0 (or None), got {self.scale!r}")
        if not _checks.is_integer(self.scan_warps) or not 1 <= self.scan_warps <= WIDEST_WARPS:
            raise ValueError(f"scan_warps must be an integer in 1..{WIDEST_WARPS}, got {self.scan_warps!r}")
        if not _checks.is_integer(self.threads) or not 32 <= self.threads <= 1024 or self.threads % 32:
            raise ValueError(f"threads must be a multiple of 32 in 32..1024 (the selection votes across whole warps), "
                             f"got {self.threads!r}")
        if not _checks.is_integer(self.ties_threads) or not 32 <= self.ties_threads <= 1024:
            raise ValueError(f"ties_threads must be an integer in 32..1024, got {self.ties_threads!r}")


class Decoder:
    """Sparse decode over a :class:`HostKVCache` for query groups of ``group_size`` heads per KV head.

    Args:
        cache: the offloaded cache (its sessions, layers, KV heads, head dim and stores).
        settings: :class:`DecoderSettings`.
        group_size: query heads per KV head (G), 1..8.
        sigma2: calibration variances ``[L, H, d]`` in the store's basis (fathom with ``variance='calibration'``).
        ds_rank: Double Sparsity's offline channel order ``[L, H, d]`` (double-sparsity).
        gains: the calibrated relative plane gains ``[L, H, d, 4]`` of each (layer, KV head), in the basis its store
            holds, for the σ² source the method reads (fathom with ``gains='calibrated'``;
            ``fathom.methods.gain_table`` of the head's stats, as the reference planner uses them).
        levels: the reconstruction tables ``[L, H, d, 4, 16]`` (float32, units of Δ: ``fathom.quantize.dequantize``'s)
            every (layer, KV head)'s planes are scanned through, in the basis its store holds (the calibrated cell
            means, ``Calibration.levels_raw`` / ``levels_rotated``); None (default): the cells' midpoints. A plane
            scan's only; the kernel is chosen here, so :meth:`set_calibration` replaces tables, never adds them.
    """

    def __init__(self, cache: HostKVCache, settings: DecoderSettings, group_size: int,
                 sigma2: np.ndarray | None = None, ds_rank: np.ndarray | None = None,
                 gains: np.ndarray | None = None, levels: np.ndarray | None = None):
        if not isinstance(cache, HostKVCache):
            raise ValueError(f"cache must be a HostKVCache, got {type(cache).__name__}")
        cache.check()
        if not (_checks.is_integer(group_size) and 1 <= group_size <= MAX_GROUP_SIZE):
            raise ValueError(f"group_size must be an integer in 1..{MAX_GROUP_SIZE} query heads per KV head, got "
                             f"{group_size!r}")
        if not isinstance(settings, DecoderSettings):
            raise ValueError(f"settings must be DecoderSettings, got {type(settings).__name__}")
        self.cache, self.settings, self.group_size = cache, settings, int(group_size)
        s, method, sel = cache.shape, settings.method, settings.selection
        self.strategy = resolve(method, cache, self.group_size, sigma2, ds_rank, settings.scan_warps, gains, levels)
        self.dense = self.strategy is None
        self.scale = settings.scale if settings.scale is not None else 1.0 / math.sqrt(s.head_dim)
        streams, d, tokens = s.streams, s.head_dim, s.max_tokens
        sparse_rows = min(self.group_size * sel.k + sel.sink + sel.local + BLOCK - 1, tokens)
        self.max_rows = tokens if self.dense else sparse_rows
        zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=DEVICE)  # noqa: E731
        self.q_in = zeros((s.layers, s.sessions, s.kv_heads * self.group_size, d), torch.float32)
        self.out = zeros((s.layers, s.sessions, s.kv_heads * self.group_size, d), torch.float32)
        self.q_store = zeros((streams, self.group_size, d), torch.float32)
        self.depths = zeros((streams, d), torch.int8)
        scored = tokens if not self.dense else 1
        self.score_keys = zeros((streams, self.group_size, HALVES, key_columns(scored)), torch.int32)
        self.top_hist = zeros((streams, self.group_size, RADIX), torch.int32)
        self.hists = zeros((streams, self.group_size, 3, RADIX), torch.int32)
        self.cand_key = zeros((streams, self.group_size, scored), torch.int32)
        self.cand_idx = zeros((streams, self.group_size, scored), torch.int32)
        self.list_sizes = zeros((streams, self.group_size, 2), torch.int32)
        self.ties = zeros((streams, self.group_size, min(TIES_PER_HEAD, scored)), torch.int32)
        self.winners = zeros((streams, tokens), torch.int32)
        self.any_rows = zeros((streams, -(-tokens // 64)), torch.int64)
        self.block_rows = zeros((streams, union_blocks(tokens, settings.threads)), torch.int32)
        self.row_index = zeros((streams, self.max_rows), torch.int32)
        self.head_mask = zeros((streams, self.max_rows), torch.int32)
        self.n_rows = zeros(streams, torch.int32)
        self.row_cached = bool(s.row_cache_rows) and not self.dense  # dense reads every row: nothing to cache
        cached_rows = self.max_rows if self.row_cached else 0
        self.row_source = zeros((streams, cached_rows), torch.int32)  # each row's slot (hit / fill) or -1
        self.miss_rows = zeros((streams, cached_rows), torch.int32)
        sm_count = multiprocessors()
        self.list_ctas = list_ctas_for(streams, self.group_size, sm_count)
        self.pass_tokens = pass_tokens_for(streams, self.group_size, tokens, sm_count)
        # the slot assignment in parts where a layer's streams leave most multiprocessors idle (on a GPU; the
        # simulator's one runs a CTA a stream); its scratch (age histogram, victims a part, threshold age) is shared
        # by the layers' steps
        self.slot_scratch = [zeros(shape, getattr(torch, np.dtype(dtype).name))
                             for shape, dtype in scratch_shapes(streams, s.row_cache_rows).values()] \
            if self.row_cached and parts_pay(streams, sm_count) else None
        chunks = -(-self.max_rows // CHUNK_ROWS)  # dense: max_rows is the cache's tokens, every row a stream's
        self.part_m = zeros((streams, chunks, self.group_size), torch.float32)
        self.part_l = zeros((streams, chunks, self.group_size), torch.float32)
        self.part_o = zeros((streams, chunks, self.group_size, d), torch.float32)
        # built at a layer's first step: building reads the layer's pinned memory, which may still be allocating
        self._steps: list[list[tuple[str, list[Launch]]] | None] = [None] * s.layers
        self._warm_up()

    # -- the step -------------------------------------------------------------------------------------------

    def run(self, layer: int, q: torch.Tensor, on_stage: Callable[[str, Callable[[], None]], None] | None = None
            ) -> torch.Tensor:
        """One decode step of ``layer``: ``q [S, H·G, d]`` (float32 / bf16 / fp16, on the GPU) -> float32 attention
        output ``[S, H·G, d]``. The output is the decoder's buffer for the layer, overwritten by its next step.
        ``on_stage(name, enqueue)``, if given, is called per stage and must call ``enqueue()`` once (e.g. between
        two CUDA events, to time the stages)."""
        self.check(layer, q)
        self.q_in[layer].copy_(q)
        stream = self.cache.stream()
        if on_stage is None:
            run_launches(self.launches(layer), stream)
            return self.out[layer]
        for name, launches in self._stages(layer):
            on_stage(name, lambda launches=launches: run_launches(launches, stream))
        return self.out[layer]

    def launches(self, layer: int) -> list[Launch]:
        """Every launch of ``layer``'s step, in order; the step reads its query from ``q_in[layer]`` and writes
        ``out[layer]``."""
        return [launch for _, stage in self._stages(layer) for launch in stage]

    def _stages(self, layer: int) -> list[tuple[str, list[Launch]]]:
        if self._steps[layer] is None:
            self._steps[layer] = self._build(layer)
        return self._steps[layer]

    def launches_on(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> list[Launch]:
        """The launches of ``layer``'s step built to read its query from ``q`` and write its output to ``out``
        (float32 ``[S, H·G, d]`` on the GPU, contiguous) instead of the decoder's buffers: what a captured token
        replays, with no copy in or out. The step's scratch is the decoder's, as every step's."""
        shape = (self.cache.shape.sessions, self.cache.shape.kv_heads * self.group_size, self.cache.shape.head_dim)
        for name, x in (("q", q), ("out", out)):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != shape \
                    or x.device.type != DEVICE.type or not x.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 tensor on {DEVICE.type} of shape {shape}")
        return [launch for _, stage in self._build(layer, q, out) for launch in stage]

    def set_calibration(self, layer: int, sigma2: np.ndarray | None = None, ds_rank: np.ndarray | None = None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None,
                        levels: np.ndarray | None = None) -> None:
        """Replace ``layer``'s calibration (``sigma2``, ``ds_rank`` ``[H, d]``, the per-head store's ``head_basis
        [H]``, the plane ``gains [H, d, 4]``, where the method reads them; the reconstruction tables ``levels [H, d,
        4, 16]`` of a decoder made with tables, refused by one that reads midpoints) in the tensors the step reads,
        so steps already captured in a CUDA graph read the new values."""
        self.cache.check(layer)
        if levels is not None and not isinstance(self.strategy, PlaneScan):
            raise ValueError(f"levels are read by plane scans only; {self.settings.method.name!r} reads no bit "
                             "planes")
        if self.strategy is not None:
            self.strategy.set_calibration(layer, sigma2, ds_rank, head_basis, gains, levels)

    def check(self, layer: int, q: torch.Tensor | None = None) -> None:
        """Validate a step's input before any kernel runs (no sync): the cache open, no error flagged since the
        last call, ``q`` on the device with shape ``[S, H·G, d]``, every session holding tokens."""
        self.cache.check(layer)
        s = self.cache.shape
        if q is not None:
            if not isinstance(q, torch.Tensor) or q.device.type != DEVICE.type:
                raise ValueError(f"q must be a torch tensor on {DEVICE.type}")
            if q.dtype not in FLOAT_DTYPES:
                raise ValueError(f"q must be float32, bf16 or fp16, got {q.dtype}")
            if tuple(q.shape) != (s.sessions, s.kv_heads * self.group_size, s.head_dim):
                raise ValueError(f"q must have shape {(s.sessions, s.kv_heads * self.group_size, s.head_dim)}, "
                                 f"got {tuple(q.shape)}")
        empty = np.flatnonzero(self.cache.lengths(layer) == 0)
        if len(empty):
            raise ValueError(f"session {int(empty[0])} of layer {layer} holds no tokens: nothing to attend to")

    def _build(self, layer: int, q_in: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> list[tuple[str, list[Launch]]]:
        """The stages of ``layer``'s step, reading ``q_in`` and writing ``out`` (default: the decoder's buffers)."""
        s, sel = self.cache.shape, self.settings.selection
        cache_layer = self.cache.layers[layer]
        heads, lengths, status = s.kv_heads, cache_layer.arrays["lengths"], self.cache.status_flags(layer)
        q = (self.q_in[layer] if q_in is None else q_in).view(s.streams, self.group_size, s.head_dim)
        out = as_array((self.out[layer] if out is None else out).view(s.streams, self.group_size, s.head_dim))
        a = {name: as_array(getattr(self, name)) for name in
             ("top_hist", "hists", "cand_idx", "list_sizes", "ties", "block_rows", "row_index", "head_mask", "n_rows",
              "part_m", "part_l", "part_o")}
        winners = as_array(self.winners).view(np.uint32)
        any_rows = as_array(self.any_rows).view(np.uint64)
        keys = as_array(self.score_keys).view(np.uint32)
        cand_key = as_array(self.cand_key).view(np.uint32)
        threads, dense, scale, k = self.settings.threads, self.dense, self.scale, sel.k
        steps: list[tuple[str, list[Launch]]] = []
        if not dense:
            buf = StepBuffers(q, self.q_store, self.depths, self.score_keys, self.top_hist)
            steps += [("plan", self.strategy.plan(layer, buf)), ("scan", self.strategy.scan(layer, buf, sel)),
                      ("select", [lambda stream: select(keys, lengths, heads, k, sel.sink, sel.local,
                                                        a["top_hist"], a["hists"], cand_key, a["cand_idx"],
                                                        a["list_sizes"], a["ties"], winners, any_rows, threads,
                                                        select_threads=self.settings.ties_threads,
                                                        per_block=self.pass_tokens, list_ctas=self.list_ctas,
                                                        stream=stream)]),
                      ("union", [lambda stream: union_rows(any_rows, winners, lengths, heads, a["block_rows"],
                                                           a["row_index"], a["head_mask"], a["n_rows"], threads,
                                                           stream)])]
        q_arr = as_array(q)
        kv = cache_layer.arrays["kv"]
        slab = source = None
        if self.row_cached:
            rows, source, miss_rows = cache_layer.rows.arrays, as_array(self.row_source), as_array(self.miss_rows)
            slab = rows["slab"]
            scratch = None if self.slot_scratch is None else [as_array(x) for x in self.slot_scratch]
            assign_threads = min(1024, 4 * threads)
            steps.append(("slots", [lambda stream: assign_slots(a["row_index"], a["n_rows"], rows["slot_of"],
                                                                rows["position"], rows["stamp"], rows["clock"],
                                                                rows["counters"], miss_rows, source, assign_threads,
                                                                stream, scratch)]))
        attend = plan_attention(q_arr, a["row_index"], a["head_mask"], a["n_rows"], lengths, heads, dense, kv, scale,
                                status, a["part_m"], a["part_l"], a["part_o"], out, source, slab)
        steps.append(("attention", [attend.run]))
        return steps

    def _warm_up(self) -> None:
        """Compile every kernel of the step now (the first launch of a Numba kernel compiles it), not in the first
        decode step or inside a CUDA graph capture: run layer 0's launches once (on an empty cache they exit
        early; on a filled one they compute an output nobody reads, and its row cache is left as it was). The
        simulator compiles nothing."""
        if SIMULATED:
            return
        with self._row_cache_kept(0):
            run_launches(self.launches(0), self.cache.stream())
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def _row_cache_kept(self, layer: int):
        """Inside, steps of ``layer`` leave its row cache (slab, bookkeeping, counters) as it was: a step assigns
        slots, stamps them and counts its hits, so a warm-up step on a filled cache would evict rows for a query
        nobody asked. On an empty layer a step lists no row and only advances the clock and the counters: those two
        are copied then, not the slab and the slot maps (a new cache's warm-up copies no large array)."""
        rows = self.cache.layer(layer).rows if self.row_cached else None
        names = STATE if self.cache.lengths(layer).any() else ("clock", "counters")
        state = rows.state(names) if rows is not None else None
        try:
            yield
        finally:
            if state is not None:
                rows.restore(state)

    # -- what the last step read (host syncs) ---------------------------------------------------------------
    # The depths and row counts these read are the decoder's, shared by every layer: call them right after
    # ``layer``'s own step (a later step of another layer overwrites what they count).

    def scan_nbytes(self, layer: int) -> float:
        """Bytes the last step's scan read from the store (planes + scales, landmarks or K rows), by the one bit
        accounting (``fathom.decode.step_bits``): the depths actually read, else the method's bits."""
        heads = self.cache.shape.kv_heads
        sealed = np.repeat(self.cache.lengths(layer) // BLOCK * BLOCK, heads)
        planes = self.strategy is not None and self.settings.method.scans_planes
        depths = self.depths.cpu().numpy() if planes else None
        bits = np.broadcast_to(step_bits(self.settings.method, depths, self.cache.shape.head_dim), sealed.shape)
        return float((bits * sealed).sum() / 8)

    def scan_nbytes_by_tier(self, layer: int) -> tuple[float, float]:
        """:meth:`scan_nbytes` split by where the bytes were read: ``(hbm, link)``, HBM for the scales and planes
        the store's near tier holds (``CacheShape.hbm_planes``), over the link (pinned host memory) for the rest
        (``fathom.bits.tier_scan_bits``); K rows and landmarks are all pinned. ``link / (hbm + link)`` is the host
        plane fraction of a plane method."""
        if self.strategy is None or not self.settings.method.scans_planes:
            return 0.0, self.scan_nbytes(layer)
        sealed = np.repeat(self.cache.lengths(layer) // BLOCK * BLOCK, self.cache.shape.kv_heads)
        near, far = tier_scan_bits(self.depths.cpu().numpy(), self.cache.shape.layout.hbm_planes)
        return float((near * sealed).sum() / 8), float((far * sealed).sum() / 8)

    def row_nbytes(self, layer: int) -> float:
        """Bytes of K and V rows the last step fetched (from either tier)."""
        rows = np.repeat(self.cache.lengths(layer), self.cache.shape.kv_heads) if self.dense \
            else self.n_rows.cpu().numpy()
        return float(rows.sum() * row_bytes(self.cache.shape.head_dim))

    def row_nbytes_by_tier(self, layer: int) -> tuple[float, float]:
        """:meth:`row_nbytes` split by where the rows were read: ``(hbm, link)``, the row cache's hits from HBM,
        the rest over the link (all of them without a row cache)."""
        total = self.row_nbytes(layer)
        if not self.row_cached:
            return 0.0, total
        hits = float(self.cache.layer(layer).rows.counters[:, 0].sum()) * row_bytes(self.cache.shape.head_dim)
        return hits, total - hits
