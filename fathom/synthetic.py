"""Synthetic keys, values and queries with the structure real keys have — for tests and the quick start.

Numbers computed on this data are **synthetic** and say so wherever shown.
Per (layer, KV head): channel standard deviations log-uniform over ~2.5
orders of magnitude, a few heavy channels with a large offset (the outlier
channels of real K caches), ~1% outlier tokens, RoPE applied to keys and
queries by position, and queries that point at a few earlier keys so that
attention is peaked the way decode attention is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom.capture import Capture


@dataclass(frozen=True)
class SyntheticConfig:
    layers: int = 4
    kv_heads: int = 2
    group_size: int = 4
    head_dim: int = 128
    tokens: int = 4096
    positions: int = 16
    heavy_channels: int = 3
    outlier_rate: float = 0.01
    rope_base: float = 10000.0
    seed: int = 0  # the "model": channel scales and heavy channels
    text_seed: int = 0  # the "text": tokens, outliers and queries (calibrate on another text of the same model)

    def __post_init__(self):
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE pairs), got {self.head_dim}")
        if not 0 < self.positions <= self.tokens:
            raise ValueError(f"positions must lie in 1..tokens, got {self.positions}")


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate channel pairs ``(c, c + d/2)`` by ``position · base^(-2c/d)`` (the HF RoPE layout)."""
    half = x.shape[-1] // 2
    freq = base ** (-np.arange(half) * 2.0 / x.shape[-1])
    angle = positions[:, None] * freq  # [n, half]
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = np.cos(angle).reshape(shape), np.sin(angle).reshape(shape)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _head(model: np.random.Generator, text: np.random.Generator, cfg: SyntheticConfig
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, G, P = cfg.tokens, cfg.head_dim, cfg.group_size, cfg.positions
    std = np.exp(model.uniform(np.log(0.05), np.log(15.0), d))
    mean = np.zeros(d)
    heavy = model.choice(d, cfg.heavy_channels, replace=False)
    std[heavy] *= 4
    mean[heavy] = model.choice([-1, 1], cfg.heavy_channels) * 3 * std[heavy]
    k = mean + std * text.standard_normal((n, d))
    outliers = text.random(n) < cfg.outlier_rate
    k[outliers] *= text.uniform(3, 6, (outliers.sum(), 1))
    positions = np.arange(n - P, n)
    # Each query head points at a few earlier keys (pre-RoPE), plus noise shaped like the keys.
    targets = text.integers(0, n - P, (P, G, 3))
    q = (k[targets] - mean).mean(axis=2) / np.square(std) + 0.5 * text.standard_normal((P, G, d)) / std
    k = rope(k, np.arange(n, dtype=np.float64), cfg.rope_base)
    q = rope(q, positions.astype(np.float64), cfg.rope_base)
    # Scale each query so its best logit stands ~12 above the median, as in peaked decode attention.
    logits = np.einsum("pgd,nd->pgn", q, k) / np.sqrt(d)
    spread = logits.max(axis=-1) - np.median(logits, axis=-1)
    q *= (12.0 / spread)[..., None]
    return k, q, positions


def generate(cfg: SyntheticConfig = SyntheticConfig()) -> Capture:
    """A synthetic :class:`~fathom.capture.Capture` (``meta["synthetic"] = True``)."""
    model, text = np.random.default_rng(cfg.seed), np.random.default_rng([cfg.seed, cfg.text_seed])
    L, H = cfg.layers, cfg.kv_heads
    keys = np.empty((L, H, cfg.tokens, cfg.head_dim), np.float32)
    queries = np.empty((L, H, cfg.positions, cfg.group_size, cfg.head_dim), np.float32)
    positions = None
    for layer in range(L):
        for head in range(H):
            keys[layer, head], queries[layer, head], positions = _head(model, text, cfg)
    values = text.standard_normal((L, H, cfg.tokens, cfg.head_dim)).astype(np.float32)
    meta = {"synthetic": True, "model": "synthetic", "context": cfg.tokens, "seed": cfg.seed,
            "text_seed": cfg.text_seed}
    return Capture(keys, values, queries, positions, 1.0 / np.sqrt(cfg.head_dim), meta)
