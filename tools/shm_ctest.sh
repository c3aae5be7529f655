#!/usr/bin/env bash
# Builds the torch-free shared-memory core (tests/cpp/) and runs its C++ tests three times: plain (Release with
# asserts), under ThreadSanitizer and under AddressSanitizer + UBSan. Build trees go to
# ${ACCEL_SHM_BUILD:-build/shm}/<variant>; any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."

build_root=${ACCEL_SHM_BUILD:-build/shm}
jobs=${ACCEL_SHM_JOBS:-2}
start=$SECONDS
trap 'echo "shm core: $((SECONDS - start)) s wall time"' EXIT

run_variant() {
  local variant=$1 sanitize=$2 build_type=$3
  local dir="$build_root/$variant"
  echo "== shm core: $variant =="
  cmake -S tests/cpp -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" -DACCEL_SANITIZE="$sanitize" >/dev/null
  cmake --build "$dir" -j "$jobs"
  # One test at a time: several assert time bounds (timeouts, death detection) that parallel load would blur.
  ctest --test-dir "$dir" --output-on-failure
}

run_variant plain "" Release
# RelWithDebInfo: sanitizer reports need line numbers. The fork tests are not built under TSan (see tests/cpp/CMakeLists.txt).
run_variant thread thread RelWithDebInfo
run_variant address address RelWithDebInfo

echo "shm core: all variants passed"
