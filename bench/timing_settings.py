"""What ``python -m bench timing`` times: Qwen3-8B's attention shape, the grid of settings (context × sessions ×
store, k), the timed methods, and how many layers' stores pinned host memory holds."""

from __future__ import annotations

from dataclasses import dataclass

from fathom.quantize import BLOCK

LAYERS, KV_HEADS, GROUP_SIZE, HEAD_DIM = 36, 8, 4, 128  # Qwen3-8B
CONTEXTS = (32768, 131072, 262144, 1048576)
SESSIONS = (1, 4, 16)
MANY_SESSIONS_UP_TO = 131072  # sessions > 1 at contexts up to this
HEADROOM = 4096  # tokens appended while timing


@dataclass(frozen=True)
class Setting:
    """One cache: ``sessions`` at ``context`` tokens (``ragged``: session i holds ``context · (1 + i) / S``), their
    ends staggered within a block (:attr:`lengths`)."""

    context: int
    sessions: int
    regime: str
    k: int = 512
    ragged: bool = False

    @property
    def block_lengths(self) -> list[int]:
        """Each session's tokens in whole blocks: ``context``, or with ``ragged`` session i's
        ``context · (1 + i) / S`` down to a block."""
        if not self.ragged:
            return [self.context] * self.sessions
        return [self.context * (i + 1) // self.sessions // BLOCK * BLOCK for i in range(self.sessions)]

    @property
    def lengths(self) -> list[int]:
        """The tokens each session holds when the timing starts: :attr:`block_lengths` :func:`staggered` (session i
        short by ``(S − 1 − i) · 64 / S``; the longest, last, by none). A server's sessions complete their 64-token
        blocks on different tokens, so most tokens seal some: a decode token's seal launches work for ~S / 64 of the
        sessions a layer appends to, and a launch takes its slowest CTA's time. Block-aligned lengths would complete
        every session's block on the same token, one in 64 / (appends a physical layer takes a token), which a
        median token never is."""
        return staggered(self.block_lengths)

    @property
    def label(self) -> str:
        s = f"{self.context // 1024}k × {self.sessions}" + (" ragged" if self.ragged else "")
        return s + ("" if self.k == 512 else f", k = {self.k}")


def staggered(lengths: list[int]) -> list[int]:
    """``lengths`` of S sessions, session i's short by ``(S − 1 − i) · 64 / S`` tokens: ends spread over a 64-token
    block, so that over any 64 appended tokens each session completes one block and no token more than ⌈S / 64⌉
    of them (as a server's sessions do; the same lengths would complete theirs all on one token)."""
    return [n - (len(lengths) - 1 - i) * BLOCK // len(lengths) for i, n in enumerate(lengths)]


def method_table():
    """Every timed method, by label (d = 128)."""
    from fathom import methods

    grid = [methods.fathom(32), methods.fathom(48), methods.fathom(64), methods.fathom(48, pooled=True),
            methods.sparq(16), methods.sparq(32),
            methods.double_sparsity(32), methods.loki(32), methods.thumbnail(2), methods.landmark(),
            methods.oracle(), methods.dense()]
    return {m.label(HEAD_DIM): m for m in grid}


def settings_for(args) -> list[Setting]:
    """Every (regime, context, sessions) asked for, within ``--max-tokens`` per layer; k = 2048 too at 1M."""
    out = []
    for regime in args.regimes:
        for context in args.contexts:
            for sessions in args.sessions:
                if sessions > 1 and context > MANY_SESSIONS_UP_TO or sessions * context > args.max_tokens:
                    continue
                out.append(Setting(context, sessions, regime, ragged=sessions == args.ragged_sessions))
            if context >= 1048576 and context <= args.max_tokens and (regime == "host" or not args.skip_large_k_hbm):
                out.append(Setting(context, 1, regime, k=2048))
    return out


def physical_layers(layer_bytes: int, host_gb: float) -> int:
    """How many layers pinned host memory holds within ``host_gb``, at ``layer_bytes`` pinned a layer (the cache's
    own accounting, ``fathom.host.cache.PinnedLayer.nbytes``: it reserves ``max_tokens`` a session, ragged or not)."""
    return int(max(1, min(LAYERS, host_gb * 1e9 // layer_bytes)))
