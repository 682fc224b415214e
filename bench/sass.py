"""The plane scan's machine code read without a GPU: registers, spills and its per-channel loop's instructions.

``python -m bench.sass --heads 1 4 8`` compiles ``fathom.cuda.scan``'s kernel for sm_90 with Numba's own compiler
(libnvvm, as the kernels are built on a GPU), assembles it with ``ptxas`` and disassembles it with ``nvdisasm``
(the toolkit's holding the libnvvm Numba uses, else ``$CUDA_HOME``'s, the ``nvidia-cuda-nvcc`` and
``nvidia-cuda-nvdisasm`` wheels' (``pip install -e '.[sass]'``) or ``PATH``'s). It prints, per G, ptxas's registers and spills and
the per-channel loop — the innermost loop holding the accumulating FMAs — as ``fixed + per_plane · (b − 1)``
instructions a channel and warp: the loops nested in it are the plane loops, each run b − 1 times for a channel read
to depth b (the scan reads plane 0 of every active channel before its plane loop: ``fixed`` holds it), and that per
token a lane (a warp's lane scores two tokens of each of its blocks), the figure to compare across launch shapes.
It also counts the global loads whose data is spilled at once (a spill store reads the load's register,
so the warp waits for the load there): the scan's held chunk words, which should stay in flight while it scores.
The instruction count is what a change to the inner loop must lower at the same warps an SM (fewer instructions
at half the warps made the scan slower, docs/results.md); the time it saves is measured on the GPU
(``bench timing``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCH = "sm_90"  # the H200's
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?\.?(L_x_\d+)")


@dataclass(frozen=True)
class ChannelLoop:
    """The per-channel loop of a warp's blocks: ``fixed + per_plane · (b − 1)`` instructions for a channel read to
    depth b ≥ 1 (plane 0 is read before the ``plane_loops`` loops of ``per_plane`` instructions in all, each run
    b − 1 times)."""

    fixed: int
    per_plane: int
    plane_loops: int

    def instructions(self, depth: int) -> int:
        """Instructions a channel read to ``depth`` (≥ 1) costs a warp."""
        return self.fixed + self.per_plane * (depth - 1)


def find_tool(name: str) -> Path:
    """A CUDA toolkit binary, first from the toolkit holding the libnvvm Numba compiles with (so ``ptxas`` reads
    the PTX version it writes), then under ``$CUDA_HOME`` / ``$CUDA_PATH``, in an ``nvidia-*`` wheel, on ``PATH``."""
    from numba.cuda.cuda_paths import get_cuda_paths

    nvvm = get_cuda_paths()["nvvm"].info
    roots = list(Path(nvvm).parents)[:3] if nvvm else []
    roots += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        roots += sorted(p for location in spec.submodule_search_locations for p in Path(location).glob("cu*"))
    for root in roots:
        if (root / "bin" / name).is_file():
            return root / "bin" / name
    found = shutil.which(name)
    if found:
        return Path(found)
    raise FileNotFoundError(f"{name} not found beside Numba's libnvvm, under $CUDA_HOME, in an nvidia wheel or on "
                            "PATH (pip install -e '.[sass]')")


def instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """``nvdisasm -c`` text -> ([(address, instruction)], {label: address of the instruction it marks})."""
    listing, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        match = _INSTRUCTION.match(line)
        if match:
            address = int(match.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            listing.append((address, match.group(2)))
    return listing, labels


def loops(listing: list[tuple[int, str]], labels: dict[str, int]) -> list[tuple[int, int]]:
    """Every loop as (first, last) indices into ``listing``: a branch back to a label at or before it."""
    index = {address: i for i, (address, _) in enumerate(listing)}
    found = []
    for i, (address, text) in enumerate(listing):
        branch = _BRANCH.search(text)
        if branch and labels.get(branch.group(1), address + 1) <= address:
            found.append((index[labels[branch.group(1)]], i))
    return sorted(found)


def channel_loop(sass: str) -> ChannelLoop:
    """The innermost loop holding FFMAs (the accumulation over a channel's blocks and heads), split into the plane
    loops nested in it and the rest."""
    listing, labels = instructions(sass)
    spans = loops(listing, labels)

    def holds_fma(span):
        return any(text.split()[0].startswith("FFMA") for _, text in listing[span[0]:span[1] + 1])

    candidates = [s for s in spans if holds_fma(s)]
    if not candidates:
        raise ValueError("no loop holds an FFMA: not the scan kernel's SASS")
    first, last = min(candidates, key=lambda s: s[1] - s[0])
    nested = [(a, b) for a, b in spans if first < a and b < last]
    per_plane = sum(b - a + 1 for a, b in nested)
    return ChannelLoop(fixed=last - first + 1 - per_plane, per_plane=per_plane, plane_loops=len(nested))


def loads_spilled(listing: list[tuple[int, str]]) -> int:
    """Spill stores (``STL``) of a register whose nearest earlier write in the listing is a global load (``LDG``):
    the store reads the load's data, so the warp waits there for the load as if it had used it at once. In the scan,
    the next chunk's words held while the current one is scored: each one spilled is a load not in flight."""
    count = 0
    for i, (_, text) in enumerate(listing):
        opcode, operands = _opcode_and_operands(text)
        if not opcode.startswith("STL") or not operands:
            continue
        register = operands[-1].split()[0]
        for _, earlier in reversed(listing[:i]):
            earlier_opcode, earlier_operands = _opcode_and_operands(earlier)
            if earlier_operands and earlier_operands[0] == register:
                count += earlier_opcode.startswith("LDG")
                break
    return count


def _opcode_and_operands(text: str) -> tuple[str, list[str]]:
    """``@!P0 LDG.E.64 R28, desc[UR22][R28.64]`` -> ("LDG.E.64", ["R28", "desc[UR22][R28.64]"]) (a predicate
    dropped)."""
    words = text.split(None, 1)
    if words and words[0].startswith("@"):
        words = words[1].split(None, 1) if len(words) > 1 else []
    if not words:
        return "", []
    return words[0], [operand.strip() for operand in words[1].split(",")] if len(words) > 1 else []


def scan_shape(heads: int, cap: int = 128, warps: int | None = None) -> tuple[int, int, int]:
    """(CTAs an SM, warps, blocks a warp) of the scan kernel ``scan_planes`` launches for ``heads`` query heads a KV
    head, ``cap``-block segments and at most ``warps`` warps (None: the decoder's)."""
    from fathom.cuda import scan

    warps = scan.SCAN_WARPS if warps is None else warps
    return (scan.resident_ctas(heads, cap, warps),) + scan.launch_shape(heads, cap, warps)


def scan_kernel_sass(heads: int, cap: int = 128, warps: int | None = None, levels: bool = False) -> tuple[str, str]:
    """The scan kernel for ``heads`` query heads a KV head (as ``scan_planes`` launches it for ``cap``-block
    segments and at most ``warps`` warps, :func:`scan_shape`; ``levels``: the one reading reconstruction tables)
    compiled for :data:`ARCH` -> (nvdisasm's listing, ptxas's report)."""
    from numba import cuda
    from numba import types as T

    from fathom.cuda import scan
    from fathom.cuda.interop import launch_bounds

    resident, warps, per_warp = scan_shape(heads, cap, warps)
    kernel = scan._scan_kernel(heads, warps, per_warp, levels, resident)
    f32, i64, keys = T.float32[:, :, ::1], T.int64, T.uint32[:, :, :, ::1]
    signature = (f32, T.int8[:, ::1], T.int32[::1], i64, T.uint64[::1], T.uint64[::1]) + (i64,) * 8 \
        + (keys, T.int32[:, :, ::1], T.float32[::1] if levels else f32)  # the midpoint kernel is given q as its table
    # the scan's own bounds (bench.sass never runs under the simulator, which takes none)
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0), **launch_bounds(32 * warps, resident))
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "scan.ptx", Path(tmp) / "scan.cubin"
        source.write_text(ptx)
        report = subprocess.run([find_tool("ptxas"), f"-arch={ARCH}", "-v", source, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        listing = subprocess.run([find_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                                 check=True).stdout
    return listing, report


def _registers_and_spills(report: str) -> tuple[int, int, int]:
    """ptxas -v's (registers, spill store bytes, spill load bytes)."""
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores, loads = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups())
    return registers, stores, loads


def main(argv=None) -> None:
    from bench.cli import plain

    parser = argparse.ArgumentParser(prog="python -m bench.sass", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="query heads a KV head (G), each 1..8 (default 1 2 4 8)")
    parser.add_argument("--cap", type=int, default=128, help="blocks a segment, a power of two 1..128 (default 128)")
    parser.add_argument("--levels", action="store_true",
                        help="the kernel that reads each channel's reconstruction table (default: the midpoints)")
    args = parser.parse_args(argv)
    bad = [g for g in args.heads if not 1 <= g <= 8]
    if bad:
        parser.exit(2, f"error: --heads must each be 1..8, got {bad[0]}\n")
    if not 1 <= args.cap <= 128 or args.cap & (args.cap - 1):
        parser.exit(2, f"error: --cap must be a power of two 1..128, got {args.cap}\n")
    try:
        tools = [find_tool(name) for name in ("ptxas", "nvdisasm")]
    except FileNotFoundError as error:
        parser.exit(2, f"error: {error}\n")
    reads = "reconstruction tables" if args.levels else "midpoints"
    print(f"plane scan through the {reads}, {ARCH} ({', '.join(str(t) for t in tools)})\n")
    print("| G | CTAs an SM × warps × blocks a warp | registers | spill stores / loads (bytes) | global loads "
          "spilled | per-channel loop (instructions a channel and warp) | a lane's token at b = 1 / 2 |")
    print("|---|---|---|---|---|---|---|")
    for heads in args.heads:
        listing, report = scan_kernel_sass(heads, args.cap, levels=args.levels)
        registers, stores, loads = _registers_and_spills(report)
        loop = channel_loop(listing)
        resident, warps, per_warp = scan_shape(heads, args.cap)
        per_token = [loop.instructions(b) / (2 * per_warp) for b in (1, 2)]
        spilled = loads_spilled(instructions(listing)[0])
        print(f"| {heads} | {resident} × {warps} × {per_warp} | {registers} | {stores} / {loads} | {spilled} | "
              f"{loop.fixed} + {loop.per_plane}·(b − 1) | {per_token[0]:.1f} / {per_token[1]:.1f} |")


if __name__ == "__main__":
    main()
