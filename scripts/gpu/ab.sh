#!/usr/bin/env bash
# A/B of whole trees on one machine: the same `python -m bench timing` run from each tree in turn.
#   here:  bash scripts/gpu/ab.sh prepare REV...   -> .ab/<rev>/{fathom,bench} (git archive, no bench/results),
#          then carry .whl and each .ab/<rev> (git-excluded) with the call
#   there: bash scripts/gpu/ab.sh run NAME [bench timing arguments...]
#          -> $OUT/timing-NAME-<rev>.json for every tree under .ab/, each run cut at an equal share of LIMIT s
#             (default 560); draw them here with python -m bench timing --replot ... as timing.sh says
# Each tree runs from its own directory (the current one comes first on sys.path), so its fathom is the one imported.
set -uo pipefail
case ${1:-} in
  prepare)
    shift
    grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
    for rev in "$@"; do
      dir=.ab/${rev//\//-}
      rm -rf "$dir" && mkdir -p "$dir" && git archive "$rev" fathom bench | tar -x -C "$dir" && rm -rf "$dir"/bench/results
      echo "$dir: $(git rev-parse --short "$rev")"
    done ;;
  run)
    name=${2:?usage: bash scripts/gpu/ab.sh run NAME [timing arguments...]}; shift 2
    source scripts/gpu/site.sh
    trees=(.ab/*/)
    limit=${LIMIT:-560}
    for i in "${!trees[@]}"; do
      tree=${trees[$i]%/}; label=${tree#.ab/}
      share=$(( (limit - SECONDS) / (${#trees[@]} - i) ))
      (cd "$tree" && timeout "$share" python3 -m bench timing "$@" --out /tmp/timing --name "$name-$label" 2>&1 \
        | grep -E "^\| [0-9]|wrote|error") && cp /tmp/timing/timing-"$name-$label".json "$OUT"/ \
        || echo "error: $tree did not finish in $share s" >&2
      echo "$label done at $SECONDS s"
    done ;;
  *) echo "usage: bash scripts/gpu/ab.sh prepare REV... | run NAME [timing arguments...]" >&2; exit 2 ;;
esac
