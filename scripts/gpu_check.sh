#!/usr/bin/env bash
# GPU verification in one call: the environment, a build of the ops for the GPU found here against
# the torch found here, the CUDA tests, the full stack on the GPU and the benchmark, every result
# written as files. Made for the lent GPU machine (no network, one command of at most 10 minutes,
# files back from $OUT); runs the same on any CUDA machine by hand. README: GPU verification.
#
#   scripts/gpu_check.sh [--part tests|bench|all] [--budget SECONDS] [--bench-shapes A,B]
#                        [--out DIR] [--dry-run]
#
#   --part tests   environment, build, the CUDA tests (`pytest -m cuda tests/worker`: every op
#                  against its reference, opcheck, graphs against eager, GPU engine against CPU
#                  engine, block boundaries, 16k contexts, NCCL), then the full stack
#                  (`shardlm serve --device cuda`, and tests/gateway/test_e2e.py on the GPU)
#   --part bench   environment, build, `bench.run --device cuda` in bfloat16, one shape at a time,
#                  smallest first, while the budget lasts
#   --part all     both (the default)
#   --budget S     start no step that cannot end within S seconds of the start (default 540: a
#                  device command may run 600); 0 = no limit
#   --bench-shapes the shapes to benchmark (default qwen2.5-0.5b,llama-3.2-1b,llama-3-8b)
#   --out DIR      where results go (default $OUT when set, else gpu-check-out/)
#   --dry-run      on any machine, GPU or not: parse, probe (reporting what would stop a real
#                  run), print every command, write synthetic results and summarise them for real
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_SCRATCH
# (default /tmp/shardlm-gpu-check), MAX_JOBS (default: all cores), BENCH_ARGS (added to each
# bench.run). Exit status: 0 all ran and passed, 1 a step failed, 2 bad arguments, 3 the machine
# lacks something the check needs (the message says what).
#
# Nothing is fetched from a network. Packages the machine lacks come from .whl/ (scripts/gpu_wheels.sh
# fills it) and are installed into the scratch folder, never into the machine's Python. The
# repository is copied into the scratch folder and built there, so the checkout is left as it was.
# A build whose sources, torch, Python and GPU match one in the scratch folder (a warm machine) or
# in .gpu-build/ (carried back from an earlier call's prebuilt-* output) is reused.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
START=$(date +%s)

# ------------------------------------------------------------------ selections (the one place)
KERNEL_TESTS=(-m cuda tests/worker)
STACK_TESTS=(tests/gateway/test_serve_cuda.py tests/gateway/test_e2e.py)
STACK_ENV=(SHARDLM_TEST_DEVICE=cuda)
DEFAULT_SHAPES=qwen2.5-0.5b,llama-3.2-1b,llama-3-8b
RESERVE_S=25        # kept for the summary after the last step
STEP_MIN_S=45       # a step that would get less than this is not started

usage() { sed -n '7,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

PART=all BUDGET=540 SHAPES=$DEFAULT_SHAPES OUT_DIR=${OUT:-} DRY_RUN=0
while [ $# -gt 0 ]; do
  case $1 in
    --part) PART=${2:-}; shift 2 || usage ;;
    --budget) BUDGET=${2:-}; shift 2 || usage ;;
    --bench-shapes) SHAPES=${2:-}; shift 2 || usage ;;
    --out) OUT_DIR=${2:-}; shift 2 || usage ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage ;;
    *) echo "error: unknown argument '$1'" >&2; usage ;;
  esac
done
case $PART in tests|bench|all) ;; *) echo "error: --part must be tests, bench or all" >&2; usage ;; esac
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "error: --budget must be a number of seconds" >&2; usage; }
[[ $SHAPES =~ ^[a-z0-9.-]+(,[a-z0-9.-]+)*$ ]] || { echo "error: --bench-shapes: a,b,c" >&2; usage; }

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || { echo "error: no Python at '$PYTHON' (set PYTHON)" >&2; exit 3; }
OUT_DIR=${OUT_DIR:-$ROOT/gpu-check-out}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
SCRATCH=${GPU_CHECK_SCRATCH:-${TMPDIR:-/tmp}/shardlm-gpu-check}
TREE=$SCRATCH/tree SITE=$SCRATCH/site STEPS=$SCRATCH/steps.tsv BENCH_DIR=$SCRATCH/bench VIEW=$SCRATCH/view
JOBS=${MAX_JOBS:-$(nproc)}
SUMMARY=("$PYTHON" "$ROOT/scripts/gpu_summary.py")
PROBE=("$PYTHON" "$ROOT/scripts/gpu_probe.py")
mkdir -p "$SCRATCH" && rm -rf "$BENCH_DIR" && : >"$STEPS"
: >"$OUT_DIR/gpu_check.log"  # everything printed from here on is also kept there
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2> >(tee -a "$OUT_DIR/gpu_check.log" >&2)

# ------------------------------------------------------------------ steps
time_left() { echo $(( START + BUDGET - RESERVE_S - $(date +%s) )); }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$STEPS"; }
FAILED=0

# step NAME LOG CMD...: print CMD; unless --dry-run, run it in the scratch tree under the time left
# (SIGINT first, so pytest still writes its junit XML), its output to LOG ("-": this log), and
# record its status and seconds for the summary.
step() {
  local name=$1 log=$2; shift 2
  printf '\n== %s\n+ (cd %q &&' "$name" "$TREE"; printf ' %q' "$@"; printf ')\n'
  if (( DRY_RUN )); then record "$name" "planned" 0; return 0; fi
  local limit=() left
  if (( BUDGET > 0 )); then
    left=$(time_left)
    if (( left < STEP_MIN_S )); then
      echo "not started: ${left}s of the budget left"; record "$name" "not started (budget)" 0
      FAILED=1; return 1
    fi
    limit=(timeout --signal=INT --kill-after=20 "$left")
  fi
  local t0=$SECONDS status
  if [ "$log" = - ]; then
    (cd "$TREE" && "${limit[@]}" "$@"); status=$?
  else
    (cd "$TREE" && "${limit[@]}" "$@" >"$log" 2>&1); status=$?
  fi
  local took=$(( SECONDS - t0 )) verdict=ok
  case $status in
    0) ;;
    124|130|137) verdict="timed out"; FAILED=1 ;;
    *) verdict="failed (exit $status)"; FAILED=1 ;;
  esac
  echo "-- $name: $verdict in ${took}s"
  record "$name" "$verdict" "$took"
  return "$status"
}

pytest_step() {  # pytest_step NAME JUNIT [ENV...] -- PYTEST ARGS...
  local name=$1 junit=$OUT_DIR/$2 envs=(); shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  rm -f "$junit"
  step "$name" - env "${envs[@]}" "$PYTHON" -m pytest -p no:cacheprovider -q -rfE \
    -o timeout=300 --junitxml="$junit" "$@"
  (( DRY_RUN )) && "${SUMMARY[@]}" synthetic-junit "$junit"
  JUNITS+=("$junit")
}

# ------------------------------------------------------------------ environment
setup_environment() {
  echo "== environment (part $PART, budget ${BUDGET}s, results in $OUT_DIR, scratch $SCRATCH)"
  local wheels
  # A package with no wheel here is reported by the check below, after the GPU (the first thing
  # a machine can lack); the wheels that are here are installed first, so the check sees them.
  wheels=$("${PROBE[@]}" wheels --dir "$ROOT/.whl" 2>/dev/null)
  if [ -n "$wheels" ]; then
    echo "installing the carried wheels this machine lacks into $SITE:"; echo "$wheels"
    if (( ! DRY_RUN )); then
      # shellcheck disable=SC2086  # one wheel path per line, none with spaces
      PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $wheels || { echo "error: installing the wheels failed" >&2; exit 3; }
    fi
  fi
  # The scratch tree first, so its gateway/, worker/ (with the new build) and stubs are imported:
  # $VIEW/shardlm_server/{gateway,worker} link to the tree's folders under their installed names.
  export PYTHONPATH=$VIEW:$TREE/clients/python/src:$TREE:$SITE${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  unset SHARDLM_NO_CUDA SHARDLM_OPS
  local probe_args=(check --out "$OUT_DIR/env.txt")
  (( DRY_RUN )) && probe_args+=(--report-only)
  "${PROBE[@]}" "${probe_args[@]}" || exit 3
}

copy_tree() {
  echo "+ copy the repository (without .git, .venv, .whl, builds) to $TREE"
  (( DRY_RUN )) && return 0
  rm -rf "$TREE" && mkdir -p "$TREE"
  tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./.gpu-build \
    --exclude=./.cache --exclude=./build --exclude='*.so' --exclude=./gpu-check-out \
    --exclude=./bench/results -cf - . | tar -C "$TREE" -xf -
  rm -rf "$VIEW" && mkdir -p "$VIEW/shardlm_server"
  ln -s "$TREE/gateway" "$VIEW/shardlm_server/gateway"
  ln -s "$TREE/worker" "$VIEW/shardlm_server/worker"
}

# The build's identity: sources, build script, torch, Python and GPU architecture.
build_stamp() {
  local facts=dry-run
  (( DRY_RUN )) || facts=$("$PYTHON" -c 'import sys, torch
cap = ".".join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else "none"
print(torch.__version__, sys.implementation.cache_tag, cap)' 2>/dev/null || echo unknown)
  { (cd "$ROOT" && find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum); echo "$facts"; } \
    | sha256sum | cut -c1-12
}

build() {
  local stamp prebuilt dir
  stamp=$(build_stamp)
  prebuilt=prebuilt-$stamp
  for dir in "$SCRATCH/$prebuilt" "$ROOT/.gpu-build/$prebuilt"; do
    if (( ! DRY_RUN )) && compgen -G "$dir/_C*.so" >/dev/null; then
      echo "== build: reusing $dir (same sources, torch, Python and GPU)"
      cp "$dir"/_C*.so "$TREE/worker/"
      record build "reused $prebuilt" 0
      verify_build && return 0
      echo "the reused build does not load; building"
    fi
  done
  local log=$SCRATCH/build.log
  step build "$log" env MAX_JOBS="$JOBS" "$PYTHON" setup.py build_ext --inplace
  local status=$?
  if (( DRY_RUN )); then  # the file a real build leaves, so the layout check sees them all
    echo "dry run: no build" >"$OUT_DIR/build-tail.log"
    return 0
  fi
  tail -n 80 "$log" >"$OUT_DIR/build-tail.log"
  (( status == 0 )) || { echo "build failed; its last lines:"; tail -n 30 "$log"; return 1; }
  verify_build || { record "load the build" failed 0; return 1; }
  mkdir -p "$SCRATCH/$prebuilt" && cp "$TREE"/worker/_C*.so "$SCRATCH/$prebuilt/"
  if [ "$PART" = tests ]; then  # hand it back, so a following bench call can skip the build
    mkdir -p "$OUT_DIR/$prebuilt" && cp "$TREE"/worker/_C*.so "$OUT_DIR/$prebuilt/"
  fi
}

verify_build() {
  (cd "$TREE" && "$PYTHON" -c 'import torch, shardlm_server.worker.ops as o
assert o.CUDA_BUILT, "shardlm_server.worker._C was built without its CUDA kernels"
print("ops load with CUDA kernels; torch", torch.__version__, "on", torch.cuda.get_device_name(0))')
}

# ------------------------------------------------------------------ parts
JUNITS=()
part_tests() {
  pytest_step "CUDA tests" junit-cuda.xml -- "${KERNEL_TESTS[@]}"
  pytest_step "full stack on the GPU" junit-stack.xml "${STACK_ENV[@]}" -- "${STACK_TESTS[@]}"
}

part_bench() {
  local shape
  for shape in ${SHAPES//,/ }; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of extra flags
    step "bench $shape" - "$PYTHON" -m bench.run --device cuda --dtype bfloat16 --shapes "$shape" \
      --out "$BENCH_DIR" ${BENCH_ARGS:-}
    (( DRY_RUN )) && "${SUMMARY[@]}" synthetic-bench "$BENCH_DIR" "$shape"
  done
  "${SUMMARY[@]}" merge-bench "$BENCH_DIR" --out "$OUT_DIR/bench.json"
}

finish() {
  local args=(summary --out "$OUT_DIR/summary.md" --env "$OUT_DIR/env.txt" --steps "$STEPS"
              --title "ShardLM GPU check, part $PART$( (( DRY_RUN )) && echo ' (dry run)'), $(date -u +%FT%TZ)")
  (( ${#JUNITS[@]} )) && args+=(--junit "${JUNITS[@]}")
  [ -f "$OUT_DIR/bench.json" ] && args+=(--bench "$OUT_DIR/bench.json")
  echo; "${SUMMARY[@]}" "${args[@]}"
  if ! "${SUMMARY[@]}" layout "$OUT_DIR"; then
    echo "warning: part of $OUT_DIR would not come back through the device tool" >&2
    (( DRY_RUN )) && exit 1
  fi
  echo "results in $OUT_DIR: $(cd "$OUT_DIR" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
}

setup_environment
copy_tree
if build; then
  case $PART in
    tests) part_tests ;;
    bench) part_bench ;;
    all) part_tests; part_bench ;;
  esac
else
  FAILED=1
fi
if (( DRY_RUN )); then
  FAILED=0  # the synthetic results hold a failure on purpose: the summary must show it
fi
finish
exit "$FAILED"
