"""A method resolved, once, into what the GPU does to score the sealed tokens (design §7, §8 steps 1-3).

``fathom.methods`` says *what* a method reads (a basis and a depth policy, or its own scorer); this module turns
that into device work exactly once, when a decoder is made, so the step itself never dispatches on the method:

=================  ============================================================================================
``PlaneScan``      a depth plan on the GPU, then the one plane scan (``fathom.cuda.scan``) over the raw or
                   rotated store; the depth plan is the policy's entry of :data:`DEPTH_PLANS`:
                   ``WaterfillDepths``, ``TopChannelDepths`` (SparQ) or ``FixedDepths``
``RowScan``        exact scores over the bf16 K rows (oracle) or block scores over the fp16 landmarks (landmark)
(none)             dense: no scan, every row is attended
=================  ============================================================================================

Which one a method gets is read from :data:`SCANS` by its scorer. Each exposes ``plan(layer)`` and
``scan(layer)``: lists of launches ``fn(stream)`` with every argument fixed, which the decoder runs eagerly or
captures into a CUDA graph, and ``set_calibration`` (a no-op where nothing calibrated is read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fathom import _checks, methods
from fathom.cuda.exact import scan_rows
from fathom.cuda.interop import DEVICE, as_array
from fathom.cuda.plan import THREADS as PLAN_THREADS
from fathom.cuda.plan import top_channels, waterfill
from fathom.cuda.scan import scan_levels, scan_planes
from fathom.host.launch import Launch
from fathom.quantize import CELLS, MAX_DEPTH
from fathom.scoring import LANDMARK_TOKENS
from fathom.waterfill import check_gain_values

GAIN_TAIL = (MAX_DEPTH,)  # a gain table's trailing dimension: one relative gain a plane


@dataclass(frozen=True)
class StepBuffers:
    """What a strategy reads and writes in one layer's step (torch tensors owned by the decoder)."""

    q: torch.Tensor  # float32 [streams, G, d] the layer's raw query
    q_store: torch.Tensor  # float32 [streams, G, d] the query in the store's basis
    depths: torch.Tensor  # int8 [streams, d]
    keys: torch.Tensor  # int32 [streams, G, 2, key_columns(T)]: the scores' split order keys (fathom.cuda.score_keys)
    top_hist: torch.Tensor  # int32 [streams, G, 256]


class WaterfillDepths:
    """Water-filling on the GPU under each layer's budget (a flat budget or a per-layer plan; each stream on its own
    or, pooled, every KV head of a session on one water line); σ² read per stream
    from the store's running block scales or from calibration (kept in tensors that :meth:`set_calibration`
    refreshes): the store for ``variance="store"``, calibration for ``"calibration"``, and on the per-head store
    each head's basis' default (the store on raw heads, calibration on rotated ones)."""

    def __init__(self, method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None,
                 ds_rank: np.ndarray | None, gains: np.ndarray | None = None):
        self.cache, policy, shape = cache, method.policy, cache.shape
        # the calibrated relative plane gains γ per stream (fathom.methods.gain_table), else design §5's model
        self.gamma = torch.as_tensor(_gain_table_host(shape, gains), device=DEVICE) \
            if method.calibrated_gains else None
        self._gamma_uploads = None if self.gamma is None else LayerUploads(self.gamma)
        budgets = policy.layer_budgets(shape.layers)
        if len(budgets) != shape.layers:
            raise ValueError(f"method {method.name!r} has {len(budgets)} per-layer budgets for a cache of "
                             f"{shape.layers} layers")
        self.budgets, self.per_head = budgets, policy.variance == methods.PER_BASIS
        self.pooled = method.pooled  # a layer's KV heads of a session on one water line
        self.sigma2 = None if policy.variance == "store" else _per_stream(shape, "sigma2", sigma2, torch.float64)
        # each stream's σ² source (1: the store); a per-head store's heads are set by set_calibration
        self.from_store = torch.full((shape.layers, shape.streams), int(policy.variance == "store"),
                                     dtype=torch.uint8, device=DEVICE)
        self._sigma2_uploads = None if self.sigma2 is None else LayerUploads(self.sigma2)
        self._from_store_uploads = LayerUploads(self.from_store) if self.per_head else None

    def set_calibration(self, layer: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None) -> None:
        one_layer = replace(self.cache.shape, layers=1)
        writes = []  # every argument checked before anything is written: a refused call changes nothing
        if self.sigma2 is not None and sigma2 is not None:
            host = _per_stream_host(one_layer, "sigma2", np.asarray(sigma2)[None])[0]
            writes.append((self._sigma2_uploads, host))
        if self.per_head and head_basis is not None:
            H, d = one_layer.kv_heads, one_layer.head_dim
            head_basis = np.asarray(head_basis)
            if head_basis.shape != (H,) or not np.isin(head_basis, methods.BASES).all():
                raise ValueError(f"head_basis must be [{H}] of 'raw' / 'rotated', got {head_basis.tolist()}")
            raw = np.broadcast_to((head_basis == "raw")[None, :, None], (1, H, d))  # raw heads read the store's σ²
            writes.append((self._from_store_uploads, _per_stream_host(one_layer, "head_basis", raw)[0, :, 0]))
        if self.gamma is not None and gains is not None:
            writes.append((self._gamma_uploads, _gain_table_host(one_layer, np.asarray(gains)[None])[0]))
        for uploads, host in writes:
            uploads.write(layer, host)

    def launch(self, layer: int, basis: str, q_store, buf: StepBuffers) -> Launch:
        cache_layer, shape = self.cache.layers[layer], self.cache.shape
        sums = as_array(cache_layer.stores[basis].scale_sq_sum)
        sigma2 = sums if self.sigma2 is None else as_array(self.sigma2[layer])
        from_store = as_array(self.from_store[layer])
        budget, lengths, depths = self.budgets[layer], cache_layer.arrays["lengths"], as_array(buf.depths)
        heads, gains = shape.kv_heads, None if self.gamma is None else as_array(self.gamma[layer])
        pooled = self.pooled
        return lambda stream: waterfill(q_store, sigma2, sums, from_store, budget, depths, lengths, heads,
                                        stream=stream, gains=gains, pooled=pooled)


class TopChannelDepths:
    """SparQ's depth 4 on the r channels with the largest ``Σ_h |q[h, c]|``, chosen on the GPU per step."""

    def __init__(self, method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None,
                 ds_rank: np.ndarray | None, gains: np.ndarray | None = None):
        self.cache, self.r = cache, method.policy.r

    def set_calibration(self, layer: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None) -> None:
        """Reads no calibration."""

    def launch(self, layer: int, basis: str, q_store, buf: StepBuffers) -> Launch:
        depths, r, threads = as_array(buf.depths), self.r, min(PLAN_THREADS, self.cache.shape.head_dim)
        return lambda stream: top_channels(q_store, r, depths, threads, stream)


class FixedDepths:
    """Query-independent depths (Double Sparsity's ranked channels, Loki's first coordinates, the thumbnail's
    uniform depth) computed once per (layer, KV head) and copied into the step's depths."""

    def __init__(self, method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None,
                 ds_rank: np.ndarray | None, gains: np.ndarray | None = None):
        self.cache, self.policy, self.group_size, shape = cache, method.policy, group_size, cache.shape
        self.fixed = torch.as_tensor(np.repeat(_fixed_depths(self.policy, shape, group_size, ds_rank)[:, None],
                                               shape.sessions, 1).reshape(shape.layers, shape.streams, -1),
                                     device=DEVICE)
        self._uploads = LayerUploads(self.fixed)

    def set_calibration(self, layer: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None) -> None:
        if ds_rank is not None:
            one_layer = replace(self.cache.shape, layers=1)
            depths = _fixed_depths(self.policy, one_layer, self.group_size, np.asarray(ds_rank)[None])[0]
            self._uploads.write(layer, np.repeat(depths[None], one_layer.sessions, 0).reshape(one_layer.streams, -1))

    def launch(self, layer: int, basis: str, q_store, buf: StepBuffers) -> Launch:
        fixed = self.fixed[layer]
        return lambda stream: buf.depths.copy_(fixed)


# The GPU depth plan of each depth policy of fathom.methods.
DEPTH_PLANS = {methods.Waterfill: WaterfillDepths, methods.LayerWaterfill: WaterfillDepths,
               methods.QueryTopChannels: TopChannelDepths, methods.FixedChannels: FixedDepths,
               methods.UniformDepth: FixedDepths}


class PlaneScan:
    """Depths planned on the GPU (the policy's :data:`DEPTH_PLANS` entry), then the plane scan of the ``basis``
    store: through the cells' midpoints, or through each (layer, KV head)'s reconstruction table ``levels [L, H, d,
    4, 16]`` (units of Δ, in the basis its store holds; kept in a tensor that :meth:`set_calibration` refreshes)."""

    def __init__(self, method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None,
                 ds_rank: np.ndarray | None, warps: int, gains: np.ndarray | None = None,
                 levels: np.ndarray | None = None):
        if type(method.policy) not in DEPTH_PLANS:
            raise ValueError(f"no plane scan for the policy of {method.name!r}")
        d = cache.shape.head_dim
        if isinstance(method.policy, (methods.QueryTopChannels, methods.FixedChannels)) and method.policy.r > d:
            # else SparQ fails only at its first step, Loki with an IndexError, Double Sparsity reads d channels
            raise ValueError(f"r must be an integer in 1..{d} channels (the cache's head_dim) for {method.name!r}, "
                             f"got {method.policy.r}")
        # the per-head store is the rotated store with each raw head's basis the identity
        self.cache, self.basis, self.warps = cache, "rotated" if method.scans_rotated else "raw", warps
        self.depth_plan = DEPTH_PLANS[type(method.policy)](method, cache, group_size, sigma2, ds_rank, gains)
        self.levels = None if levels is None else torch.as_tensor(_levels_host(cache.shape, levels), device=DEVICE)
        self._levels_uploads = None if levels is None else LayerUploads(self.levels)

    def set_calibration(self, layer: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None,
                        levels: np.ndarray | None = None) -> None:
        """Copy one layer's calibration (``[H, d]`` each, ``head_basis [H]``; what the policy reads of it) and its
        reconstruction tables ``levels [H, d, 4, 16]`` into the tensors the captured launches read: a CUDA graph of
        the step stays valid. Tables are refused by a scan made to read the midpoints (its kernel has none)."""
        table = None
        if levels is not None:  # checked before anything is written: a refused call changes nothing
            if self.levels is None:
                raise ValueError("levels: this decoder reads the cells' midpoints (give levels when it is made)")
            table = _levels_host(replace(self.cache.shape, layers=1), np.asarray(levels)[None])[0]
        self.depth_plan.set_calibration(layer, sigma2, ds_rank, head_basis, gains)
        if table is not None:
            self._levels_uploads.write(layer, table)

    def plan(self, layer: int, buf: StepBuffers) -> list[Launch]:
        """The query into the store's basis, then the depths."""
        cache_layer = self.cache.layers[layer]
        launches: list[Launch] = []
        if self.basis == "rotated":
            launches.append(lambda stream: torch.bmm(buf.q, cache_layer.basis, out=buf.q_store))
        q_store = as_array(buf.q_store if self.basis == "rotated" else buf.q)
        return launches + [self.depth_plan.launch(layer, self.basis, q_store, buf)]

    def scan(self, layer: int, buf: StepBuffers, sel) -> list[Launch]:
        cache_layer = self.cache.layers[layer]
        near, far = cache_layer.stores[self.basis].arrays["near"], cache_layer.stores[self.basis].arrays["far"]
        q_store = as_array(buf.q_store if self.basis == "rotated" else buf.q)
        depths, lengths = as_array(buf.depths), cache_layer.arrays["lengths"]
        keys, top_hist = as_array(buf.keys).view(np.uint32), as_array(buf.top_hist)
        heads, layout, warps = self.cache.shape.kv_heads, self.cache.shape.layout, self.warps
        levels = None if self.levels is None else as_array(self.levels[layer])
        return [lambda stream: scan_planes(q_store, depths, lengths, heads, near, far, layout, sel.sink, sel.local,
                                           keys, top_hist, warps, stream, levels)]


class RowScan:
    """Exact scores over the sealed bf16 K rows (``keys``, the oracle) or landmark scores (``landmarks``)."""

    def __init__(self, cache, rows: str):
        self.cache, self.rows = cache, rows

    def set_calibration(self, layer: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
                        head_basis: np.ndarray | None = None, gains: np.ndarray | None = None,
                        levels: np.ndarray | None = None) -> None:
        """Reads no calibration (the decoder refuses ``levels`` for it)."""

    def plan(self, layer: int, buf: StepBuffers) -> list[Launch]:
        return []

    def scan(self, layer: int, buf: StepBuffers, sel) -> list[Launch]:
        cache_layer = self.cache.layers[layer]
        rows = cache_layer.arrays["kv"] if self.rows == "keys" else cache_layer.arrays["marks"]
        bf16, per_row = (True, 1) if self.rows == "keys" else (False, LANDMARK_TOKENS)
        lengths, heads = cache_layer.arrays["lengths"], self.cache.shape.kv_heads
        q, keys, top_hist = as_array(buf.q), as_array(buf.keys).view(np.uint32), as_array(buf.top_hist)
        return [lambda stream: scan_rows(q, rows, bf16, per_row, lengths, heads, sel.sink, sel.local, keys,
                                         top_hist, stream=stream)]


def _plane_scan(method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None,
                ds_rank: np.ndarray | None, warps: int, gains: np.ndarray | None,
                levels: np.ndarray | None) -> PlaneScan:
    if method.scans_rotated and not cache.rotated:
        raise ValueError(f"method {method.name!r} scans the rotated store but the cache holds only the raw store "
                         f"(make the cache with a basis)")
    return PlaneScan(method, cache, group_size, sigma2, ds_rank, warps, gains, levels)


# The scan of each scorer of fathom.methods (dense: none, every row is attended).
SCANS = {"planes": _plane_scan,
         "exact": lambda method, cache, *_: RowScan(cache, "keys"),
         "landmark": lambda method, cache, *_: RowScan(cache, "landmarks"),
         "dense": lambda *_: None}


def resolve(method: methods.Method, cache, group_size: int, sigma2: np.ndarray | None, ds_rank: np.ndarray | None,
            warps: int, gains: np.ndarray | None = None, levels: np.ndarray | None = None
            ) -> PlaneScan | RowScan | None:
    """The scan of ``method`` on ``cache`` (None: dense, nothing scanned); ``levels``: the plane scan's
    reconstruction tables (None: the cells' midpoints), refused for a method that reads no planes."""
    if levels is not None and not method.scans_planes:
        raise ValueError(f"levels are read by plane scans only; {method.name!r} reads no bit planes")
    return SCANS[method.scorer](method, cache, group_size, sigma2, ds_rank, warps, gains, levels)


def _per_stream(s, name: str, x: np.ndarray | None, dtype) -> torch.Tensor:
    """``x [L, H, d]`` repeated per session of the cache shape ``s`` -> ``[L, streams, d]`` on the device."""
    return torch.as_tensor(_per_stream_host(s, name, x), dtype=dtype, device=DEVICE)


def _per_stream_host(s, name: str, x: np.ndarray | None, tail: tuple = ()) -> np.ndarray:
    """``x [L, H, d, *tail]`` checked and repeated per session of the cache shape ``s`` -> float64
    ``[L, streams, d, *tail]``."""
    want = (s.layers, s.kv_heads, s.head_dim) + tail
    if x is None or np.shape(x) != want:
        raise ValueError(f"{name} must have shape {want} for this method")
    x = np.asarray(x, np.float64)
    if not np.all(np.isfinite(x)) or x.min() < 0:
        raise ValueError(f"{name} must be finite and >= 0")
    return np.repeat(x[:, None], s.sessions, 1).reshape((s.layers, s.streams, s.head_dim) + tail)


def _gain_table_host(s, gains: np.ndarray | None) -> np.ndarray:
    """A gain table ``[L, H, d, 4]`` checked as every planner takes one (``fathom.waterfill.check_gain_values``)
    and repeated per session -> float64 ``[L, streams, d, 4]``."""
    table = _per_stream_host(s, "gains", gains, GAIN_TAIL)
    check_gain_values(table)
    return table


def _levels_host(s, levels: np.ndarray) -> np.ndarray:
    """Reconstruction tables ``[L, H, d, 4, 16]`` (finite, in units of Δ) checked and laid out as the scan reads
    them (``fathom.cuda.scan.scan_levels``) -> float32, the same shape."""
    want = (s.layers, s.kv_heads, s.head_dim, MAX_DEPTH, CELLS)
    if np.shape(levels) != want:
        raise ValueError(f"levels must have shape {want}")
    levels = np.asarray(levels, np.float32)
    _checks.finite("levels", levels)  # after the cast: a float64 beyond float32's range is refused too
    return scan_levels(levels)


class LayerUploads:
    """Per-layer host values copied into a device tensor ``[L, ...]`` that captured steps read, without waiting for
    the GPU: staged in a pinned mirror allocated once with the tensor, copied non-blocking, and a layer's mirror
    rewritten only after its previous copy has run (an event per layer). A pageable copy synchronises the stream
    (36 per pooled Double Sparsity cache's first step) and a pinned staging tensor per copy costs ~0.5 ms to
    allocate, both measured on the H200."""

    def __init__(self, device: torch.Tensor):
        self.device, self.on_gpu = device, device.device.type == "cuda"
        self.host = torch.empty(device.shape, dtype=device.dtype, pin_memory=self.on_gpu)
        self.copied: list[torch.cuda.Event | None] = [None] * device.shape[0]

    def write(self, layer: int, values: np.ndarray) -> None:
        """``values`` (cast to the tensor's dtype) into ``layer``'s row, in stream order."""
        if self.copied[layer] is not None:
            self.copied[layer].synchronize()
        self.host[layer].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        self.device[layer].copy_(self.host[layer], non_blocking=self.on_gpu)
        if self.on_gpu:
            self.copied[layer] = torch.cuda.Event()
            self.copied[layer].record()


def _fixed_depths(policy, s, group_size: int, ds_rank: np.ndarray | None) -> np.ndarray:
    """Depths ``int8 [L, H, d]`` of a query-independent policy (double-sparsity, loki, thumbnail) over the layers
    of the cache shape ``s``."""
    shape = (s.layers, s.kv_heads, s.head_dim)
    if policy.reads_ds_rank:
        ranks = np.asarray(ds_rank) if ds_rank is not None else None
        if ranks is None or ranks.shape != shape or not all(
                np.array_equal(np.sort(r), np.arange(s.head_dim)) for r in ranks.reshape(-1, s.head_dim)):
            raise ValueError(f"ds_rank must be a permutation of the channels per (layer, KV head), shape {shape}, "
                             f"for double-sparsity")
    else:
        ranks = np.broadcast_to(np.arange(s.head_dim), shape)
    no_query = np.zeros((group_size, s.head_dim), np.float32)
    return np.array([[policy.depths(no_query, methods.HeadStats(np.ones(s.head_dim), ranks[layer, h]))
                      for h in range(s.kv_heads)] for layer in range(s.layers)], np.int8)
