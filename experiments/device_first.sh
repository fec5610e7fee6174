#!/bin/bash
# The first, short call on a lent GPU, about 4 minutes; step limits sum to 300 s:
#
#   1. setup/env: the carried wheels; the device and the jax version       (40 + 20 s)
#   2. smoke:     experiments/device_smoke.py, a small mosaic_gpu causal fwd+bwd against the
#                 reference (head dims 64 and 128, softmax and sigmoid): catches hangs and
#                 barrier races                                              (90 s)
#   3. bench16k:  experiments/bench.py --suite gpu at T = 16384 for softmax and sigmoid,
#                 beside cuDNN                                               (150 s)
#
#   ../shared/device/wheels.sh
#   run(command="bash experiments/device_first.sh", carry=[".whl"], timeout_s=360)
#
# If it passes, the long call is experiments/device_run.sh (check --kernel all --ship and the
# full gpu bench). Each step runs under `timeout` and writes to $OUT as it goes
# ($OUT/steps.tsv: how each ended; 124 = its timeout).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export ATTNJAX_CACHE_DIR=${ATTNJAX_CACHE_DIR:-$OUT/attnjax_cache}
start=$(date +%s)
printf 'step\trc\tseconds\n' > "$OUT/steps.tsv"

step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (limit ${limit} s, $(( t0 - start )) s into the run): $*"
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.tsv"
  return $rc
}

if ls .whl/*.whl > /dev/null 2>&1; then
  step setup 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
step env 20 bash -c 'nvidia-smi -L; "$0" -c "import jax; print(jax.__version__, jax.devices())"' \
  "$PY"
step smoke 90 "$PY" experiments/device_smoke.py --seq 1024 --head-dims 64,128
step bench16k 150 "$PY" experiments/bench.py --suite gpu --seq 16384 --normalizers softmax,sigmoid \
  --repeats 2 --cell-seconds 2 --compile-seconds 90 --jsonl "$OUT/bench16k.jsonl"

echo "== done in $(( $(date +%s) - start )) s"
cat "$OUT/steps.tsv"
for f in "$OUT"/env.md "$OUT"/smoke.md "$OUT"/bench16k.md; do
  [ -s "$f" ] && { echo "== $f"; tail -c 3000 "$f"; }
done
exit 0
