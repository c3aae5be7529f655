#!/bin/bash
# ranks.sh WORLD PORT [DEBUGGER]: probe_ranks.py in WORLD processes started by hand (as `accel launch --cpu` sets
# them up), rank 0 under DEBUGGER in batch mode when given (a native backtrace at the crash); ranks' logs in $LOGS.
world=$1 port=$2 dbg=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
threads=$(( $(nproc) / world )); [ "$threads" -ge 1 ] || threads=1
export WORLD_SIZE=$world LOCAL_WORLD_SIZE=$world GROUP_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  ACCEL_USE_CPU=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
pids=()
for r in $(seq 1 $((world - 1))); do
  RANK=$r LOCAL_RANK=$r timeout 150 "$py" "$here/probe_ranks.py" >"$LOGS/rank$r.log" 2>&1 &
  pids+=($!)
done
if [ -n "$dbg" ]; then
  RANK=0 LOCAL_RANK=0 timeout 240 "$dbg" -q -batch -ex 'set pagination off' -ex 'handle SIGPIPE nostop noprint' \
    -ex run -ex 'bt 40' -ex 'info registers rip rsp' -ex 'x/12i $pc-24' -ex 'info symbol $pc' \
    -ex 'info sharedlibrary' --args "$py" "$here/probe_ranks.py" >"$LOGS/rank0.log" 2>&1
else
  RANK=0 LOCAL_RANK=0 timeout 150 "$py" "$here/probe_ranks.py" >"$LOGS/rank0.log" 2>&1
fi
rc0=$?
rcs=()
for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
echo "ranks.sh: world $world, exit codes: rank0=$rc0 others=${rcs[*]}"
