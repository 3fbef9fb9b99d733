#!/usr/bin/env bash
# GPU check for pkg/cudart's real CUDA backend, in one command of at most
# about 8 minutes:
#   1. builds the package's test binary (or uses hack/gpu/_bin/cudart.test,
#      built on another machine by hack/gpu/build.sh, where Go is absent);
#   2. probes for a GPU: with none, prints why and exits 0;
#   3. runs the GPU tests (round trips of random bytes onto poisoned pages,
#      16 KiB to 2 MiB, dense/strided/split layouts, batch and fallback
#      paths, Sync checked by a copy on the caller's stream, event order);
#   4. measures scattered-page bandwidth against a 1 GiB pinned copy in the
#      same run, both directions, both at once, and registration time;
#   5. prints the table last.
# Logs and the table go to $OUT (the device machine's output folder) or to
# hack/gpu/_out.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/hack/gpu/_out}
mkdir -p "$out"
bin=$root/hack/gpu/_bin/cudart.test
export PATH="/usr/local/go/bin:$PATH"

if [ "${KVPOOL_GPU_PREBUILT:-}" != 1 ] && command -v go >/dev/null 2>&1; then
  echo "gpu check: building the test binary ($(go version))"
  mkdir -p "$(dirname "$bin")"
  if ! CGO_ENABLED=1 go test -c -o "$bin" ./pkg/cudart; then
    echo "gpu check: FAILED: build"
    exit 1
  fi
elif [ -x "$bin" ]; then
  echo "gpu check: using the prebuilt $bin ($(stat -c '%y' "$bin" | cut -d. -f1))"
else
  echo "gpu check: FAILED: no Go toolchain and no prebuilt $bin (run hack/gpu/build.sh where Go is, and carry hack/gpu/_bin)"
  exit 1
fi

cd "$root/pkg/cudart"
probe_out=$(timeout 60 "$bin" -test.run '^TestGPUProbe$' -test.v 2>&1)
probe=$(printf '%s\n' "$probe_out" | grep '^GPU-PROBE:' | head -1)
case "$probe" in
  "GPU-PROBE: ok:"*)
    echo "$probe" ;;
  "GPU-PROBE: skip:"*)
    echo "gpu check: skipped: no usable GPU here: ${probe#GPU-PROBE: skip: }"
    exit 0 ;;
  *)
    printf '%s\n' "$probe_out" | tail -20
    echo "gpu check: FAILED: the test binary did not run its probe"
    exit 1 ;;
esac
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 | tee "$out/nvidia-smi.csv"
fi

start=$(date +%s)
KVPOOL_GPU_REQUIRED=1 timeout 240 "$bin" -test.run '^TestGPU(RoundTrip|EventOrdering)$' -test.v -test.count=1 >"$out/gpu-tests.log" 2>&1
rc=$?
grep -E '^\s*--- (FAIL|SKIP)|_test\.go:[0-9]+' "$out/gpu-tests.log" | head -40
echo "gpu check: GPU tests rc=$rc in $(( $(date +%s) - start )) s ($(grep -c -- '--- PASS' "$out/gpu-tests.log") passed), log $out/gpu-tests.log"

start=$(date +%s)
KVPOOL_GPU_REQUIRED=1 KVPOOL_GPU_BENCH=1 KVPOOL_GPU_REPORT="$out/table.md" \
  timeout 200 "$bin" -test.run '^TestGPUBandwidth$' -test.v -test.count=1 >"$out/bench.log" 2>&1
brc=$?
[ $brc -eq 0 ] || tail -20 "$out/bench.log"
echo "gpu check: bandwidth rc=$brc in $(( $(date +%s) - start )) s, log $out/bench.log"

echo
if [ $rc -eq 0 ]; then echo "== GPU tests: PASS"; else echo "== GPU tests: FAIL (rc $rc)"; fi
[ -f "$out/table.md" ] && cat "$out/table.md"
[ $rc -eq 0 ] && [ $brc -eq 0 ]
