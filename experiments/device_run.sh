#!/bin/bash
# The second, long call on a lent GPU (an H200; issues 49, 50 and 62), after
# experiments/device_first.sh passed; its default steps' limits sum to 540 s (< 560):
#
#   1. check:   python -m attnjax.check --kernel all --ship  (every kernel of the platform; the
#               verdicts to ship are written where --ship puts them and copied to $OUT/ship/)
#   2. gpu:     experiments/bench.py --suite gpu             (every path, T = 4096 and 16384)
#   3. trainer: experiments/bench.py --suite trainer         (the Trainer against its bare step;
#               not in the default STEPS: STEPS=trainer in a call of its own)
#
# From the session's checkout, before the run (flax 0.12.12 and ml_collections into .whl/):
#
#   ../shared/device/wheels.sh
#   run(command="bash experiments/device_run.sh", carry=[".whl"], timeout_s=600)
#
# (In a git worktree .git is a file and wheels.sh stops at `mkdir .git/info`: add /.whl/ to
# "$(git rev-parse --git-path info/exclude)" and run its `pip download` line by hand.)
#
# Every step runs under `timeout` with its output written to $OUT as it goes (PYTHONUNBUFFERED),
# so a hang or a kill loses only that step; $OUT/steps.tsv says how each ended (124: its
# timeout). STEPS="gpu trainer" reruns some of them; CHECK_S / GPU_S / TRAINER_S set their
# time limits in seconds; GPU_ARGS adds options to the bench (a CPU dry run: GPU_ARGS="--seq 64
# --tokens 128 --heads 2 --head-dim 16" PYTHON=/work/venv/bin/python). The bench's table is rendered again from its JSON lines when the
# step did not finish ($OUT/bench_gpu_table.md), and locally by
#   python experiments/bench.py --gpu-table <files_at>/bench_gpu.jsonl
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
STEPS=${STEPS:-"check gpu"}
CHECK_S=${CHECK_S:-250}
GPU_S=${GPU_S:-200}
TRAINER_S=${TRAINER_S:-80}
GPU_ARGS=${GPU_ARGS:-}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# The check's local verdicts come back too; the bench's auto rows see them (and --ship's).
export ATTNJAX_CACHE_DIR=${ATTNJAX_CACHE_DIR:-$OUT/attnjax_cache}
start=$(date +%s)
printf 'step\trc\tseconds\n' > "$OUT/steps.tsv"

# step NAME LIMIT CMD...: CMD under `timeout LIMIT`, stdout to $OUT/NAME.md, stderr to NAME.log.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (limit ${limit} s, $(( t0 - start )) s into the run): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.tsv"
  return $rc
}

wants() { [[ " $STEPS " == *" $1 "* ]]; }

# The wheels the machine lacks (../shared/device/README.md), then what the machine is.
if ls .whl/*.whl > /dev/null 2>&1; then
  step setup 40 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "no .whl/ carried: flax and ml_collections are the machine's own (trainer may fail)"
  export PYTHONPATH=$PWD
fi
step env 20 bash -c 'nvidia-smi -L; "$0" -c "import jax, flax; print(jax.__version__, \
  flax.__version__, jax.devices())"; date -u' "$PY"

if wants check; then
  stamp=$(mktemp)
  step check "$CHECK_S" "$PY" -m attnjax.check --kernel all --ship --out "$OUT/check_report.md"
  # The verdicts --ship wrote into the tree come back with $OUT (nothing else is written there).
  mkdir -p "$OUT/ship"
  find attnjax -type f -newer "$stamp" ! -name '*.pyc' -print0 \
    | xargs -0 -r cp --parents -t "$OUT/ship"
fi

if wants gpu; then
  # shellcheck disable=SC2086  # GPU_ARGS: several options
  step bench_gpu "$GPU_S" "$PY" experiments/bench.py --suite gpu --repeats 3 \
    --cell-seconds 2 --compile-seconds 120 --jsonl "$OUT/bench_gpu.jsonl" $GPU_ARGS \
    || step bench_gpu_table 30 "$PY" experiments/bench.py --gpu-table "$OUT/bench_gpu.jsonl"
fi

if wants trainer; then
  step bench_trainer "$TRAINER_S" "$PY" experiments/bench.py --suite trainer
fi

echo "== done in $(( $(date +%s) - start )) s"
cat "$OUT/steps.tsv"
for f in "$OUT"/check_report.md "$OUT"/bench_gpu.md "$OUT"/bench_gpu_table.md \
         "$OUT"/bench_trainer.md; do
  [ -s "$f" ] && { echo "== $f"; tail -c 3000 "$f"; }
done
exit 0
