#!/usr/bin/env bash
# There, after the model is staged (../shared/tools/stage_to_device.py): `python -m bench fidelity` at CONTEXT
# (default 32768) tokens on the GPU,
# one run per "NAME:ARGS" spec, each run's JSON / MD / PNG / calibration and log in one tar under $OUT (a call
# brings back at most 8 files). A run starts only while MINLEFT s of the call's LIMIT s remain (a Qwen-1.5B run
# takes ~7 min with its conversion, a Qwen-0.5B one ~2.5, Gemma-3's ~1.2).
# usage: MODEL=qwen2.5-coder-1.5b bash scripts/gpu/fidelity.sh "paul-graham:--corpus paul-graham" \
#          "cpython-levels:--corpus cpython --levels"
set -uo pipefail
source scripts/gpu/site.sh
model=${MODEL:-qwen2.5-coder-1.5b}; limit=${LIMIT:-580}; minleft=${MINLEFT:-240}; context=${CONTEXT:-32768}
for spec in "$@"; do
  left=$((limit - SECONDS))
  if [ "$left" -lt "$minleft" ]; then echo "skipped ${spec%%:*}: ${left} s left"; continue; fi
  name=fidelity-$model-$((context / 1024))k-${spec%%:*}
  mkdir -p /tmp/fr && rm -f /tmp/fr/"$name".*
  # shellcheck disable=SC2086  # the spec's arguments split on spaces
  timeout "$((left - 10))" python3 -m bench fidelity --model "$model" --context "$context" --device cuda --out /tmp/fr \
    --name "$name" ${spec#*:} > /tmp/fr/"$name".log 2>&1
  echo "$name: rc=$? in ${SECONDS} s"; tail -5 /tmp/fr/"$name".log
  tar -C /tmp/fr -cf "$OUT/$name.tar" $(cd /tmp/fr && ls "$name".*)
done
