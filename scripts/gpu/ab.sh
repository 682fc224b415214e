#!/usr/bin/env bash
# A/B of whole trees on one machine: the same `python -m bench timing` run from each tree in turn.
#   here:  bash scripts/gpu/ab.sh prepare REV...   -> .ab/<rev>/{fathom,bench,tests,pyproject.toml} (git archive, no
#          bench/results), then carry .whl and .ab (git-excluded) with the call
#   there: bash scripts/gpu/ab.sh run NAME [bench timing arguments...]
#          -> $OUT/timing-NAME-<rev>.json for every tree under .ab/ (or those TREES names, in its order), each run
#             cut at an equal share of LIMIT s (default 560); draw them here with python -m bench timing --replot ...
#             as timing.sh says
#   there: bash scripts/gpu/ab.sh test TREE [pytest paths...]
#          -> the GPU tests from .ab/TREE's own tree and tests (default: the scan, the selection, the decoder, the
#             integrations and the selection probe; ~85 s on an H100 with 8 workers), cut at TIMEOUT s (default 200)
# Each tree runs from its own directory (the current one comes first on sys.path), so its fathom is the one imported.
# Its kernels are cached under /tmp/numba-ab (NUMBA_CACHE_DIR; one folder a tree's path): a carried tree replaces
# the one there, and with it a cache beside its sources, so every call would compile its kernels again.
# A tree's run on an H100 that compiled its kernels (2026-12-06): 128k x 1 --reps 3 ~50 s (give it 60), 16 x 128k
# --reps 2 ~75 s, 1M x 1 --reps 3 ~35 s for fathom@48 and ~50 s with double-sparsity@136 beside it. On a machine's
# first call compiling takes longer: 16 x 128k cut at 83 s in all three trees (fourteenth session); start with 1M.
# Once the kernels are cached: 128k x 1 ~34 s, 16 x 128k ~67 s, 1M x 1 with DS-136 ~45 s.
# Three trees, all three settings, 1M first, fit one call on a fresh machine: 504 s on an H100 (fifteenth session:
# 1M with DS-136 62-66 s a tree, then 128k x 1 34 s and 16 x 128k 70 s).
# Sixteenth session: two trees, all three settings and one tree's GPU tests in one call on a fresh machine cut the
# 1M and 16-session runs while they compiled (LIMIT 140 and 155); a later call must carry .ab again (without it the
# machine's .ab lacked a tree), and carried trees compile again: give a fresh or re-carried pair LIMIT 200 at 1M and
# 220 at 16 sessions (they took 108 and 160 s).
# Eighteenth session, a fresh H100: two trees at 16 x 128k (LIMIT 230) then 128k x 1 (LIMIT 110), and one tree's scan and
# decoder tests, in one call of 281 s (16 sessions 90 and 87 s a tree, compiling; 128k x 1 37 s each).
# Nineteenth session, a fresh H100: two trees at 16 x 128k (LIMIT 240, --reps 3) then 128k x 1 (LIMIT 110) in one call
# of 312 s (16 sessions 101 and 121 s a tree, compiling; 128k x 1 46 and 43 s).
# Twentieth session, fresh H100s: four trees at 16 x 128k (LIMIT 560, --reps 3) in one call of 434 s (94-117 s a tree,
# compiling); three trees at 16 x 128k (LIMIT 370) then 128k x 1 (LIMIT 160) in one call of 430 s; two trees at
# 16 x 128k with LIMIT 240 cut the second at its 120-s share while it compiled (the first took 120): give a pair 280.
# Twenty-first session, fresh H100s: one tree's selection tests (31 s) then three trees at 16 x 128k (LIMIT 330: 90-98 s a
# tree, compiling) and 128k x 1 (LIMIT 130: 36-43 s) in one call of 435 s. A tree's full `test` (~125 s) before the timing
# runs compiles into the tree's own cache, not /tmp/numba-ab: the runs compile again (LIMIT 240 cut both of a pair).
# Twenty-third session, a fresh H100: four trees at 16 x 128k (LIMIT 460, --reps 3) were all cut at their ~114-s shares
# while compiling (give a fresh machine's tree >= 150 s); the next call on the warm machine, .ab carried again, ran the
# same four in 80 s each (321 s: the carried trees' kernels were found in /tmp/numba-ab), a new tree beside a cached
# one in 108 s, and `test` of one tree took 147 s.
# Twenty-fourth session, a fresh H100 after four refused starts (~650 s of the session's device time): two trees at
# 16 x 128k (LIMIT 380: 140 and 123 s, compiling) then 128k x 1 (LIMIT 120: 52 and 50 s) in one call of 365 s; a third
# carried tree at 16 x 128k alone (TREES) in 129 s; cached trees at 128k x 1 50 s, 1M x 1 (fathom@48 at k = 512 and
# 2048) 54 s each, and `test` of four test files 63 s.
# Twenty-fifth session, a fresh H100 (after one refused H200 start, 91 s): three trees at 16 x 128k (LIMIT 480: 109, 99
# and 106 s a tree, compiling) in one call of 314 s; a fourth carried tree and two cached ones at 16 x 128k in 93, 65
# and 67 s; the throughput table's four runs from a cached tree (fathom@48 and DS-136) in 350 s; `test` of one tree
# (the default files) 98 s; two cached trees at 1M x 1 then 128k x 1 in 168 s.
# Twenty-sixth session, a fresh H100 (after ~480 s of refused starts, the start itself ~540 s): two trees at 16 x 128k
# (LIMIT 340: 134 and 118 s, compiling) then 1M x 1 (LIMIT 130: 49 and 53 s) in one call of 354 s; `test` of one tree
# 137 s; the pair again, cached and in reversed order (TREES), 77 + 78 s at 16 x 128k and 48 + 49 s at 1M.
# Twenty-seventh session: no machine lent (three calls refused or failed to start, ~270 s of device time). Prepared
# for the next: main, try-seal3, try-miss-early2, try-set-rows (the 16-session lengths now staggered in every tree).
# Four fresh trees at 16 x 128k need ~600 s compiling: three in one call (LIMIT 480), then on the warm machine
# TREES="try-set-rows main" at 16 x 128k (LIMIT 300) and all four cached at 128k x 1 (LIMIT 240).
# Trees run in the order of their folders' names: to time main last as well as first, rename .ab/main (e.g. zmain).
# The throughput table's three settings, as the A/Bs of 2026-12-06 ran them (C: what they share):
#   C="--hbm-planes 2 --modes graph --row-cache-rows 32768 --kernels --regimes host"
#   LIMIT=120 bash scripts/gpu/ab.sh run k128 $C --methods fathom@48 --host-gb 90 --contexts 131072 --sessions 1 --reps 3
#   LIMIT=170 bash scripts/gpu/ab.sh run k16 $C --methods fathom@48 --host-gb 90 --contexts 131072 --sessions 16 --reps 2
#   LIMIT=120 bash scripts/gpu/ab.sh run m1 $C --methods fathom@48,double-sparsity@136 --host-gb 40 \
#     --contexts 1048576 --sessions 1 --reps 3
# (LIMIT for two trees; scale it with their number.)
set -uo pipefail
case ${1:-} in
  prepare)
    shift
    grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
    for rev in "$@"; do
      dir=.ab/${rev//\//-}
      rm -rf "$dir" && mkdir -p "$dir" && git archive "$rev" fathom bench tests pyproject.toml | tar -x -C "$dir" \
        && rm -rf "$dir"/bench/results
      echo "$dir: $(git rev-parse --short "$rev")"
    done ;;
  run)
    name=${2:?usage: bash scripts/gpu/ab.sh run NAME [timing arguments...]}; shift 2
    source scripts/gpu/site.sh
    trees=(.ab/*/)
    if [ -n "${TREES:-}" ]; then trees=(); for t in $TREES; do trees+=(".ab/$t/"); done; fi  # a subset, in this order
    limit=${LIMIT:-560}
    for i in "${!trees[@]}"; do
      tree=${trees[$i]%/}; label=${tree#.ab/}
      share=$(( (limit - SECONDS) / (${#trees[@]} - i) ))
      json=/tmp/timing/timing-$name-$label.json
      rm -f "$json"  # an earlier call's file of this name is never taken for this run's
      (cd "$tree" && NUMBA_CACHE_DIR=/tmp/numba-ab timeout "$share" \
          python3 -m bench timing "$@" --out /tmp/timing --name "$name-$label" 2>&1 | grep -E "^\| [0-9]|wrote|error")
      # the JSON is written once, when the run is done: a run cut in its teardown still counts
      if [ -e "$json" ]; then cp "$json" "$OUT"/; else echo "error: $tree did not finish in $share s" >&2; fi
      echo "$label done at $SECONDS s"
    done ;;
  test)
    tree=.ab/${2:?usage: bash scripts/gpu/ab.sh test TREE [pytest paths...]}; shift 2
    [ -d "$tree/tests" ] || { echo "error: $tree has no tests (bash scripts/gpu/ab.sh prepare REV here)" >&2; exit 2; }
    source scripts/gpu/site.sh
    paths=("$@"); [ ${#paths[@]} -gt 0 ] || paths=(tests/cuda/test_scan.py tests/cuda/test_topk.py
      tests/cuda/test_host_decoder.py tests/integrations tests/bench/test_select_probe.py tests/bench/test_sass.py)
    # from the tree's own directory: its fathom is the one imported (the current directory comes first on sys.path)
    (cd "$tree" && python3 -c "import fathom; print('testing', fathom.__file__)" && FATHOM_GPU=1 timeout "${TIMEOUT:-200}" \
        python3 -m pytest -q -n 8 -p no:cacheprovider "${paths[@]}" 2>&1 | grep -v Warning | tail -4) ;;
  *) echo "usage: bash scripts/gpu/ab.sh prepare REV... | run NAME [timing arguments...] | test TREE [pytest paths...]" >&2
     exit 2 ;;
esac
