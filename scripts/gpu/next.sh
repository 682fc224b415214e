#!/usr/bin/env bash
# There: issue 14's planned runs, in calls of at most LIMIT s (default 540) each. Parts 1, 2 and 4 time both
# stores: host (t = 2, the table's) and hbm (DS-136's scan then reads only its own channels: its label cache in HBM,
# DS's own design; the README table's "DS-136 in HBM" column).
#   part 1: the GPU tests (TESTS= skips them), then 128k x 1, then 120 cycles of bench soak
#   part 2: 16 ragged sessions of 128k
#   part 3: 128k x 1 at the midpoints and through the calibrated levels, then 16 ragged sessions at the midpoints
#   part 4: 16 ragged sessions through the levels, then 1M x 1 on both stores
# usage: LIMIT=540 bash scripts/gpu/next.sh 1
set -uo pipefail
source scripts/gpu/site.sh
limit=${LIMIT:-540}
common=(--hbm-planes 2 --modes graph --methods fathom@48,double-sparsity@136 --row-cache-rows 32768)
run() {  # NAME MIN_SECONDS ARGS...: one timing run, skipped when fewer than MIN_SECONDS remain
  local name=$1 need=$2; shift 2
  if [ $((limit - SECONDS)) -lt "$need" ]; then echo "skipped $name: $((limit - SECONDS)) s left"; return; fi
  TIMEOUT=$((limit - SECONDS)) bash scripts/gpu/timing.sh "$name" "${common[@]}" "$@"
  echo "$name done at ${SECONDS} s"
}
case ${1:-} in
  1)
    if [ "${TESTS-all}" ]; then
      FATHOM_GPU=1 timeout 300 python3 -m pytest -q -x -n 8 tests/cuda tests/integrations 2>&1 | tail -15
      echo "tests done at ${SECONDS} s"
    fi
    run k128 150 --regimes host,hbm --reps 5 --host-gb 90 --contexts 131072 --sessions 1 --kernels
    if [ $((limit - SECONDS)) -ge 150 ]; then  # the soak after the graph capture's collector fix: never run yet
      python3 -m bench soak --cycles 120 --every 20 --out /tmp/soak 2>&1 | tail -8 && cp /tmp/soak/soak.json "$OUT"/
    else echo "skipped soak: $((limit - SECONDS)) s left"; fi ;;
  2)
    run k16 300 --regimes host,hbm --reps 3 --host-gb 90 --contexts 131072 --sessions 16 --kernels ;;
  3)  # the levels A/B: each kernel beside the midpoint kernel, on the same warm machine
    run k128 90 --regimes host --reps 5 --host-gb 90 --contexts 131072 --sessions 1 --kernels
    run k128-levels 90 --regimes host --reps 5 --host-gb 90 --contexts 131072 --sessions 1 --kernels --levels
    run k16 200 --regimes host --reps 3 --host-gb 90 --contexts 131072 --sessions 16 --kernels ;;
  4)  # the call after part 3
    run k16-levels 200 --regimes host --reps 3 --host-gb 90 --contexts 131072 --sessions 16 --kernels --levels
    run m1 150 --regimes host,hbm --reps 3 --host-gb 40 --contexts 1048576 --sessions 1 --skip-large-k-hbm ;;
  *) echo "usage: bash scripts/gpu/next.sh 1|2|3|4" >&2; exit 2 ;;
esac
