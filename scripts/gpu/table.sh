#!/usr/bin/env bash
# There: the README's throughput table in one call, its four `bench timing` runs (fathom@48 and DS-136, graph mode,
# the store's top 2 planes in HBM, a 32,768-row cache, --kernels): 16 ragged sessions of 128k on the host store, one
# 128k session on both stores, one 1M session, 16 sessions on the HBM store; each JSON under $OUT as
# timing-table-*.json. From TREE (an .ab/ folder: a revision other than the checkout's, its kernels cached under
# /tmp/numba-ab as ab.sh caches them) or from the checkout. A run is cut at its share and starts only while that share
# of LIMIT s (default 560) remains.
# Here, after the call (the JSONs from $OUT):
#   python -m bench timing --replot timing-table-k128.json timing-table-k16.json timing-table-m1.json \
#     timing-table-k16-hbm.json --out bench/results --name throughput-<gpu>-<rev> --readme README.md
# Twenty-fifth session, a warm H100 with the tree's kernels cached: 103, 105, 44 and 98 s (350 s in all).
# usage: [TREE=.ab/REV] [LIMIT=560] bash scripts/gpu/table.sh
set -uo pipefail
source scripts/gpu/site.sh
timing=$PWD/scripts/gpu/timing.sh
limit=${LIMIT:-560}
if [ -n "${TREE:-}" ]; then
  cd "$TREE" || exit 2
  export NUMBA_CACHE_DIR=/tmp/numba-ab
fi
common=(--hbm-planes 2 --modes graph --methods fathom@48,double-sparsity@136 --row-cache-rows 32768 --kernels)
run() {  # NAME SECONDS ARGS...: one timing.sh run, cut at SECONDS, skipped when fewer remain of the call
  local name=$1 share=$2; shift 2
  if [ $((limit - SECONDS)) -lt "$share" ]; then echo "skipped $name: $((limit - SECONDS)) s left"; return; fi
  TIMEOUT=$share bash "$timing" "$name" "${common[@]}" "$@" | grep -E "^\| [0-9]|wrote|error"
  echo "$name done at $SECONDS s"
}
run table-k16 210 --regimes host --reps 2 --host-gb 90 --contexts 131072 --sessions 16
run table-k128 120 --regimes host,hbm --reps 3 --host-gb 90 --contexts 131072 --sessions 1
run table-m1 100 --regimes host --reps 3 --host-gb 40 --contexts 1048576 --sessions 1
run table-k16-hbm 150 --regimes hbm --reps 3 --host-gb 90 --contexts 131072 --sessions 16
