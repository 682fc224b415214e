"""Compile, ahead of time, every Numba kernel that FathomCache's offloaded backend launches: a deployment step, so
that the first cache of a serving process loads its kernels from Numba's disk cache instead of compiling them
inside its prefill (where that cache lives: ``fathom.cuda.kernel_cache``).

The kernels are specialised on the head dim ``d`` and the query heads per KV head ``G`` (the plane scan, exact
scores and softmax are compiled per shape), and the methods decide which of them run (water-filling or SparQ's
channels, the plane scan or the row scans, the rotated store); nothing depends on the context, the batch, the
budget or k. So for each method :func:`warm_kernels` runs FathomCache's own offloaded sessions
(:class:`~fathom.integrations.sessions.OffloadedSessions`) on a tiny cache of that shape: each layer's calibration,
the prefill's appends of a ragged prompt per session (rows, blocks sealed into the store, the tail), then one decode
token (per layer its append and sparse step, captured as a CUDA graph and replayed), with the HBM row cache on so
that its kernel runs too. A conversation's next chunk (dense attention in torch, then the prefill's appends) and
the whole-token graph (the same launches in a larger capture) reach no other kernel.

Usage (``--model`` reads ``d`` and ``G`` from a transformers config: a folder, a ``config.json`` or a hub id
already in the local cache; repeat it for several models; ``--methods`` defaults to every method)::

    python -m fathom.integrations.warmup --head-dim 128 --group-size 4
    python -m fathom.integrations.warmup --model Qwen/Qwen3-8B --methods fathom@48,double-sparsity@136
    python -m fathom.integrations.warmup --model Qwen/Qwen3-8B --methods fathom-mixed[gains]@48 --levels

``--levels`` warms the plane methods' scan through reconstruction tables instead (FathomCache's
``levels="calibrated"``: a kernel of its own); run it beside the plain warm-up to have both.

Run it with the environment the server will have (the same GPU model, the same ``NUMBA_CACHE_DIR`` if any), and
again after upgrading the package: a changed source drops the cached kernels.

Example::

    from fathom.integrations.warmup import warm_kernels
    done = warm_kernels(head_dim=128, group_size=4, methods=("fathom@48", "dense"))
    print(done.methods, done.compiled, done.loaded)   # ('fathom@48', 'dense'), signatures compiled / loaded
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fathom import _checks
from fathom.bits import fixed_channel_bits
from fathom.cuda import kernel_cache
from fathom.cuda.kernel_cache import KernelUse
from fathom.host.cache import MAX_HEAD_DIM
from fathom.host.decoder import MAX_GROUP_SIZE
from fathom.integrations.settings import DEFAULT_BUDGET, FathomSettings, ModelShape
from fathom.methods import BASES, CATALOG, VARIANTS, Method, entry, read_spec, split_specs
from fathom.quantize import BLOCK, CELLS, MAX_DEPTH, midpoint_levels
from fathom.selection import Selection

# The tiny cache each method runs on (the kernels' argument types do not depend on its sizes): two ragged sessions,
# one layer, one KV head, room for the prompts and the token, and a row cache
SESSIONS, LAYERS, KV_HEADS = 2, 1, 1
PROMPTS = (3 * BLOCK + 8, 2 * BLOCK + 8)  # tokens per session: sealed blocks and an open tail
MAX_TOKENS = 4 * BLOCK
ROW_CACHE_ROWS = 64
SELECTION = Selection(k=8)


@dataclass(frozen=True)
class Warmup:
    """What :func:`warm_kernels` did for one shape: the methods it decoded a token with (its sessions built, the
    prompts appended, a step run), the seconds each took (the first pays for the kernels the methods share), the
    tokens each session then held by the device's count (:data:`PROMPTS` + 1: the appends ran), and the kernels
    compiled or loaded from Numba's cache meanwhile (by ``fathom.cuda.kernel_cache.use``'s names; empty under the
    simulator, which compiles nothing)."""

    head_dim: int
    group_size: int
    methods: tuple[str, ...]
    seconds: tuple[float, ...]
    held: tuple[tuple[int, ...], ...]
    kernels: dict[str, KernelUse] = field(default_factory=dict)
    levels: bool = False  # the plane scans read reconstruction tables

    @property
    def compiled(self) -> int:
        """Kernel signatures compiled (and written to the cache)."""
        return sum(use.compiled for use in self.kernels.values())

    @property
    def loaded(self) -> int:
        """Kernel signatures loaded from the cache."""
        return sum(use.loaded for use in self.kernels.values())


def every_method(head_dim: int) -> tuple[str, ...]:
    """A spec of every method FathomCache runs: the bits methods at FathomCache's default budget, the fixed-channel
    ones at r = d/4, the others bare (the budget compiles nothing of its own); and fathom with every water-filling
    variant (the calibrated gains are a planner of their own; the pooled plan launches it one block a session)."""
    bits = DEFAULT_BUDGET
    r_bits = fixed_channel_bits(max(1, head_dim // 4))
    return tuple(name if e.budget == "none" else f"{name}@{bits if e.budget == 'bits' else r_bits:g}"
                 for name, e in CATALOG.items()) + (f"fathom[{','.join(VARIANTS)}]@{bits:g}",)


def check_shape(head_dim, group_size) -> None:
    """Refuse a head dim or group size the kernels do not take (one line naming the argument)."""
    for name, value in (("head_dim", head_dim), ("group_size", group_size)):
        if not _checks.is_integer(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % 4 == 0):
        raise ValueError(f"head_dim must be a multiple of 4 in 4..{MAX_HEAD_DIM}, got {head_dim}")
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size must be in 1..{MAX_GROUP_SIZE} query heads per KV head, got {group_size}")


def method_of(spec: str, head_dim: int) -> Method:
    """The method a spec names (``fathom@48``, ``sparq@68``, ``dense``: bench.decoding's form), checked as
    FathomCache checks its settings; fathom-plan gets a flat plan of its budget."""
    try:
        written = read_spec(spec)
        settings = FathomSettings(method=written.name, **written.settings())
        plan = (settings.budget,) * LAYERS if entry(written.name).per_layer else None
        return settings.method_at(head_dim, plan)
    except ValueError as error:
        raise ValueError(f"method {spec!r}: {error}") from None


def warm_kernels(head_dim: int, group_size: int, methods: tuple[str, ...] | None = None,
                 levels: bool = False) -> Warmup:
    """Compile (on a GPU: and write to Numba's disk cache) every kernel FathomCache's offloaded backend launches for
    attention of head dim ``head_dim`` (4..256, a multiple of 4) with ``group_size`` query heads per KV head
    (1..8), for each method spec of ``methods`` (default: :func:`every_method`); ``levels``: the plane methods'
    scans through reconstruction tables (``FathomCache(..., levels="calibrated")``) instead of the midpoints.
    Kernels already in the cache are loaded instead. Bad input raises a one-line ValueError before any work."""
    check_shape(head_dim, group_size)
    if not isinstance(levels, bool):
        raise ValueError(f"levels must be True or False, got {levels!r}")
    specs = every_method(head_dim) if methods is None else () if isinstance(methods, str) else tuple(methods)
    if not specs or any(not isinstance(spec, str) for spec in specs):
        raise ValueError(f"methods must be a non-empty sequence of method specs (e.g. 'fathom@48'), got {methods!r}")
    resolved = [method_of(spec, head_dim) for spec in specs]
    before = kernel_cache.use()
    seconds, held = [], []
    for method in resolved:
        start = time.perf_counter()
        held.append(_decode_one_token(method, head_dim, group_size, levels and method.scans_planes))
        seconds.append(time.perf_counter() - start)
    after = kernel_cache.use()
    kernels = {name: KernelUse(use.compiled - before.get(name, KernelUse()).compiled,
                               use.loaded - before.get(name, KernelUse()).loaded) for name, use in after.items()}
    return Warmup(head_dim, group_size, specs, tuple(seconds), tuple(held),
                  {name: use for name, use in kernels.items() if use.compiled or use.loaded}, levels)


def _decode_one_token(method: Method, head_dim: int, group_size: int, levels: bool = False) -> tuple[int, ...]:
    """FathomCache's offloaded path on a tiny cache: calibration, the prefill's appends, one decode token (through
    reconstruction tables, the midpoints', if ``levels``). Returns the tokens each session holds by the device's
    lengths; a non-finite output or a flag a kernel raised is an error (the warm-up is also a smoke test of the
    kernels on this device)."""
    from fathom.cuda.interop import DEVICE
    from fathom.integrations.sessions import LayerStats, OffloadedSessions, SessionShape

    shape = SessionShape(SESSIONS, LAYERS, KV_HEADS, group_size, head_dim, MAX_TOKENS, row_cache_rows=ROW_CACHE_ROWS)
    sessions = OffloadedSessions(shape, method, SELECTION, scale=head_dim ** -0.5, levels=levels)
    try:
        H, d, g = KV_HEADS, head_dim, torch.Generator().manual_seed(0)
        # neutral statistics; the per-head store's heads on the rotated basis (its raw heads run the same kernels)
        planes = {basis: np.ones((H, d, MAX_DEPTH)) for basis in BASES}  # a flat gain table for each store
        tables = {basis: np.broadcast_to(midpoint_levels(d), (H, d, MAX_DEPTH, CELLS)) for basis in BASES} \
            if levels else {}
        stats = LayerStats(np.ones((H, d)), np.tile(np.eye(d, dtype=np.float32), (H, 1, 1)), np.ones((H, d)),
                           np.tile(np.arange(d), (H, 1)), np.full(H, "rotated"), planes,
                           {basis: np.ones((H, d)) for basis in BASES}, tables, levels)
        randn = lambda *size: torch.randn(*size, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
        for layer in range(LAYERS):
            sessions.calibrate(layer, stats)
            for session, tokens in enumerate(PROMPTS):
                sessions.append(layer, session, randn(H, tokens, d), randn(H, tokens, d))
        sessions.begin_token()
        for layer in range(LAYERS):
            out = sessions.step(layer, randn(SESSIONS, H * group_size, d), randn(SESSIONS, H, d),
                                randn(SESSIONS, H, d))
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError(f"{method.name}: the warm-up's decode step gave a non-finite output on this device")
        sessions.cache.check()  # a flag a kernel raised (a bad key, a bad query) is an error here too
        return tuple(sessions.cache.layer(0).lengths.tolist())
    finally:
        sessions.close()


# -- the command ------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are raised (one ``error: …`` line, exit 2, from :func:`main`) instead of printing the
    usage."""

    def error(self, message: str):
        raise ValueError(message)


def argument_parser() -> argparse.ArgumentParser:
    """The command's arguments (checked further by :func:`shapes_of` and :func:`method_of`)."""
    parser = _Parser(prog="python -m fathom.integrations.warmup",
                     description="Compile (and write to Numba's disk cache) every kernel FathomCache's offloaded "
                                 "backend launches for these shapes and methods: a deployment step, so that a serving "
                                 "process loads its kernels instead of compiling them in its first prefill.")
    parser.add_argument("--head-dim", type=int, help=f"attention head dim d (a multiple of 4 in 4..{MAX_HEAD_DIM}); "
                                                     "with --group-size")
    parser.add_argument("--group-size", type=int,
                        help=f"query heads per KV head G (1..{MAX_GROUP_SIZE}); with --head-dim")
    parser.add_argument("--model", action="append", default=[],
                        help="a transformers config to read d and G from: a folder, a config.json, or a hub id already "
                             "in the local cache (nothing is downloaded); may repeat")
    parser.add_argument("--methods", type=lambda text: tuple(split_specs(text)), default=None,
                        help="comma-separated method specs as FathomCache's: fathom@48, sparq@68 (4.25·r bits), dense "
                             "(default: every method)")
    parser.add_argument("--levels", action="store_true",
                        help="the plane methods' scans through reconstruction tables (FathomCache's "
                             "levels='calibrated'), instead of the midpoints")
    return parser


def model_shape(source: str) -> tuple[int, int]:
    """``(d, G)`` of the transformers config at ``source`` (folder, ``config.json`` or cached hub id), read as
    FathomCache reads a model's (:meth:`ModelShape.of_config`); nothing is downloaded."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"--model {source}: reading a model's config needs transformers (pip install "
                         "'fathom[real]'); or give --head-dim and --group-size") from None
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"--model {source}: no transformers config there or in the local cache ({reason})") from None
    try:
        shape = ModelShape.of_config(config)
        check_shape(shape.head_dim, shape.group_size)
    except ValueError as error:
        raise ValueError(f"--model {source}: FathomCache cannot run this model: {error}") from None
    return shape.head_dim, shape.group_size


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every ``(d, G)`` the arguments name, each once, checked; ValueError names the argument."""
    if (args.head_dim is None) != (args.group_size is None):
        raise ValueError("--head-dim and --group-size go together: give both (or --model)")
    shapes = []
    if args.head_dim is not None:
        try:
            check_shape(args.head_dim, args.group_size)
        except ValueError as error:
            raise ValueError(f"--head-dim / --group-size: {error}") from None
        shapes.append((args.head_dim, args.group_size))
    shapes += [model_shape(source) for source in args.model]
    if not shapes:
        raise ValueError("nothing to warm: give --head-dim and --group-size, or --model")
    return list(dict.fromkeys(shapes))


def main(argv: list[str] | None = None) -> None:
    """The command: bad arguments print one ``error: …`` line and exit 2, before any kernel work; then each shape's
    warm-up, what it compiled or loaded, and where Numba's cache lives."""
    try:
        args = argument_parser().parse_args(sys.argv[1:] if argv is None else argv)
        shapes = shapes_of(args)
        for d, _ in shapes:
            for spec in args.methods or ():
                try:
                    method_of(spec, d)
                except ValueError as error:
                    raise ValueError(f"--methods: {error}") from None
        if not kernel_cache.SIMULATED and not torch.cuda.is_available():
            raise ValueError("warming the kernels needs a CUDA GPU (torch.cuda.is_available() is False); "
                             "NUMBA_ENABLE_CUDASIM=1 runs it on the simulator, which compiles nothing")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    start = time.perf_counter()
    for d, g in shapes:
        done = warm_kernels(d, g, args.methods, args.levels)
        print(_report(done), flush=True)
    print(f"warmed in {time.perf_counter() - start:.1f} s; Numba's kernel cache: {kernel_cache.describe()}")


def _report(done: Warmup) -> str:
    width = max(len(spec) for spec in done.methods)
    lines = [f"head dim {done.head_dim}, {done.group_size} query heads per KV head: a prompt of {PROMPTS} tokens "
             "and one decode token per method" + (", the plane scans through reconstruction tables"
                                                  if done.levels else "")]
    lines += [f"  {spec:<{width}}  {seconds:6.2f} s  (then held {held})"
              for spec, seconds, held in zip(done.methods, done.seconds, done.held)]
    if not done.kernels:
        lines.append("  no kernel compiled or loaded" + (" (the CUDA simulator compiles nothing)"
                                                         if kernel_cache.SIMULATED else " (all were in memory)"))
        return "\n".join(lines)
    lines.append(f"  kernels: {done.compiled} signatures compiled and written to the cache, {done.loaded} loaded "
                 "from it")
    width = max(len(name) for name in done.kernels)
    lines += [f"    {name:<{width}}  " + ", ".join(f"{count} {what}" for count, what in
                                                  ((use.compiled, "compiled"), (use.loaded, "loaded")) if count)
              for name, use in done.kernels.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
