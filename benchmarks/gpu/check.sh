#!/usr/bin/env bash
# benchmarks/gpu/check.sh -- one prepared run of minidl's CUDA path on a GPU machine, <= 8 minutes.
#
# Usage, from the repository root (the device tool's working directory):
#     OUT=/some/dir bash benchmarks/gpu/check.sh
# What comes back: at most these files, flat in $OUT (a device machine returns 8 files of at
# most 16 MiB):
#   summary.json             every stage (rc, seconds, its figures) and the figures read from
#                            them; written first, rewritten after every stage and every
#                            PACK_EVERY_S seconds meanwhile (a kill leaves a valid one, with the
#                            stage then running under "running")
#   check.log                the check's own log: each stage's start, end and last lines
#   junit.xml                the GPU suite's (both parts), once a part has written one
#   gpu_check_files.tar.gz   every log and per-run file (env.json, smoke.json, peak.json, the
#                            CLI and bench runs' .json/.err/.log, nvidia-smi, pip freeze, ...)
# (a *.tmp beside them is a rewrite a kill cut short; the file it would replace is whole).
#
# Stages, by value (what has never been measured first), each alone on the GPU except the
# smoke's launch workers (which measure no memory): environment and NVVM; smoke (every kernel
# launch, in parallel processes that fill Numba's disk cache for the later stages, then a
# training step of three models against the CPU's); dry-run peak == measured peak; step
# time against PyTorch CUDA; swapping against the cost model's profile of this card; the
# train/plan CLI pairs; then the GPU test suite with the time left: its memory-measuring
# tests alone, then the rest on TEST_WORKERS processes. Without a GPU (CI) every GPU stage is
# skipped and the summary says why; exit code 0.
#
# NVVM (Numba's compiler): the CUDA toolkit's libNVVM (CUDA_HOME, else nvcc's folder), else
# whatever Numba finds itself, else the carried .gpu_check/nvvm-13.0*-cuda13.tar.gz
# (make_nvvm_carry.sh builds it); summary.json's "nvvm" says which was used.
#
# Knobs (environment): PY (default: /opt/torch/.venv/bin/python3 if present, else python3),
# BUDGET_S (default 480: no stage starts after that; give the device tool's run about 540 s),
# TEST_TIMEOUT_S (per test, default 120), TEST_WORKERS (default 6), GPUCHECK_WORKERS (smoke's
# launch workers; default the cores, at most 8), PACK_EVERY_S (default 30), INSTALL (editable |
# skip; default editable), ALONE_TESTS / SUITE (the suite's two parts), STAGES (a comma list
# to run only those of: smoke,peak,bench,swap,cli,tests; default all), CHECK_DEVICE (cuda; cuda-strict runs every
# stage on the strict test device, on the CPU: the check's own test in CI), QUICK=1 (small
# batches and few steps: for CHECK_DEVICE=cuda-strict). Nothing is ever fetched.
set -u -o pipefail

START=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
BUDGET_S=${BUDGET_S:-480}
if [ -z "${PY:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3; else PY=python3; fi
fi
OUT=${OUT:-$REPO/gpu_check_out}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}
TEST_WORKERS=${TEST_WORKERS:-6}
PACK_EVERY_S=${PACK_EVERY_S:-30}
INSTALL=${INSTALL:-editable}
STAGES=${STAGES:-smoke,peak,bench,swap,cli,tests}
CHECK_DEVICE=${CHECK_DEVICE:-cuda}
QUICK=${QUICK:-0}
#: The suite's tests that read device-wide memory (memGetInfo): run alone, before the rest
#: (SUITE: where the rest is collected).
ALONE_TESTS=${ALONE_TESTS:-tests/memory/devices/test_cuda_device.py}
SUITE=${SUITE:-tests}
export GPUCHECK_DEVICE=$CHECK_DEVICE GPUCHECK_QUICK=$QUICK
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/check.log
: > "$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/minidl-gpucheck.XXXXXX")
RUN=$WORK/run          # every per-run file; archived into $OUT by summary.py
mkdir -p "$RUN"
: > "$RUN/stages.tsv"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$WORK/cupy_cache}
export MINIDL_NUM_THREADS=${MINIDL_NUM_THREADS:-4}   # CPU reference runs share the cores
# Numba's disk cache of the CUDA kernels: compiled once (by smoke's workers), loaded after
export MINIDL_CUDA_CACHE=${MINIDL_CUDA_CACHE:-1}
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"  # (the pytest plugin gpucheck_timeout)
export GPUCHECK_START=$START GPUCHECK_TEST_TIMEOUT=$TEST_TIMEOUT_S

log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
wanted() { case ",$STAGES," in *",$1,"*) return 0;; *) return 1;; esac; }
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$RUN/stages.tsv"; }
# pack: summary.json, junit.xml and the archive into $OUT (summary.py locks and renames)
pack() { timeout 60 "$PY" "$HERE/summary.py" "$RUN" "$OUT" > "$RUN/pack.log" 2>&1 || true; }

# stage NAME MAX_SECONDS CMD...: CMD under timeout (capped by what is left), output in
# $RUN/NAME.log, one row of stages.tsv (name, rc, seconds, note); rc 124/137 = timed out.
stage() {
  local name=$1 max=$2; shift 2
  local budget=$(( $(left) - 15 ))
  if (( budget < 10 )); then skip "$name" "no time left"; return 0; fi
  local t=$(( max < budget ? max : budget )) t0 rc dt note=""
  log "[$name] start (limit ${t}s)"
  t0=$(date +%s)
  printf '%s\t%s\n' "$name" "$t0" > "$RUN/current.tsv"
  timeout -k 10 "$t" "$@" > "$RUN/$name.log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && note="timed out after ${t}s"
  rm -f "$RUN/current.tsv"
  row "$name" "$rc" "$dt" "$note"
  log "[$name] rc=$rc in ${dt}s $note"
  tail -n 4 "$RUN/$name.log" | cut -c1-300 | sed 's/^/    /' | tee -a "$LOG"
  pack
}
skip() { row "$1" skipped 0 "$2"; log "[$1] skipped: $2"; }

REFRESH_PID=""
cleanup() {
  [ -n "$REFRESH_PID" ] && kill "$REFRESH_PID" 2>/dev/null
  rm -f "$RUN/current.tsv"
  log "done in $(( $(date +%s) - START ))s; summary in $OUT/summary.json"
  pack
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ------------------------------------------------------------------ 0. environment
log "repo $REPO, python $PY, out $OUT, budget ${BUDGET_S}s"
pack  # (a summary before anything else)
( trap 'kill $nap 2>/dev/null; exit 0' TERM
  while :; do sleep "$PACK_EVERY_S" & nap=$!; wait $nap; pack; done ) > /dev/null 2>&1 &
REFRESH_PID=$!
{ nvidia-smi && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv; } > "$RUN/nvidia-smi.txt" 2>&1 || true
(cd "$REPO" && git rev-parse HEAD && git status --short | head -n 20) > "$RUN/git.txt" 2>&1 || true
"$PY" -m pip list --format=freeze > "$RUN/pip-freeze.txt" 2>&1 || true

# ------------------------------------------------------------------ 1. install (offline)
if [ "$INSTALL" = editable ]; then
  stage install 150 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e "$REPO"
else
  skip install "INSTALL=$INSTALL"
fi

# ------------------------------------------------------------------ 2. NVVM for Numba, env
# toolkit_nvvm: the CUDA toolkit folder holding nvvm/lib64/libnvvm.so*: CUDA_HOME's, else
# nvcc's (bin/..), else /usr/local/cuda's
toolkit_nvvm() {
  local d nvcc
  nvcc=$(command -v nvcc 2>/dev/null || true)
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" ${nvcc:+"$(dirname "$nvcc")/.."} /usr/local/cuda; do
    [ -n "$d" ] || continue
    if ls "$d"/nvvm/lib64/libnvvm.so* > /dev/null 2>&1; then (cd "$d" && pwd); return 0; fi
  done
  return 1
}
nvvm_json() { printf '{"source": "%s", "cuda_home": "%s", "detail": "%s"}\n' "$1" "$2" "$3" > "$RUN/nvvm.json"; }
if TK=$(toolkit_nvvm); then
  export CUDA_HOME=$TK LD_LIBRARY_PATH="$TK/nvvm/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvvm_json toolkit "$TK" "$(ls "$TK"/nvvm/lib64/libnvvm.so* | head -n 1)"
  log "[nvvm] the CUDA toolkit's: $TK"
else
  nvvm_json numba "" "no toolkit with nvvm/lib64 (CUDA_HOME, nvcc's folder, /usr/local/cuda): Numba's own search"
  log "[nvvm] no toolkit NVVM found: Numba searches itself"
fi
stage env 90 "$PY" "$HERE/env_info.py" "$RUN/env.json"
TARBALL=$(ls "$REPO"/.gpu_check/nvvm-13.0*-cuda13.tar.gz 2>/dev/null | head -n 1)
# (env_info.py names the problem "Numba CUDA cannot run a kernel" only where CuPy sees a GPU)
if [ "$CHECK_DEVICE" = cuda ] && [ -n "$TARBALL" ] \
    && grep -q 'Numba CUDA cannot run a kernel' "$RUN/env.json" 2>/dev/null; then
  tar -xzf "$TARBALL" -C "$WORK" && export CUDA_HOME="$WORK/cuda13" \
    LD_LIBRARY_PATH="$WORK/cuda13/nvvm/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvvm_json carried "$WORK/cuda13" "$TARBALL"
  log "[nvvm] no usable NVVM: using the carried $TARBALL"
  stage env_carried_nvvm 60 "$PY" "$HERE/env_info.py" "$RUN/env.json"
fi

if [ "$CHECK_DEVICE" = cuda ] && ! grep -q '"gpu_ok": true' "$RUN/env.json" 2>/dev/null; then
  log "no GPU minidl can use here (see env.json): the GPU stages are skipped"
  for s in smoke peak bench swap cli tests; do skip "$s" "no usable GPU"; done
  exit 0
fi

# ------------------------------------------------------------------ 3. smoke, training step
if wanted smoke; then stage smoke 170 "$PY" "$HERE/smoke.py" "$RUN/smoke.json"; else skip smoke "not in STAGES"; fi

# ------------------------------------------------------------------ 4. dry-run peak == measured
if wanted peak; then stage peak 110 "$PY" "$HERE/peak.py" "$RUN/peak.json"; else skip peak "not in STAGES"; fi

# run_json KIND NAME MAX ARGS...: `minidl ARGS` (which prints one JSON object) -> KIND_NAME.json,
# its stderr -> KIND_NAME.err (in $RUN)
run_json() {
  local kind=$1 name=$2 max=$3; shift 3
  stage "${kind}_$name" "$max" bash -c 'f=$1; shift; "$0" -m minidl "$@" > "$f.json" 2> "$f.err"' \
    "$PY" "$RUN/${kind}_$name" "$@"
}
D=$CHECK_DEVICE

# ------------------------------------------------------------------ 5. step time vs PyTorch CUDA
if [ "$QUICK" = 1 ]; then BB=4; BS=2; SL=32; else BB=64; BS=20; SL=256; fi
if wanted bench; then
  run_json bench smallcnn 50 bench smallcnn --input 1x28x28 --batch-size $BB --memory reuse,inplace --steps $BS --device "$D" --compare-torch --json
  run_json bench resnet20 60 bench resnet20 --input 3x32x32 --batch-size $BB --memory reuse,inplace --steps $BS --device "$D" --compare-torch --json
  run_json bench gptchar 60 bench gpt-char --batch-size $((BB / 4)) --seq-len $SL --memory reuse,inplace --steps $((BS / 3 > 1 ? BS / 3 : 1)) --device "$D" --compare-torch --json
  run_json bench charlstm 60 bench char-lstm --batch-size $((BB / 2)) --memory reuse,inplace --steps $((BS / 2)) --device "$D" --compare-torch --json
else
  skip bench "not in STAGES"
fi

# ------------------------------------------------------------------ 6. swapping vs the cost model
if wanted swap; then stage swap 90 "$PY" "$HERE/swap.py" "$RUN/swap.json"; else skip swap "not in STAGES"; fi

# ------------------------------------------------------------------ 7. train/plan CLI pairs
if [ "$QUICK" = 1 ]; then B=4; STEPS=2; else B=32; STEPS=10; fi
if wanted cli; then
  run_json cli train_smallcnn_vdnn 60 train smallcnn --dataset synthetic --device "$D" --max-steps $((2 * STEPS)) --batch-size $B --memory vdnn --no-progress --json
  run_json cli plan_smallcnn_vdnn 30 plan smallcnn --batch-size $B --memory vdnn --device cuda --json
  run_json cli train_resnet20_sqrt 60 train resnet20 --dataset synthetic --input 3x32x32 --device "$D" --max-steps $STEPS --batch-size $B --memory reuse,recompute=sqrt --no-progress --json
  run_json cli plan_resnet20_sqrt 30 plan resnet20 --input 3x32x32 --batch-size $B --memory reuse,recompute=sqrt --device cuda --json
  run_json cli train_charlstm 60 train char-lstm --dataset synthetic --device "$D" --max-steps $STEPS --batch-size $B --memory reuse,inplace --no-progress --json
  run_json cli plan_charlstm 30 plan char-lstm --batch-size $B --memory reuse,inplace --device cuda --json
  # mixed precision on the device (its float32 copies are measured temporaries: the plan's peak
  # leaves out that scratch block, so this pair's ratio is above 1 by it)
  run_json cli train_smallcnn_bf16 60 train smallcnn --dataset synthetic --device "$D" --max-steps $STEPS --batch-size $B --memory reuse,inplace --precision bf16-mixed --no-progress --json
  run_json cli plan_smallcnn_bf16 30 plan smallcnn --batch-size $B --memory reuse,inplace --precision bf16-mixed --device cuda --json
else
  skip cli "not in STAGES"
fi

# ------------------------------------------------------------------ 8. the GPU suite, last
# Its memory-measuring tests alone (memGetInfo sees every process), then the rest in parallel.
if wanted tests; then
  PYTEST=("$PY" -m pytest -m gpu -p gpucheck_timeout -p no:cacheprovider
          -o faulthandler_timeout=$((TEST_TIMEOUT_S + 30)) -rA -v)
  (cd "$REPO" && stage tests_alone 120 "${PYTEST[@]}" --junitxml="$RUN/junit_alone.xml" $ALONE_TESTS)
  IGNORE=(); for t in $ALONE_TESTS; do IGNORE+=(--ignore="$t"); done
  (cd "$REPO" && stage tests 600 "${PYTEST[@]}" -n "$TEST_WORKERS" --junitxml="$RUN/junit.xml" \
      "${IGNORE[@]}" $SUITE)
else
  skip tests "not in STAGES"
fi
log "all stages done in $(( $(date +%s) - START ))s"
exit 0
