"""A device experiment, committed with the kernel it tried and removed after (docs/results.md, 2026-12-06): the two
candidate passes of ``fathom.cuda.topk.select`` timed apart at one layer of the timing bench's shape, for variants of
``_candidates_kernel`` made by editing its source, beside a torch read (``amax``) of the same scores, to find what
holds the passes at a third of HBM's rate. Every variant's level-0 histogram and level-1 candidate counts are checked
equal to the first's. ``old``: the kernel at f7f935a; ``new``: this tree's (each thread's first scores loaded before
the k-th's digits are found, both histograms staged before one barrier); ``-8`` / ``-2``: scores a thread loads
before it uses any; ``no-hist``: level 0 without its second-byte histogram (level 1's counts then wrong: timing
only); ``match-any``: the histogram's adds aggregated per warp (``match_any_sync``); ``hi16``: the passes read the
order keys' top halves (uint16, made here in torch), the candidates' low halves read only where appended.
Run from the project root on the GPU: ``PYTHONPATH=. python scripts/gpu/exp_candidate_passes.py 1 16``."""
import os, statistics, subprocess, sys, types
import numpy as np, torch
from numba import cuda
from bench.select_probe import SelectionBuffers, SINK, LOCAL
from fathom.cuda.interop import as_array
from fathom.quantize import BLOCK

REPS, REPLAYS = 20, 5

def variant(name, src_path, edits, consts=None):
    src = (subprocess.run(["git", "show", src_path], capture_output=True, text=True, check=True).stdout
           if ":" in src_path else open(src_path).read()).replace("@cuda.jit(cache=True)", "@cuda.jit")
    for a, b in edits:
        assert a in src, (name, a)
        src = src.replace(a, b)
    mod = types.ModuleType("v_" + name)
    mod.__file__ = "fathom/cuda/topk.py"
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    for k, v in (consts or {}).items():
        setattr(mod, k, v)
    return mod

NEW = "fathom/cuda/topk.py"
OLD = "f7f935a:fathom/cuda/topk.py"
RUN = "                        last, run = _add_run(hist, second, last, run)\n"
variants = {
    "old": variant("old", OLD, []),
    "new": variant("new", NEW, []),
    "new-8": variant("new8", NEW, [], {"SCORES_IN_FLIGHT": 8}),
    "new-2": variant("new2", NEW, [], {"SCORES_IN_FLIGHT": 2}),
    "no-hist": variant("nohist", NEW, [(RUN, "                        matches = np.int32(matches + second)\n"),
                                      ("    if level == 0:\n        if run:", "    if matches == 123456789:\n        hist[0] = 1\n    if level == 0:\n        if run:")]),
}
HI = [("def _candidates_kernel(score_bits, ", "def _candidates_kernel(score_bits, lo_bits, "),
      ("            keys[u] = order_key(scores[j]) if j < end else np.uint32(0)",
       "            keys[u] = (np.uint32(scores[j]) << np.uint32(16)) if j < end else np.uint32(0)"),
      ("        key = order_key(scores[j])\n        if key >> np.uint32(16) == bin_:",
       "        key = np.uint32(scores[j]) << np.uint32(16)\n        if key >> np.uint32(16) == bin_:\n            key = key | np.uint32(lo_bits[g, h, j])"),
      ]
variants["hi16"] = variant("hi16", OLD, HI, {"HI": True})
variants["hi16-8"] = variant("hi168", OLD, HI, {"SCORES_IN_FLIGHT": 8, "HI": True})
if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":  # the simulator has no match_any_sync
    variants["match-any"] = variant("match", NEW, [(RUN, "                        peers = cuda.match_any_sync(cuda.activemask(), second)\n"
                                             "                        if (peers & ((np.uint32(1) << (np.uint32(t) & np.uint32(31))) - np.uint32(1))) == 0:\n"
                                             "                            cuda.atomic.add(hist, second, cuda.popc(peers))\n")])

def level_graph(mod, sel, level, per_block=8192, threads=256):
    a = lambda x: as_array(x)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    streams, heads, tokens = sel.scores.shape
    chunks = (-(-tokens // per_block), heads, streams)
    args = lambda: (a(sel.scores).view(np.uint32), a(sel.lengths), sel.kv_heads, sel.k, SINK, LOCAL, per_block)
    rest = lambda: (a(sel.top_hist), a(sel.hist2), a(sel.winners).view(np.uint32), a(sel.any_rows).view(np.uint64),
                    a(sel.cand_key).view(np.uint32), a(sel.cand_idx), a(sel.cand_count))
    sel.top_hist.copy_(sel.saved_hist); sel.hist2.zero_(); sel.cand_count.zero_()
    if getattr(mod, "HI", False):
        keys = torch.where(sel.scores.view(torch.int32) < 0, ~sel.scores.view(torch.int32),
                           sel.scores.view(torch.int32) | torch.tensor(-2**31, dtype=torch.int32, device=sel.scores.device))
        keys = torch.where(sel.scores.view(torch.int32) == -2**31, torch.full_like(keys, -2**31), keys)
        hi, lo = (keys >> 16).to(torch.int16).contiguous(), (keys & 0xFFFF).to(torch.int16).contiguous()
        args = lambda: (a(hi).view(np.uint16), a(lo).view(np.uint16), a(sel.lengths), sel.kv_heads, sel.k, SINK, LOCAL, per_block)
    mod._candidates_kernel[chunks, threads, stream](*args(), 0, *rest())  # compile + fill hist2
    if level == 1:
        mod._candidates_kernel[chunks, threads, stream](*args(), 1, *rest())
    torch.cuda.synchronize()
    saved2 = sel.hist2.clone()
    g = torch.cuda.CUDAGraph()
    with cuda.defer_cleanup(), torch.cuda.graph(g):
        cap = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        for _ in range(REPS):
            if level == 1:
                sel.cand_count.zero_()
            mod._candidates_kernel[chunks, threads, cap](*args(), level, *rest())
    times = []
    for _ in range(REPLAYS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / REPS)
    counts = sel.cand_count.clone()
    sel.hist2.copy_(saved2)
    return statistics.median(times), saved2, counts

def bytes_read(sel):
    n = sel.lengths.to(torch.int64).repeat_interleave(sel.kv_heads)
    hi = torch.minimum(n // BLOCK * BLOCK, n - LOCAL) - SINK
    return int(hi.clamp(min=0).sum()) * sel.scores.shape[1] * 4

def smoke():
    """Under the simulator (``NUMBA_ENABLE_CUDASIM=1 ... smoke``): each variant that selects on the scores themselves
    counts the old kernel's level-0 histogram and level-1 candidates."""
    ref = {}
    sel = SelectionBuffers(4096, 2, kv_heads=1, k=40)
    streams, heads, tokens = sel.scores.shape
    a = as_array
    for name, mod in variants.items():
        if getattr(mod, "HI", False) or name == "no-hist":  # hi16 reads keys made in torch; no-hist times only
            continue
        sel.top_hist.copy_(sel.saved_hist); sel.hist2.zero_(); sel.cand_count.zero_()
        for level in (0, 1):
            mod._candidates_kernel[(-(-tokens // 1024), heads, streams), 64](a(sel.scores).view(np.uint32), a(sel.lengths), 1, 40, SINK, LOCAL, 1024, level, a(sel.top_hist), a(sel.hist2), a(sel.winners).view(np.uint32), a(sel.any_rows).view(np.uint64), a(sel.cand_key).view(np.uint32), a(sel.cand_idx), a(sel.cand_count))
        got = (sel.hist2.clone(), sel.cand_count.clone())
        ref.setdefault("x", got)
        print(name, [bool(torch.equal(x, y)) for x, y in zip(got, ref["x"])], int(got[1].sum()), flush=True)
        sel.rows(0)


if sys.argv[1:] == ["smoke"]:
    smoke()
    sys.exit()
for sessions in [int(x) for x in sys.argv[1:]] or [1, 16]:
    sel = SelectionBuffers(131072, sessions)
    nbytes = bytes_read(sel)
    # a plain read of the same scores (torch): what a pass could cost
    flat = sel.scores
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3): flat.amax()
    torch.cuda.synchronize(); s.record()
    for _ in range(REPS): flat.amax()
    e.record(); torch.cuda.synchronize()
    full = flat.numel() * 4
    print(f"{sessions} sessions: {nbytes/1e6:.1f} MB of candidates a pass; torch amax over all {full/1e6:.1f} MB: "
          f"{s.elapsed_time(e)*1e3/REPS:.1f} µs ({full/(s.elapsed_time(e)*1e-3/REPS)/1e12:.2f} TB/s)", flush=True)
    ref = {}
    for name, mod in variants.items():
        out, same = [], []
        for level in (0, 1):
            us, h2, counts = level_graph(mod, sel, level)
            out.append(us)
            got = h2 if level == 0 else counts
            if name != "no-hist":
                ref.setdefault(level, got)
                same.append(bool(torch.equal(got, ref[level])))
        print(f"  {name:10s} level0 {out[0]:7.1f} µs ({nbytes/(out[0]*1e-6)/1e12:.2f} TB/s)  level1 {out[1]:7.1f} µs "
              f"({nbytes/(out[1]*1e-6)/1e12:.2f} TB/s)  same as old: {same}", flush=True)
    sel.rows(cuda.external_stream(torch.cuda.current_stream().cuda_stream))
    del sel; torch.cuda.empty_cache()
