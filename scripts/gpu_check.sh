#!/usr/bin/env bash
# GPU verification: the environment, a build of the ops for the GPU found here against the torch
# found here, the CUDA tests, the full stack on the GPU and the benchmark, every result written
# as files. Made for the lent GPU machine (no network, commands of at most 10 minutes, files back
# from $OUT); runs the same on any CUDA machine by hand. README: GPU verification.
#
#   scripts/gpu_check.sh [--part tests|bench|all] [--budget SECONDS] [--bench-shapes A,B]
#                        [--out DIR] [--dry-run]
#
#   --part tests   (the default) environment, build, the CUDA tests (`pytest -m cuda
#                  tests/worker`: every op against its reference, opcheck, graphs against eager,
#                  GPU engine against CPU engine, block boundaries, 16k contexts, NCCL), then the
#                  full stack (`shardlm serve --device cuda`, and tests/gateway/test_e2e.py on
#                  the GPU): the correctness table, in one call
#   --part bench   environment, build (or the one carried back from a tests call), `bench.run
#                  --device cuda` in bfloat16 for each --bench-shapes shape: one per call
#   --part all     both; fits no single call, so it needs --budget 0 (by hand, no limit)
#   --budget S     the seconds this run may take (default 560: a device command may run 600);
#                  each step gets its own share (SHARE below) plus what earlier steps left, so
#                  the last step always gets its share; 0 = no limits
#   --bench-shapes the shapes to benchmark (default qwen2.5-0.5b; see bench/shapes.py)
#   --out DIR      where results go (default $OUT when set, else gpu-check-out/)
#   --dry-run      on any machine, GPU or not: parse, check the plan against the budget, probe
#                  (reporting what would stop a real run), print every command, write synthetic
#                  results and summarise them for real
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_SCRATCH
# (default /tmp/shardlm-gpu-check), GPU_CHECK_WHEELS (default .whl), MAX_JOBS (default: all
# cores), BENCH_ARGS (added to each bench.run). Exit status: 0 all ran and passed, 1 a step failed, 2 bad arguments or a plan over
# the budget, 3 the machine lacks something the check needs (the message says what).
#
# Nothing is fetched from a network. The packages of scripts/gpu_wheels.txt come from .whl/
# (scripts/gpu_wheels.sh fills it) and are installed into the scratch folder, never into the
# machine's Python. The repository is copied into the scratch folder and built there, so the
# checkout is left as it was. A build whose sources, torch, Python and GPU match one in the
# scratch folder (a warm machine) or in .gpu-build/ (carried back from an earlier call's
# prebuilt-* output) is reused.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
START=$(date +%s)

# ------------------------------------------------------------------ selections and plan (the one place)
KERNEL_TESTS=(-m cuda tests/worker)
STACK_TESTS=(tests/gateway/test_serve_cuda.py tests/gateway/test_e2e.py)
STACK_ENV=(SHARDLM_TEST_DEVICE=cuda)
DEFAULT_SHAPES=qwen2.5-0.5b
CALL_LIMIT_S=600    # the device tool's limit for one command
DEFAULT_BUDGET=560  # inside it: copying the tree in, and slack for what no budget bounds
# Seconds each step may take. A step's limit is the time left less the shares of the steps after
# it, so a step may use what earlier ones left, never what later ones need.
declare -A SHARE=([setup]=40 [build]=170 [CUDA tests]=230 [full stack on the GPU]=100
                  [bench]=330 [summary]=20)

usage() { sed -n '7,27p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

PART=tests BUDGET=$DEFAULT_BUDGET SHAPES=$DEFAULT_SHAPES OUT_DIR=${OUT:-} DRY_RUN=0
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

# The steps of this run, in order, one bench step per shape.
PLAN=(setup build)
case $PART in tests|all) PLAN+=("CUDA tests" "full stack on the GPU") ;; esac
case $PART in bench|all) for shape in ${SHAPES//,/ }; do PLAN+=("bench $shape"); done ;; esac
PLAN+=(summary)
share() { local name=$1; [[ $name == bench\ * ]] && name=bench; echo "${SHARE[$name]:-0}"; }
PLANNED=0
for name in "${PLAN[@]}"; do PLANNED=$(( PLANNED + $(share "$name") )); done
if (( BUDGET > 0 && PLANNED > BUDGET )); then
  echo "error: --part $PART with these shapes plans ${PLANNED}s of steps, over the ${BUDGET}s" \
       "budget. On a machine whose commands end after ${CALL_LIMIT_S}s, run --part tests, then" \
       "--part bench with one shape, each as a call of its own (README, GPU verification);" \
       "by hand, --budget 0 lifts every limit." >&2
  exit 2
fi

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || { echo "error: no Python at '$PYTHON' (set PYTHON)" >&2; exit 3; }
PYTHON=$(cd "$ROOT" && realpath -s "$(command -v "$PYTHON")")  # the steps run in another folder
OUT_DIR=${OUT_DIR:-$ROOT/gpu-check-out}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
SCRATCH=${GPU_CHECK_SCRATCH:-${TMPDIR:-/tmp}/shardlm-gpu-check}
TREE=$SCRATCH/tree SITE=$SCRATCH/site STEPS=$SCRATCH/steps.tsv BENCH_DIR=$SCRATCH/bench VIEW=$SCRATCH/view
JOBS=${MAX_JOBS:-$(nproc)}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SUMMARY=("$PYTHON" "$ROOT/scripts/gpu_summary.py")
PROBE=("$PYTHON" "$ROOT/scripts/gpu_probe.py")
MAX_LIBRARY_BYTES=$(( 16 << 20 ))  # the most one file that comes back from the machine may hold
mkdir -p "$SCRATCH" && rm -rf "$BENCH_DIR" && : >"$STEPS"

# ------------------------------------------------------------------ steps
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(share "$1")" >>"$STEPS"; }
FAILED=0

# The seconds step NAME may run now: the time left less the shares of the steps after it.
limit_for() {
  local name=$1 after=0 seen=0 other
  for other in "${PLAN[@]}"; do
    (( seen )) && after=$(( after + $(share "$other") ))
    [ "$other" = "$name" ] && seen=1
  done
  echo $(( START + BUDGET - after - $(date +%s) ))
}

# step NAME LOG CMD...: print CMD; unless --dry-run, run it in the scratch tree within its limit
# (SIGINT first, so pytest still writes its junit XML), its output to LOG ("-": this log), and
# record its status and seconds for the summary.
step() {
  local name=$1 log=$2; shift 2
  printf '\n== %s (share %ss)\n+ (cd %q &&' "$name" "$(share "$name")" "$TREE"
  printf ' %q' "$@"; printf ')\n'
  if (( DRY_RUN )); then record "$name" "planned" 0; return 0; fi
  local limit=() left
  if (( BUDGET > 0 )); then
    left=$(limit_for "$name")
    if (( left < 10 )); then
      echo "not started: ${left}s left for it"; record "$name" "not started (budget)" 0
      FAILED=1; return 1
    fi
    limit=(timeout --signal=INT --kill-after=15 "$left")
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
  local t0=$SECONDS
  echo "== setup (part $PART, budget ${BUDGET}s for ${PLANNED}s of shares, results in $OUT_DIR, scratch $SCRATCH)"
  echo "plan: $(for name in "${PLAN[@]}"; do printf '%s %ss; ' "$name" "$(share "$name")"; done)"
  local wheels
  # Every carried wheel, installed first so that the probe sees the versions the run will use.
  # One that is missing is named here and stops the run in the probe's check, after the GPU
  # (the first thing a machine can lack).
  wheels=$("${PROBE[@]}" wheels --dir "$WHEELS")
  if [ -n "$wheels" ]; then
    echo "installing the carried wheels into $SITE:"; echo "$wheels"
    if (( ! DRY_RUN )); then
      # shellcheck disable=SC2086  # one wheel path per line, none with spaces
      PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $wheels || { echo "error: installing the wheels failed" >&2; exit 3; }
    fi
  fi
  # The scratch tree first, so its gateway/, worker/ (with the new build) and stubs are imported:
  # $VIEW/shardlm_server/{gateway,worker} link to the tree's folders under their installed names.
  # The carried packages come next, ahead of the machine's own.
  export PYTHONPATH=$VIEW:$TREE/clients/python/src:$TREE:$SITE${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  unset SHARDLM_NO_CUDA SHARDLM_OPS
  local probe_args=(check --out "$OUT_DIR/env.txt")
  (( DRY_RUN )) && probe_args+=(--report-only)
  "${PROBE[@]}" "${probe_args[@]}" || { record setup "failed (environment)" $(( SECONDS - t0 )); exit 3; }
  # Built for this GPU alone: an image-wide TORCH_CUDA_ARCH_LIST would multiply the build.
  ARCHS=$(sed -n 's/^capability: //p' "$OUT_DIR/env.txt")
  ARCHS=${ARCHS:-9.0}
  copy_tree
  record setup "$( (( DRY_RUN )) && echo planned || echo ok)" $(( SECONDS - t0 ))
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

# The build's identity: sources, build scripts, torch, Python and GPU architecture.
build_stamp() {
  local facts=dry-run
  (( DRY_RUN )) || facts=$("$PYTHON" -c 'import sys, torch
cap = ".".join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else "none"
print(torch.__version__, sys.implementation.cache_tag, cap)' 2>/dev/null || echo unknown)
  { (cd "$ROOT" && find csrc setup.py scripts/libstdcxx.py -type f | LC_ALL=C sort | xargs sha256sum); echo "$facts"; } \
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
  step build "$log" env MAX_JOBS="$JOBS" TORCH_CUDA_ARCH_LIST="$ARCHS" \
    "$PYTHON" setup.py build_ext --inplace
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
    # setup.py builds without debug info; strip what a compiler may still have added, so the
    # library stays under the size of a file that comes back.
    strip --strip-debug "$OUT_DIR/$prebuilt"/_C*.so 2>/dev/null
    local size
    size=$(stat -c %s "$OUT_DIR/$prebuilt"/_C*.so)
    if (( size > MAX_LIBRARY_BYTES )); then
      echo "warning: the build is ${size} bytes, over what comes back; not returned"
      rm -rf "${OUT_DIR:?}/$prebuilt"
    fi
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
  # In 4 worker processes where pytest-xdist is installed (the GPU image has it): a test that
  # crashes its process (a segfault in an op) is then reported as failed and the rest still run.
  local spread=()
  "$PYTHON" -c 'import xdist' 2>/dev/null && spread=(-n 4)
  pytest_step "CUDA tests" junit-cuda.xml -- "${spread[@]}" "${KERNEL_TESTS[@]}"
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

# summary.md holds everything the run found (environment, plan, steps, tests, bench), so it is
# complete on its own whatever becomes of the printed log.
finish() {
  local args=(summary --out "$OUT_DIR/summary.md" --env "$OUT_DIR/env.txt" --steps "$STEPS"
              --title "ShardLM GPU check, part $PART$( (( DRY_RUN )) && echo ' (dry run)'), $(date -u +%FT%TZ)")
  (( ${#JUNITS[@]} )) && args+=(--junit "${JUNITS[@]}")
  [ -f "$OUT_DIR/bench.json" ] && args+=(--bench "$OUT_DIR/bench.json")
  echo; "${SUMMARY[@]}" "${args[@]}"
  if ! "${SUMMARY[@]}" layout "$OUT_DIR"; then
    echo "warning: part of $OUT_DIR would not come back through the device tool" >&2
    (( DRY_RUN )) && FAILED=1
  fi
  echo "results in $OUT_DIR: $(cd "$OUT_DIR" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
}

main() {
  setup_environment
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
  return "$FAILED"
}

# Everything printed goes to the log too, through a pipe the shell waits for: the last lines are
# in the log when the command returns.
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
