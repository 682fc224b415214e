"""The timing's synthetic decode data: keys, values and queries of Qwen3-8B's shape drawn per channel from a real
capture's statistics (``python -m bench channel-stats``), the queries drifting from token to token."""

from __future__ import annotations

import math

import numpy as np

from bench.cli import UsageError
from bench.timing_settings import GROUP_SIZE, HEAD_DIM, KV_HEADS

# The decode queries' step-to-step correlation per channel: at 0.8, oracle top-512 over 32k synthetic keys
# re-selects 65% of the previous step's rows (bench rowreuse on real generated tokens: 59-71%) and an LRU row cache
# of 4 × G·k slots hits 86% (real: 89-93%, sink and local left out); tests/bench/test_synthetic_decode.py
QUERY_CORRELATION = 0.8


class Synthetic:
    """Keys, values and queries drawn per channel from a real capture's statistics (on ``device``: the GPU)."""

    def __init__(self, stats: dict, seed: int = 0, device: str = "cuda"):
        import torch

        head_dim = stats["key_mean"].shape[-1]
        if head_dim != HEAD_DIM:  # the keys are drawn channel by channel: another d would fail at the first token
            raise UsageError(f"--stats: channel statistics of a d = {head_dim} model ({stats['meta'].get('model')}); "
                             f"the timing's keys need d = {HEAD_DIM} (python -m bench channel-stats --model "
                             "qwen2.5-coder-1.5b)")
        self.torch, self.device = torch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.stats = {k: torch.as_tensor(v, device=device) for k, v in stats.items() if k != "meta"}
        self.meta = stats["meta"]

    def _pick(self, name: str, layer: int):
        L, H = self.stats[name].shape[:2]
        return self.stats[name][layer % L][[h % H for h in range(KV_HEADS)]]  # [KV_HEADS, d]

    def keys(self, layer: int, sessions: int, m: int):
        mean, std = self._pick("key_mean", layer), self._pick("key_std", layer)
        z = self.torch.randn((sessions, KV_HEADS, m, HEAD_DIM), device=self.device, generator=self.gen)
        return mean[None, :, None] + std[None, :, None] * z

    def _per_layer(self, name: str, layer_order: list[int]):
        """Statistic ``name`` of each layer of ``layer_order``, ``[L, 1, H, 1, d]`` (sessions and rows broadcast)."""
        return self.torch.stack([self._pick(name, layer) for layer in layer_order])[:, None, :, None]

    def appended(self, layer_order: list[int], sessions: int):
        """One decode token's keys and values for the layers ``layer_order``, float32 ``[L, S, H, 1, d]`` each,
        drawn afresh (one draw for every layer)."""
        torch = self.torch
        mean, std = self._per_layer("key_mean", layer_order), self._per_layer("key_std", layer_order)
        shape = (len(layer_order), sessions, KV_HEADS, 1, HEAD_DIM)
        keys = mean + std * torch.randn(shape, device=self.device, generator=self.gen)
        return keys, torch.randn(shape, device=self.device, generator=self.gen)

    def values(self, sessions: int, m: int):
        return self.torch.randn((sessions, KV_HEADS, m, HEAD_DIM), device=self.device, generator=self.gen)

    def queries(self, layer: int, sessions: int):
        mean, std = self._pick("query_mean", layer), self._pick("query_std", layer)
        z = self.torch.randn((sessions, KV_HEADS, GROUP_SIZE, HEAD_DIM), device=self.device, generator=self.gen)
        return (mean[None, :, None] + std[None, :, None] * z).reshape(sessions, KV_HEADS * GROUP_SIZE, HEAD_DIM)

    def query_walk(self, layer_order: list[int], sessions: int) -> QueryWalk:
        """Decode queries of the layers ``layer_order`` that drift from token to token (:class:`QueryWalk`)."""
        mean, std = self._per_layer("query_mean", layer_order), self._per_layer("query_std", layer_order)
        return QueryWalk(mean, std, sessions, self.gen)

    def calibration(self, layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Double Sparsity's channel order (mean |q| · mean |k|, from samples) and Loki's basis (the key covariance
        is diagonal: its eigenbasis is the channels, ordered by score variance σ_k² · E[q²]), per physical layer."""
        ranks, bases = [], []
        for layer in range(layers):
            k = self.keys(layer, 1, 4096)[0]
            q = self.queries(layer, 256).reshape(256, KV_HEADS, GROUP_SIZE, HEAD_DIM).transpose(0, 1)
            ds = (q.abs().mean(dim=(1, 2)) * k.abs().mean(dim=1)).cpu().numpy()
            score_var = (k.var(dim=1) * q.square().mean(dim=(1, 2))).cpu().numpy()
            ranks.append(np.argsort(-ds, axis=-1, kind="stable"))
            order = np.argsort(-score_var, axis=-1, kind="stable")
            bases.append(np.eye(HEAD_DIM, dtype=np.float32)[:, order].transpose(1, 0, 2))  # [H, d, d]
        return np.stack(ranks), np.stack(bases)


class QueryWalk:
    """Per layer, session, KV head and query head, ``q = mean + std · z`` with ``z`` an AR(1) walk per channel:
    ``z ← ρ z + √(1 − ρ²) ε`` each token (ρ = :data:`QUERY_CORRELATION`), so every token's query is distributed as
    the capture's and consecutive tokens' overlap."""

    def __init__(self, mean, std, sessions: int, gen):
        import torch

        self.torch, self.mean, self.std, self.gen = torch, mean, std, gen  # mean, std [L, 1, H, 1, d]
        self.z = torch.randn((mean.shape[0], sessions, KV_HEADS, GROUP_SIZE, HEAD_DIM), device=mean.device,
                             generator=gen)

    def step(self):
        """The next token's queries, float32 ``[L, S, H·G, d]``."""
        noise = self.torch.randn(self.z.shape, device=self.z.device, generator=self.gen)
        self.z.mul_(QUERY_CORRELATION).add_(noise, alpha=math.sqrt(1 - QUERY_CORRELATION ** 2))
        q = self.mean + self.std * self.z
        return q.reshape(q.shape[0], q.shape[1], KV_HEADS * GROUP_SIZE, HEAD_DIM)
