"""Captured (or synthetic) attention inputs of one text window: what fidelity is measured on."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from fathom import _checks


@dataclass(frozen=True)
class Capture:
    """Keys, values and decode queries of every layer and KV head.

    keys: float32 ``[L, H, n, d]`` (post-RoPE, as attention sees them);
    values: float32 ``[L, H, n, dv]``; queries: float32 ``[L, H, P, G, d]``;
    positions: int ``[P]`` — query ``p`` attends to tokens ``0..positions[p]``;
    scale: the model's softmax scale; meta: provenance (model, text, synthetic, ...).
    """

    keys: np.ndarray
    values: np.ndarray
    queries: np.ndarray
    positions: np.ndarray
    scale: float
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        _checks.array("keys", self.keys, ndim=4, kind="f")
        _checks.array("values", self.values, ndim=4, kind="f")
        _checks.array("queries", self.queries, ndim=5, kind="f")
        _checks.array("positions", self.positions, ndim=1, kind="iu")
        L, H, n, d = self.keys.shape
        if self.values.shape[:3] != (L, H, n):
            raise ValueError(f"values must have shape {(L, H, n)} + (dv,), got {self.values.shape}")
        if self.queries.shape[:2] != (L, H) or self.queries.shape[4] != d:
            raise ValueError(f"queries must have shape {(L, H)} + (P, G, {d}), got {self.queries.shape}")
        if self.queries.shape[2] != len(self.positions):
            raise ValueError(f"positions must have {self.queries.shape[2]} entries, got {len(self.positions)}")
        if len(self.positions) and (self.positions.min() < 0 or self.positions.max() >= n):
            raise ValueError(f"positions must lie in 0..{n - 1}")

    @property
    def shape(self) -> dict:
        L, H, n, d = self.keys.shape
        return {"layers": L, "kv_heads": H, "tokens": n, "head_dim": d,
                "group": self.queries.shape[3], "positions": len(self.positions)}

    def save(self, path: str | Path | IO[bytes]) -> None:
        np.savez(path, keys=self.keys, values=self.values, queries=self.queries,
                 positions=self.positions, scale=self.scale, meta=json.dumps(self.meta))

    @classmethod
    def load(cls, path: str | Path) -> Capture:
        with np.load(path) as f:
            return cls(f["keys"], f["values"], f["queries"], f["positions"], float(f["scale"]),
                       json.loads(str(f["meta"])))
