#!/usr/bin/env bash
# `make gpu-check` (issue 25): everything accel checks on a machine with an NVIDIA GPU, as one run that always
# finishes and always leaves its results. Steps, most important first:
#   env                the machine: nvidia-smi, driver, CUDA, torch, packages, CPU, memory, disks (env.txt,
#                      machine.json)
#   build              accel's extension with its CUDA kernels (sm_90 by default) in place, then `accel env`; skipped
#                      when accel/_C*.so was built from these very sources for this torch with CUDA kernels
#   tests              every test marked gpu or native_cuda
#   bench-gpu          bench-unscale bench-checkpoint bench-big-model bench-gather-gpu: the GPU benchmarks
#   bench-cpu          bench-allreduce-4 bench-allreduce-8 bench-gather-4: multi-rank CPU benchmarks
#   ops-cpu            the native CPU op tests against this machine's build (not run unless named)
# Every step runs even when an earlier one failed (a step that needs the build then fails on its own), each under its
# own timeout cut to what is left of GPU_CHECK_BUDGET_S, so one hang cannot take the whole run; a step with less
# than 20 s left is skipped as out of time. After every step $OUT holds summary.txt (each step's status and
# seconds, and the end of every failed step's log), env.txt and results.tar.gz (all logs, the pytest-benchmark
# JSON files, the tests' junit XML). Exit status: 0 only when every selected step passed.
#
# Environment: PYTHON (default python3), OUT (default build/gpu), GPU_CHECK_STEPS (default "env build tests
# bench-gpu bench-cpu"; step or group names, "all" for every step), GPU_CHECK_BUDGET_S (default 440),
# ACCEL_BENCH_DIR (default: the first of /dev/shm, /tmp, build/ with 16 GiB free), ACCEL_BENCH_GPU_GIB (default 2),
# TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default: the CPU count). Report: `make gpu-docs GPU_RESULTS=DIR`
# (DIR: results.tar.gz unpacked). How the lead runs it on a lent machine: tools/gpu_check_device.md.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=${PYTHON:-python3}
out=$(realpath -m "${OUT:-build/gpu}")
work="$repo/build/gpu-check"
budget=${GPU_CHECK_BUDGET_S:-440}
reserve=12  # seconds kept for the last packing of $OUT
selected=${GPU_CHECK_STEPS:-"env build tests bench-gpu bench-cpu"}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # the tests' and launchers' subprocesses import this accel
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export ACCEL_BENCH_GPU_GIB=${ACCEL_BENCH_GPU_GIB:-2}
# The venv's own tools (ninja) whatever PATH is; nvcc's toolkit for torch's extension builder.
PATH="$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  PATH="/usr/local/cuda/bin:$PATH"
fi
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  nvcc_path=$(command -v nvcc)
  real_nvcc=$(grep -oE '/[^ ]*/bin/nvcc' "$nvcc_path" 2>/dev/null | head -1 || true)  # nvcc may be a wrapper script
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "${real_nvcc:-$nvcc_path}")")")
fi
[ -n "${CUDA_HOME:-}" ] && export CUDA_HOME
export PATH

expand() {  # the step names a selection stands for, in run order
  local all="env build tests bench-unscale bench-checkpoint bench-big-model bench-gather-gpu bench-allreduce-4"
  all+=" bench-allreduce-8 bench-gather-4 ops-cpu"
  local wanted=" $1 " step
  wanted=${wanted// bench-gpu / bench-unscale bench-checkpoint bench-big-model bench-gather-gpu }
  wanted=${wanted// bench-cpu / bench-allreduce-4 bench-allreduce-8 bench-gather-4 }
  [[ $wanted == *" all "* ]] && wanted=" $all "
  for step in $wanted; do
    if [[ " $all " != *" $step "* ]]; then
      echo "gpu-check: unknown step '$step' (steps: $all, bench-gpu, bench-cpu, all)" >&2
      exit 2
    fi
  done
  for step in $all; do
    if [[ $wanted == *" $step "* ]]; then echo "$step"; fi
  done
}
steps=$(expand "$selected") || exit 2

pick_bench_dir() {  # the first candidate with room for the checkpoint benchmarks' files (up to 7 copies of the model)
  local dir
  for dir in /dev/shm /tmp "$repo/build"; do
    mkdir -p "$dir" 2>/dev/null || continue
    local free_kib
    free_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
    if [ "$free_kib" -ge $((8 * ${ACCEL_BENCH_GPU_GIB%.*} * 1024 * 1024)) ] 2>/dev/null; then
      echo "$dir/accel-gpu-check"
      return
    fi
  done
  echo "$repo/build/accel-gpu-check"
}
export ACCEL_BENCH_DIR=${ACCEL_BENCH_DIR:-$(pick_bench_dir)}

rm -rf "$work"
mkdir -p "$work/logs" "$work/results" "$out" "$ACCEL_BENCH_DIR"
start=$SECONDS
deadline=$((start + budget))
declare -a rows=()  # "step|status|seconds|note"
failed=0

pack() {  # summary.txt, env.txt and results.tar.gz into $OUT: what comes back even if the run is cut short
  {
    echo "gpu-check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $((SECONDS - start)) s of a ${budget} s budget"
    echo "steps: $steps" | tr '\n' ' '
    echo
    [ -f "$work/results/machine.txt" ] && cat "$work/results/machine.txt"
    printf '%-18s %-28s %8s  %s\n' step status seconds note
    local row
    for row in "${rows[@]}"; do
      IFS='|' read -r name status took note <<<"$row"
      printf '%-18s %-28s %8s  %s\n' "$name" "$status" "$took" "$note"
    done
    for row in "${rows[@]}"; do
      IFS='|' read -r name status took note <<<"$row"
      if [[ $status != passed* ]] && [ -s "$work/logs/$name.log" ]; then
        echo
        echo "----- $name: the end of logs/$name.log -----"
        tail -n 40 "$work/logs/$name.log" | cut -c1-400
      fi
    done
  } >"$work/summary.txt"
  cp "$work/summary.txt" "$out/summary.txt"
  [ -f "$work/results/env.txt" ] && cp "$work/results/env.txt" "$out/env.txt"
  tar -czf "$out/results.tar.gz.part" -C "$work" summary.txt logs results 2>/dev/null &&
    mv "$out/results.tar.gz.part" "$out/results.tar.gz"
}

current=""
current_pid=""
on_signal() {  # the caller's own timeout: stop the running step, keep what there is
  [ -n "$current_pid" ] && kill -TERM "$current_pid" 2>/dev/null
  [ -n "$current" ] && rows+=("$current|killed (run timed out)|$((SECONDS - step_start))|")
  pack
  rm -rf "$ACCEL_BENCH_DIR"
  exit 124
}
trap on_signal TERM INT HUP

run_step() {  # run_step NAME LIMIT_S FUNCTION: FUNCTION's output in logs/NAME.log, under min(LIMIT_S, time left)
  local name=$1 limit=$2 fn=$3 left rc status note
  left=$((deadline - SECONDS - reserve))
  if ((left < 20)); then
    rows+=("$name|skipped (out of time)|0|")
    failed=1
    pack
    return
  fi
  ((limit > left)) && limit=$left
  echo "gpu-check: $name (at most ${limit} s)"
  current=$name
  step_start=$SECONDS
  # In the background and waited for, so that a signal reaches on_signal at once; timeout kills the step's
  # process group (pytest, launched ranks) when its time is up.
  timeout --kill-after=10 "$limit" bash -c "$fn" >"$work/logs/$name.log" 2>&1 &
  current_pid=$!
  wait "$current_pid"
  rc=$?
  current=""
  current_pid=""
  local took=$((SECONDS - step_start))
  note=$(step_note "$name")
  case $rc in
    0) status=passed ;;
    124 | 137) status="TIMED OUT at ${limit} s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ $rc -ne 0 ] && failed=1
  rows+=("$name|$status|$took|$note")
  echo "gpu-check: $name: $status in ${took} s${note:+ ($note)}"
  pack
}

step_note() {  # one line on what a step did: pytest's result line, or the build's
  local log="$work/logs/$1.log"
  [ -f "$log" ] || return
  case $1 in
    build) grep -E '^gpu-check-build:' "$log" | tail -1 | cut -c18- ;;
    *) grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | grep -vE '^(E |>)' | tail -1 |
         sed -E 's/=+//g; s/^ +| +$//g' | cut -c1-120 ;;
  esac
}

# --- the steps (each runs in its own bash: exported functions and variables) -----------------------------------------

step_env() {
  "$python" - "$work/results" <<'EOF'
import importlib.metadata, json, os, platform, shutil, subprocess, sys
out = sys.argv[1]
def run(*command):
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"({command[0]}: {error})"
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
import torch
cuda = torch.cuda.is_available()
smi = run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
          "--format=csv,noheader") if shutil.which("nvidia-smi") else ""
machine = {
    "gpu": torch.cuda.get_device_name(0) if cuda else None,
    "gpu_count": torch.cuda.device_count(),
    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
    "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    "nvidia_smi": smi,
    "driver": smi.split(", ")[1] if smi.count(", ") >= 1 else None,
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if cuda else None,
    "nvcc": next((line for line in run("nvcc", "--version").splitlines() if "release" in line), None),
    "cuda_home": os.environ.get("CUDA_HOME"),
    "python": platform.python_version(), "platform": platform.platform(),
    "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                None),
    "cpu_count": os.cpu_count(),
    "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    "bench_dir": os.environ.get("ACCEL_BENCH_DIR"),
    "bench_dir_filesystem": "{1} ({0}, {4} KiB free) on {6}".format(
        *run("df", "-PT", os.environ.get("ACCEL_BENCH_DIR", "/")).splitlines()[-1].split()),
    "packages": {name: version(name) for name in ("torch", "triton", "accelerate", "transformers", "safetensors",
                                                  "numpy", "pytest", "pytest-benchmark", "pytest-timeout", "psutil",
                                                  "hypothesis", "setuptools", "ninja", "matplotlib")},
}
with open(os.path.join(out, "machine.json"), "w") as f:
    json.dump(machine, f, indent=2)
with open(os.path.join(out, "machine.txt"), "w") as f:
    f.write(f"machine: {machine['gpu']} x{machine['gpu_count']} (sm {machine['capability']}, "
            f"{machine['gpu_memory_gib']} GiB), driver {machine['driver']}, torch {machine['torch']} "
            f"(CUDA {machine['torch_cuda']}), {machine['nvcc']}, Python {machine['python']}, "
            f"{machine['cpu_count']} CPUs, {machine['ram_gib']} GiB RAM\n"
            f"bench files: {machine['bench_dir_filesystem']}\n")
print(json.dumps(machine, indent=2))
sys.exit(0 if cuda else "gpu-check: torch.cuda.is_available() is False: no GPU for this torch")
EOF
  local rc=$?
  {
    echo "== nvidia-smi"; nvidia-smi 2>&1
    echo "== nvcc"; command -v nvcc && nvcc --version 2>&1; echo "CUDA_HOME=${CUDA_HOME:-}"
    echo "== compilers"; gcc --version 2>&1 | head -1; ninja --version 2>&1
    echo "== CPU"; lscpu 2>&1 | head -25
    echo "== memory"; free -g 2>&1
    echo "== disks"; df -hT / /tmp /dev/shm "$repo" "$ACCEL_BENCH_DIR" 2>&1
    echo "== machine.json"; cat "$work/results/machine.json" 2>&1
  } >"$work/results/env.txt"
  cat "$work/results/env.txt"
  return $rc
}

# A hash of everything the extension is built from: a build whose stamp holds it needs no rebuild (file times are
# no guide: the working tree is copied afresh to the machine for every run).
source_hash() {
  (cd "$repo" && find csrc setup.py pyproject.toml -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum |
    cut -c1-16)
}

build_is_current() {
  [ "$(cat "$repo/build/gpu-check-build.stamp" 2>/dev/null)" = "$(source_hash)" ] || return 1
  "$python" -c "
import glob, json, sys, torch
info = json.load(open('accel/_build_info.json'))
current = info.get('native') and info.get('cuda') and info.get('torch') == torch.__version__
sys.exit(not (glob.glob('accel/_C*.so') and current))
" 2>/dev/null
}

step_build() {
  if build_is_current; then
    echo "gpu-check-build: up to date (accel/_C was built from these sources for this torch, with CUDA kernels)"
  else
    rm -f accel/_C*.so accel/_build_info.json "$repo/build/gpu-check-build.stamp"
    local t0=$SECONDS
    # One compile, in place (pip install -e would compile again in a temporary folder): PYTHONPATH finds it.
    env ACCEL_BUILD_NATIVE=1 ACCEL_BUILD_CUDA=1 "$python" setup.py build_ext --inplace || return 1
    source_hash >"$repo/build/gpu-check-build.stamp"
    echo "gpu-check-build: compiled in $((SECONDS - t0)) s" \
      "(MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  fi
  "$python" -m accel env || return 1
  "$python" -c "from accel import _ext; s = _ext.status(); print(s); assert s.loaded and s.cuda_kernels, s"
}

step_tests() {
  # A module that cannot be collected (a dependency missing) must not keep the GPU tests from running.
  "$python" -m pytest -p no:cacheprovider -q -rfEs -m "gpu or native_cuda" --continue-on-collection-errors tests/ \
    --junitxml="$work/results/gpu-tests.xml"
}

# pytest-benchmark's flags: timings only; -s shows each case's medians and ratios in the log.
bench_flags="--benchmark-only -p no:cacheprovider -q -s --benchmark-columns=median,iqr,rounds"

has_results() {  # has_results FILE: the JSON holds at least one benchmark (a skipped benchmark measured nothing)
  "$python" -c "
import json, os, sys
ran = os.path.exists(sys.argv[1]) and json.load(open(sys.argv[1]))['benchmarks']
sys.exit(0 if ran else 'gpu-check: no benchmark ran (skipped or failed before its first round): ' + sys.argv[1])
" "$1"
}

bench() {  # bench NAME PYTEST_ARGS...: one benchmark file's run into results/NAME.json
  local name=$1
  shift
  "$python" -m pytest "$@" $bench_flags --benchmark-json="$work/results/$name.json" &&
    has_results "$work/results/$name.json"
}

launched() {  # launched RANKS NAME BENCH_FILE PYTEST_ARGS...: the benchmark in every rank of a CPU job, rank 0 reports
  local ranks=$1 name=$2 file=$3
  shift 3
  "$python" -m accel launch --cpu --num_processes "$ranks" benchmarks/ranked_pytest.py "$file" "$@" $bench_flags \
    --benchmark-json="$work/results/$name.json" && has_results "$work/results/$name.json"
}

step_bench_unscale() { ACCEL_BENCH_ROUNDS=20 bench bench-unscale-cuda benchmarks/bench_unscale.py -k cuda; }
step_bench_checkpoint() { ACCEL_BENCH_ROUNDS=3 bench bench-checkpoint-cuda benchmarks/bench_checkpoint.py -k gpu; }
step_bench_big_model() { ACCEL_BENCH_ROUNDS=3 bench bench-big-model-cuda benchmarks/bench_big_model.py -k gpu; }
step_bench_gather_gpu() { bench bench-gather-cuda benchmarks/bench_gather.py -k one_gpu; }
step_bench_allreduce_4() { launched 4 bench-allreduce-4 benchmarks/bench_allreduce.py; }
step_bench_allreduce_8() { launched 8 bench-allreduce-8 benchmarks/bench_allreduce.py; }
step_bench_gather_4() { launched 4 bench-gather-4 benchmarks/bench_gather.py -k "not one_gpu"; }
step_ops_cpu() {
  "$python" -m pytest -p no:cacheprovider -q -rfE -m "not gpu and not native_cuda" --continue-on-collection-errors \
    tests/ops tests/checkpoint/test_safetensors_io.py --junitxml="$work/results/ops-cpu.xml"
}

export python repo work bench_flags
export -f step_env source_hash build_is_current step_build step_tests has_results bench launched step_bench_unscale \
  step_bench_checkpoint step_bench_big_model step_bench_gather_gpu step_bench_allreduce_4 step_bench_allreduce_8 \
  step_bench_gather_4 step_ops_cpu

declare -A limits=([env]=60 [build]=420 [tests]=240 [bench-unscale]=120 [bench-checkpoint]=150 [bench-big-model]=120
  [bench-gather-gpu]=60 [bench-allreduce-4]=90 [bench-allreduce-8]=120 [bench-gather-4]=120 [ops-cpu]=150)

echo "gpu-check: steps $(echo $steps), budget ${budget} s, benchmark files in $ACCEL_BENCH_DIR, results in $out"
for step in $steps; do
  run_step "$step" "${limits[$step]}" "step_${step//-/_}"
done
rm -rf "$ACCEL_BENCH_DIR"
pack
# Last, so that it ends the output the caller sees: the end of each failed step's log, then the table.
for row in "${rows[@]}"; do
  IFS='|' read -r name status took note <<<"$row"
  if [[ $status != passed* ]] && [ -s "$work/logs/$name.log" ]; then
    echo "----- $name: the end of its log -----"
    tail -n 15 "$work/logs/$name.log" | cut -c1-300
  fi
done
echo
sed -n '1,/^-----/p' "$work/summary.txt" | grep -v '^-----'
exit $failed
