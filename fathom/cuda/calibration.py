"""Torch twin of :func:`fathom.calibration.calibrate`: one layer at a time, on the tensors' device, during a
model's prefill (design §5, §7), computing only what the methods read.

:func:`calibrate_layer` takes one layer's keys ``[H, n, d]`` and calibration queries ``[H, m, d]`` (the KV head's
G query heads at P positions, flattened: ``m = P·G``), in any float dtype (bf16 from the model is fine: it is
upcast exactly), and computes in float64 like the reference:

* ``sigma2_raw [H, d]``: the variance of each key channel, always (it is one pass over the keys);
* ``ds_rank [H, d]``: channels by Double Sparsity's ``mean |q_c| · mean |k_c|``, descending (``"ds_rank"``);
* ``basis [H, d, d]`` and ``sigma2_rotated [H, d]``: the eigenbasis of the key covariance (mean removed, divided
  by n) ordered by score variance ``λ_i · mean_q (q · e_i)²``, descending, and the clipped eigenvalues in that
  order (``"basis"``; a batched ``torch.linalg.eigh``, the only O(d³) step);
* ``plane_drops_raw [H, d, 4]`` and ``scale2_raw [H, d]`` (with the basis, ``_rotated`` too, of the float32 keys
  times the basis): what each bit plane removes of each channel's error variance over the sealed 64-token blocks,
  and the mean squared fp16 block scale (``"plane_drops"``; the store's quantizer in torch,
  :func:`fathom.cuda.fidelity.dequantized_copies`; none for keys shorter than a block, as in the reference).
  :func:`stack` turns the drops into the gain table (:func:`fathom.waterfill.calibrated_gains`), as
  :func:`fathom.calibration.plane_drops` does.

Ties keep the lower index (stable sorts), as the reference does. Eigenvectors are unique only up to sign, so the
basis columns equal the reference's up to sign. Memory: a float64 copy of the keys (8 bytes an element).

:func:`stack` gathers the layers into the NumPy :class:`fathom.calibration.Calibration` the rest of Fathom reads.

Example::

    >>> import torch
    >>> from fathom.cuda.calibration import calibrate_layer, stack
    >>> g = torch.Generator().manual_seed(0)
    >>> keys = torch.randn(2, 64, 8, generator=g) * torch.arange(1.0, 9.0)  # [H, n, d]
    >>> queries = torch.randn(2, 6, 8, generator=g)  # [H, P·G, d]
    >>> layer = calibrate_layer(keys.bfloat16(), queries, needs={"ds_rank"})
    >>> layer.ds_rank.shape, layer.basis is None
    (torch.Size([2, 8]), True)
    >>> cal = stack([layer, layer], meta={"model": "toy"})
    >>> cal.ds_rank.shape, cal.basis.shape, cal.meta["computed"]
    ((2, 2, 8), (2, 2, 8, 8), ['sigma2_raw', 'ds_rank'])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from fathom.calibration import Calibration
from fathom.cuda.fidelity import dequantized_copies
from fathom.quantize import BLOCK
from fathom.waterfill import calibrated_gains

# What a method may read: "sigma2" (sigma2_raw, always computed), "ds_rank", "basis" (with sigma2_rotated),
# "plane_drops" (each store's plane drops and mean squared block scale: the calibrated plane gains).
NEEDS = ("sigma2", "ds_rank", "basis", "plane_drops")

# The Calibration fields, in its order; a LayerCalibration has the same names.
FIELDS = ("sigma2_raw", "basis", "sigma2_rotated", "ds_rank", "plane_drops_raw", "plane_drops_rotated", "scale2_raw",
          "scale2_rotated")


@dataclass(frozen=True)
class LayerCalibration:
    """One layer's statistics as torch tensors on the keys' device; a field not asked for is None.

    sigma2_raw: float64 ``[H, d]``; basis: float64 ``[H, d, d]`` (columns are the rotated coordinates);
    sigma2_rotated: float64 ``[H, d]``; ds_rank: int64 ``[H, d]``; plane_drops_raw / _rotated: float64 ``[H, d, 4]``
    (the measured drops, before :func:`fathom.waterfill.calibrated_gains`); scale2_raw / _rotated: float64 ``[H, d]``.
    """

    sigma2_raw: torch.Tensor
    basis: torch.Tensor | None = None
    sigma2_rotated: torch.Tensor | None = None
    ds_rank: torch.Tensor | None = None
    plane_drops_raw: torch.Tensor | None = None
    plane_drops_rotated: torch.Tensor | None = None
    scale2_raw: torch.Tensor | None = None
    scale2_rotated: torch.Tensor | None = None

    @property
    def computed(self) -> tuple[str, ...]:
        """The fields that hold data, in :data:`FIELDS` order."""
        return tuple(name for name in FIELDS if getattr(self, name) is not None)


def _check_needs(needs: Iterable[str]) -> frozenset[str]:
    if isinstance(needs, str):  # "basis" would otherwise read as {"b", "a", "s", "i"}
        raise ValueError(f"needs must be an iterable of names from {NEEDS}, not the string {needs!r}")
    needs = frozenset(needs)
    unknown = needs - set(NEEDS)
    if unknown:
        raise ValueError(f"needs must be names from {NEEDS}, got unknown {sorted(unknown)}")
    return needs


def _check_inputs(keys: torch.Tensor, queries: torch.Tensor) -> None:
    for name, x in (("keys", keys), ("queries", queries)):
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x) or x.ndim != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a float torch tensor of rank 3, got {getattr(x, 'dtype', '')} {shape}")
    (H, n, d), (Hq, m, dq) = keys.shape, queries.shape
    if (Hq, dq) != (H, d):
        raise ValueError(f"queries must have shape [{H}, m, {d}] to match keys [H, n, d], got {tuple(queries.shape)}")
    if n < 2:
        raise ValueError(f"keys must have at least 2 tokens (n) for a variance, got {n}")
    if m < 1:
        raise ValueError("queries must have at least 1 row (m = P·G), got 0")
    if queries.device != keys.device:
        raise ValueError(f"queries must be on the keys' device {keys.device}, got {queries.device}")


def calibrate_layer(keys: torch.Tensor, queries: torch.Tensor, needs: Iterable[str] = NEEDS) -> LayerCalibration:
    """One layer's calibration statistics, in float64 on the tensors' device.

    Args:
        keys: float ``[H, n, d]`` (post-RoPE, as attention sees them), n >= 2.
        queries: float ``[H, m, d]``: each KV head's calibration queries, ``m = P·G`` rows.
        needs: names from :data:`NEEDS`; sigma2_raw is computed whatever they say.
    Returns:
        :class:`LayerCalibration`, None where a field was not asked for.
    """
    needs = _check_needs(needs)
    _check_inputs(keys, queries)
    k = keys.to(torch.float64)
    H, n, d = k.shape
    centered = k - k.mean(dim=1, keepdim=True)
    sigma2_raw = centered.square().mean(dim=1)  # the population variance, as np.var
    ds_rank = basis = sigma2_rotated = None
    q = queries.to(torch.float64) if needs & {"ds_rank", "basis"} else None
    if "ds_rank" in needs:
        ds_stat = q.abs().mean(dim=1) * k.abs().mean(dim=1)
        ds_rank = torch.argsort(-ds_stat, dim=-1, stable=True)
    if "basis" in needs:
        eigval, eigvec = torch.linalg.eigh(centered.transpose(1, 2) @ centered / n)  # ascending
        eigval = eigval.clamp(min=0)  # round-off can leave a tiny negative eigenvalue
        score_var = eigval * (q @ eigvec).square().mean(dim=1)  # [H, d]
        order = torch.argsort(-score_var, dim=-1, stable=True)
        basis = torch.take_along_dim(eigvec, order[:, None, :], dim=2)
        sigma2_rotated = torch.take_along_dim(eigval, order, dim=1)
    planes = {}
    if "plane_drops" in needs and n >= BLOCK:  # as the reference: keys shorter than a sealed block have no planes
        stores = {"raw": keys.float()} | ({"rotated": keys.float() @ basis.float()} if basis is not None else {})
        for name, store in stores.items():  # the rotated store quantizes the float32 product, as the reference
            planes[f"plane_drops_{name}"], planes[f"scale2_{name}"] = _plane_drops(store)
    return LayerCalibration(sigma2_raw, basis, sigma2_rotated, ds_rank, **planes)


def _plane_drops(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's measured plane drops float64 ``[H, d, 4]`` (of the error variance over the sealed tokens at depth
    t - 1 -> t; depth 0: the key itself) and mean squared block scale float64 ``[H, d]`` of float32 keys
    ``[H, n, d]``: :func:`fathom.calibration.plane_drops` before its gain table, head by head (the four
    dequantized copies of one head are ``16·n·d`` bytes)."""
    drops, scale2 = [], []
    for head in keys:
        copies, scales = dequantized_copies(head)
        sealed = head[:copies.shape[1]].double()
        variance = [sealed.var(dim=0, correction=0)] + [(sealed - c.double()).var(dim=0, correction=0) for c in copies]
        drops.append(-torch.diff(torch.stack(variance, dim=-1), dim=-1))
        scale2.append(scales.double().square().mean(dim=1))
    return torch.stack(drops), torch.stack(scale2)


def stack(layers: list[LayerCalibration], meta: dict) -> Calibration:
    """The layers as one NumPy :class:`~fathom.calibration.Calibration` (float32, int32 ds_rank), ``[L, H, ...]``.

    Every layer must have the same fields computed. A field no layer computed is filled with a neutral value so
    the Calibration keeps its shape: ``basis`` the identity, ``sigma2_rotated`` = ``sigma2_raw`` (the variances
    in the identity basis), ``ds_rank`` = ``arange(d)``; the identity and ``arange`` fills are read-only
    broadcast views (a 36-layer identity would be a 19 MB copy at d = 128, on a pooled cache's first step). Those
    fills are not statistics: ``meta["computed"]`` (a copy of ``meta`` with that key set) lists the fields that
    are, in Calibration order.
    """
    if not layers:
        raise ValueError("layers must hold at least one LayerCalibration, got none")
    computed = layers[0].computed
    H, d = layers[0].sigma2_raw.shape
    for i, layer in enumerate(layers):
        if layer.computed != computed:
            raise ValueError(f"layers must all have the same fields computed: layer 0 has {list(computed)}, "
                             f"layer {i} has {list(layer.computed)}")
        if tuple(layer.sigma2_raw.shape) != (H, d):
            raise ValueError(f"layers must all have [H, d] = [{H}, {d}], layer {i} has {list(layer.sigma2_raw.shape)}")

    def gathered(name: str, dtype: torch.dtype) -> np.ndarray:  # one copy to the host per field, not per layer
        return torch.stack([getattr(layer, name) for layer in layers]).to(dtype).cpu().numpy()

    L = len(layers)
    sigma2_raw = gathered("sigma2_raw", torch.float32)
    basis = gathered("basis", torch.float32) if "basis" in computed else np.broadcast_to(
        np.eye(d, dtype=np.float32), (L, H, d, d))
    sigma2_rotated = gathered("sigma2_rotated", torch.float32) if "sigma2_rotated" in computed else sigma2_raw.copy()
    ds_rank = gathered("ds_rank", torch.int32) if "ds_rank" in computed else np.broadcast_to(
        np.arange(d, dtype=np.int32), (L, H, d))
    planes = {}  # the gain tables from the drops, and the block scales, as fathom.calibration.calibrate keeps them
    for name in ("raw", "rotated"):
        if f"plane_drops_{name}" in computed:
            planes[f"plane_drops_{name}"] = calibrated_gains(gathered(f"plane_drops_{name}", torch.float64))
            planes[f"scale2_{name}"] = gathered(f"scale2_{name}", torch.float64)
    return Calibration(sigma2_raw, basis, sigma2_rotated, ds_rank, meta={**meta, "computed": list(computed)},
                       **planes)
