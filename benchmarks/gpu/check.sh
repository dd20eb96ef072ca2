#!/usr/bin/env bash
# benchmarks/gpu/check.sh -- one prepared run of minidl's CUDA path on a GPU machine, <= 8 minutes.
#
# Usage, from the repository root (the device tool's working directory):
#     OUT=/some/dir bash benchmarks/gpu/check.sh
# Everything it learns goes under $OUT: the environment (versions, nvidia-smi), the offline
# install, a smoke test of every kind of kernel launch, the GPU test suite (JUnit XML, a time
# limit per test), train/plan pairs (dry-run peak against the measured one, the bytes outside
# the arena), step times against PyTorch CUDA eager (each in its own process), swapping on
# vgg11 against the --target h100 prediction, and summary.json (rewritten at the end and on
# exit). Without a GPU (CI) every GPU stage is skipped and summary.json says why; exit code 0.
#
# Knobs (environment): PY (default: /opt/torch/.venv/bin/python3 if present, else python3),
# BUDGET_S (default 470: no stage starts after that), TEST_TIMEOUT_S (per test, default 120),
# TEST_WORKERS (default 4), INSTALL (editable | skip; default editable), STAGES (a comma list
# to run only those of: smoke,tests,peak,cli,bench,swap; default all), CHECK_DEVICE (cuda;
# cuda-strict runs every stage on the strict test device, on the CPU: the check's own test in
# CI), QUICK=1 (small batches and few steps: for CHECK_DEVICE=cuda-strict).
# Optional carry: .gpu_check/nvvm-13.0*-cuda13.tar.gz (make_nvvm_carry.sh builds it), used only
# when Numba finds no NVVM. Nothing is ever fetched from a registry.
set -u -o pipefail

START=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BUDGET_S=${BUDGET_S:-470}
if [ -z "${PY:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
OUT=${OUT:-$REPO/gpu_check_out}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}
TEST_WORKERS=${TEST_WORKERS:-4}
INSTALL=${INSTALL:-editable}
STAGES=${STAGES:-smoke,tests,peak,cli,bench,swap}
CHECK_DEVICE=${CHECK_DEVICE:-cuda}
QUICK=${QUICK:-0}
export GPUCHECK_DEVICE=$CHECK_DEVICE GPUCHECK_QUICK=$QUICK
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/check.log
: > "$OUT/stages.tsv"
WORK=$(mktemp -d /tmp/minidl-gpucheck.XXXXXX)
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$WORK/cupy_cache}
export MINIDL_NUM_THREADS=${MINIDL_NUM_THREADS:-4}   # CPU reference runs share the cores
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"  # (the pytest plugin gpucheck_timeout)
export GPUCHECK_START=$START GPUCHECK_TEST_TIMEOUT=$TEST_TIMEOUT_S

log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
wanted() { case ",$STAGES," in *",$1,"*) return 0;; *) return 1;; esac; }
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/stages.tsv"; }

# stage NAME MAX_SECONDS CMD...: CMD under timeout (capped by what is left), output in
# $OUT/NAME.log, one row of stages.tsv (name, rc, seconds, note); rc 124/137 = timed out.
stage() {
  local name=$1 max=$2; shift 2
  local budget=$(( $(left) - 15 ))
  if (( budget < 10 )); then row "$name" skipped 0 "no time left"; log "[$name] skipped: no time left"; return 0; fi
  local t=$(( max < budget ? max : budget )) t0 rc dt note=""
  log "[$name] start (limit ${t}s)"
  t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && note="timed out after ${t}s"
  row "$name" "$rc" "$dt" "$note"
  log "[$name] rc=$rc in ${dt}s $note"
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$LOG"
}
skip() { row "$1" skipped 0 "$2"; log "[$1] skipped: $2"; }

summarize() { timeout 60 "$PY" "$HERE/summary.py" "$OUT" >> "$LOG" 2>&1 || true; }
cleanup() { summarize; log "done; summary in $OUT/summary.json"; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

# ------------------------------------------------------------------ 0. environment
log "repo $REPO, python $PY, out $OUT, budget ${BUDGET_S}s"
{ nvidia-smi && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv; } > "$OUT/nvidia-smi.txt" 2>&1 || true
(cd "$REPO" && git rev-parse HEAD && git status --short | head -n 20) > "$OUT/git.txt" 2>&1 || true
"$PY" -m pip list --format=freeze > "$OUT/pip-freeze.txt" 2>&1 || true

# ------------------------------------------------------------------ 1. install (offline)
if [ "$INSTALL" = editable ]; then
  stage install 150 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e "$REPO"
else
  skip install "INSTALL=$INSTALL"
fi
stage env 90 "$PY" "$HERE/env_info.py" "$OUT/env.json"

# ------------------------------------------------------------------ 2. NVVM for Numba
TARBALL=$(ls "$REPO"/.gpu_check/nvvm-13.0*-cuda13.tar.gz 2>/dev/null | head -n 1)
if ! grep -q '"nvvm_ok": true' "$OUT/env.json" 2>/dev/null && [ -n "$TARBALL" ]; then
  tar -xzf "$TARBALL" -C "$WORK" && export CUDA_HOME="$WORK/cuda13" \
    LD_LIBRARY_PATH="$WORK/cuda13/nvvm/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "[nvvm] no usable NVVM: using the carried $TARBALL"
  stage env_carried_nvvm 60 "$PY" "$HERE/env_info.py" "$OUT/env.json"
fi

if [ "$CHECK_DEVICE" = cuda ] && ! grep -q '"gpu_ok": true' "$OUT/env.json" 2>/dev/null; then
  log "no GPU minidl can use here (see env.json): the GPU stages are skipped"
  for s in smoke tests peak cli bench swap; do skip "$s" "no usable GPU"; done
  exit 0
fi

# ------------------------------------------------------------------ 3. smoke: every launch
if wanted smoke; then stage smoke 150 "$PY" "$HERE/smoke.py" "$OUT/smoke.json"; else skip smoke "not in STAGES"; fi

# ------------------------------------------------------------------ 4. correctness (concurrent)
# The GPU suite in the background while the peak checks and CLI pairs run in the foreground;
# nothing is timed meanwhile. It must end by +PHASE_S so that the timed stages run alone.
PHASE_S=${PHASE_S:-300}
TESTS_PID=""
if wanted tests; then
  phase_left=$(( PHASE_S - ($(date +%s) - START) ))
  ( cd "$REPO" && stage tests $(( phase_left > 60 ? phase_left : 60 )) "$PY" -m pytest -m gpu \
      -p gpucheck_timeout -p no:cacheprovider -o faulthandler_timeout=$((TEST_TIMEOUT_S + 30)) \
      -rA -v -n "$TEST_WORKERS" --junitxml="$OUT/junit.xml" tests ) &
  TESTS_PID=$!
else
  skip tests "not in STAGES"
fi
if wanted peak; then stage peak 150 "$PY" "$HERE/peak.py" "$OUT/peak.json"; else skip peak "not in STAGES"; fi

# run_json KIND NAME MAX ARGS...: `minidl ARGS` (which prints one JSON object) -> KIND_NAME.json,
# its stderr -> KIND_NAME.err
run_json() {
  local kind=$1 name=$2 max=$3; shift 3
  stage "${kind}_$name" "$max" bash -c 'f=$1; shift; "$0" -m minidl "$@" > "$f.json" 2> "$f.err"' \
    "$PY" "$OUT/${kind}_$name" "$@"
}
D=$CHECK_DEVICE
if [ "$QUICK" = 1 ]; then B=4; STEPS=2; else B=32; STEPS=10; fi
if wanted cli; then
  run_json cli train_smallcnn_vdnn 90 train smallcnn --dataset synthetic --device "$D" --max-steps $((2 * STEPS)) --batch-size $B --memory vdnn --no-progress --json
  run_json cli plan_smallcnn_vdnn 40 plan smallcnn --batch-size $B --memory vdnn --device cuda --json
  run_json cli train_resnet20_sqrt 90 train resnet20 --dataset synthetic --input 3x32x32 --device "$D" --max-steps $STEPS --batch-size $B --memory reuse,recompute=sqrt --no-progress --json
  run_json cli plan_resnet20_sqrt 40 plan resnet20 --input 3x32x32 --batch-size $B --memory reuse,recompute=sqrt --device cuda --json
  run_json cli train_charlstm 90 train char-lstm --dataset synthetic --device "$D" --max-steps $STEPS --batch-size $B --memory reuse,inplace --no-progress --json
  run_json cli plan_charlstm 40 plan char-lstm --batch-size $B --memory reuse,inplace --device cuda --json
else
  skip cli "not in STAGES"
fi
if [ -n "$TESTS_PID" ]; then log "waiting for the GPU suite"; wait "$TESTS_PID"; fi

# ------------------------------------------------------------------ 5. timing (alone on the GPU)
# minidl's step on the GPU against PyTorch CUDA eager (same weights, its own process)
if [ "$QUICK" = 1 ]; then BB=4; BS=2; SL=32; else BB=64; BS=20; SL=256; fi
if wanted bench; then
  run_json bench smallcnn 60 bench smallcnn --input 1x28x28 --batch-size $BB --memory reuse,inplace --steps $BS --device "$D" --compare-torch --json
  run_json bench resnet20 80 bench resnet20 --input 3x32x32 --batch-size $BB --memory reuse,inplace --steps $BS --device "$D" --compare-torch --json
  run_json bench charlstm 80 bench char-lstm --batch-size $((BB / 2)) --memory reuse,inplace --steps $((BS / 2)) --device "$D" --compare-torch --json
  run_json bench gptchar 90 bench gpt-char --batch-size $((BB / 4)) --seq-len $SL --memory reuse,inplace --steps $((BS / 3 > 1 ? BS / 3 : 1)) --device "$D" --compare-torch --json
else
  skip bench "not in STAGES"
fi
if wanted swap; then stage swap 110 "$PY" "$HERE/swap.py" "$OUT/swap.json"; else skip swap "not in STAGES"; fi
log "all stages done in $(( $(date +%s) - START ))s"
exit 0
