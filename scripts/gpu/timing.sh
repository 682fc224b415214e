#!/usr/bin/env bash
# There: one `python -m bench timing` run named NAME; its JSON (which records the command) comes back under $OUT.
# Draw its table and plot here: python -m bench timing --replot $OUT/timing-NAME.json --out bench/results --name NAME
# usage: bash scripts/gpu/timing.sh NAME [bench timing arguments...] (from any folder holding a tree's bench and
# fathom, e.g. an .ab/ tree: the run imports the current folder's)
set -uo pipefail
source "$(dirname "$0")"/site.sh
name=$1; shift
# TIMEOUT (s): the run is cut there, so that a call's limit never loses what came before it
rm -f /tmp/timing/timing-"$name".json  # an earlier call's file of this name is never taken for this run's
timeout "${TIMEOUT:-600}" python3 -m bench timing "$@" --out /tmp/timing --name "$name" 2>&1 | tail -40
cp /tmp/timing/timing-"$name".json "$OUT"/ || echo "error: timing-$name.json not written" >&2
