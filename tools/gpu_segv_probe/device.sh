#!/bin/bash
# The H200 SIGSEGV probe (issue 25: bench-gather-4 crashed on every rank at its first shm_pad_across_processes
# call there, torch 2.11, and never here). From the repo root on the device:
#   tools/gpu_segv_probe/device.sh      (about 4-5 minutes; give the device run timeout_s 560)
# Steps: env facts; the probes with tools/gpu_segv_probe/C_gcc12.so when it is there (an extension built on a dev
# machine against the device's torch and Python, carried in; not committed); then with the extension built there
# with CUDA (as make gpu-check builds it), then built there without CUDA; a crashing step is rerun with rank 0 (or
# the single process) under cuda-gdb for a native backtrace.
# Back in $OUT: summary.txt, logs.tar.gz (every log), C_device_cuda.so.gz and C_device_cpu.so.gz.
set -u
cd "$(dirname "$0")/../.."
P=tools/gpu_segv_probe L=$OUT/logs
mkdir -p "$L"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3} so=accel/_C.cpython-312-x86_64-linux-gnu.so
dbg=$(command -v cuda-gdb || command -v gdb || echo "")
S=$OUT/summary.txt
note() { echo "$*" | tee -a "$S"; }
probe() {  # probe NAME: the single-process probe, then 4 ranks; each crash rerun under the debugger
  local n=$1 rc
  timeout 90 $py $P/probe_single.py >"$L/$n-single.log" 2>&1; rc=$?
  note "$n single: rc=$rc ($(tail -n 1 "$L/$n-single.log"))"
  if [ $rc -ne 0 ] && [ -n "$dbg" ]; then
    timeout 180 "$dbg" -q -batch -ex run -ex 'bt 40' -ex 'x/12i $pc-24' -ex 'info registers' \
      --args $py $P/probe_single.py >"$L/$n-single-gdb.log" 2>&1
  fi
  mkdir -p "$L/$n-ranks"; LOGS=$L/$n-ranks $P/ranks.sh 4 $((29500 + RANDOM % 400)) | tee -a "$S"
  if grep -q "Segmentation\|SIGSEGV" "$L/$n-ranks"/*.log && [ -n "$dbg" ]; then
    mkdir -p "$L/$n-ranks-gdb"; LOGS=$L/$n-ranks-gdb $P/ranks.sh 4 $((29900 + RANDOM % 90)) "$dbg" | tee -a "$S"
  fi
}
pack() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs; }  # after every step: a cut-short run still returns its logs
build() {  # build NAME CUDA(0|1)
  local t=$SECONDS
  ACCEL_BUILD_NATIVE=1 ACCEL_BUILD_CUDA=$2 MAX_JOBS=$(nproc) TORCH_CUDA_ARCH_LIST=9.0a $py setup.py build_ext \
    --inplace >"$L/build-$1.log" 2>&1
  note "build $1: rc=$? in $((SECONDS - t)) s"
}
{ $py -VV; ulimit -a; nproc; gcc --version | head -1; ldd --version | head -1; uname -a
  grep -E "NoNewPrivs|Seccomp|Cpus_allowed_list" /proc/self/status; cat /sys/kernel/mm/transparent_hugepage/enabled
  env | grep -E "^(OMP|KMP|MKL|LD_|PYTHON|TORCH|ACCEL|CUDA)" ; $py -m pip list 2>/dev/null; } >"$L/env.log" 2>&1
note "debugger: ${dbg:-none}"
pack
if [ -f $P/C_gcc12.so ]; then cp $P/C_gcc12.so $so && probe gcc12; pack; fi
build cuda 1 && gzip -c $so >"$OUT/C_device_cuda.so.gz"; ldd $so >>"$L/env.log" 2>&1
probe device-cuda; pack
build cpu 0 && gzip -c $so >"$OUT/C_device_cpu.so.gz"
probe device-cpu; pack && rm -rf "$L"
