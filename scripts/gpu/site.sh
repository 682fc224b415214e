# There, sourced first by every script here: the carried wheels into /tmp/site, once per warm machine (a later call
# need not carry .whl), and PYTHONPATH pointing at them.
if [ ! -e /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.ok || { echo "error: carry .whl (bash scripts/gpu/wheels.sh here)" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site FATHOM_CACHE=/tmp/fathom-cache
