#!/usr/bin/env bash
# GPU check for pkg/cudart's real CUDA backend, in one command of at most
# about 8 minutes:
#   1. builds the package's test binary (or uses hack/gpu/_bin/cudart.test,
#      built on another machine by hack/gpu/build.sh, where Go is absent);
#   2. probes for a GPU: with none, prints why and exits 0;
#   3. runs the GPU tests (round trips of random bytes onto poisoned pages,
#      the copy kernel's run lengths among copy-engine runs,
#      16 KiB to 2 MiB, dense/strided/split layouts, batch and fallback
#      paths, Sync checked by a copy on the caller's stream, event order);
#   4. measures scattered-page bandwidth against a 1 GiB pinned copy in the
#      same run, both directions, both at once, and registration time;
#   5. prints the table last;
#   6. the Python part (python/gpu_check.py), where python3 with torch and
#      CUDA exists: byte checks of the kvpool Python client on torch CUDA
#      tensors, then the Python client, the Go client and a torch baseline
#      from the seed's doc side by side on 32 layers x K/V, 16-token pages,
#      bf16; skipped, saying why, without torch or CUDA.
# KVPOOL_GPU_PARTS="go python" (default) picks the parts; KVPOOL_GPU_PY_DRYRUN=1
# runs the Python part on the simulator with CPU tensors (with the fake
# driver below, the whole script runs without a GPU).
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
  case " ${KVPOOL_GPU_PARTS:-go python} " in *" python "*)
    CGO_ENABLED=1 go build -buildmode=c-shared -o "$root/hack/gpu/_bin/libkvpool.so" ./cmd/libkvpool &&
      CGO_ENABLED=1 go test -c -o "$root/hack/gpu/_bin/python.test" ./python ||
      echo "gpu check: WARNING: building the Python part's binaries failed" ;;
  esac
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

parts=" ${KVPOOL_GPU_PARTS:-go python} "
rc=0
brc=0
if [[ $parts == *" go "* ]]; then
start=$(date +%s)
KVPOOL_GPU_REQUIRED=1 timeout 240 "$bin" -test.run '^TestGPU(RoundTrip|CopyKernelSizes|CopyKernelBothWays|EventOrdering)$' -test.v -test.count=1 >"$out/gpu-tests.log" 2>&1
rc=$?
grep -E '^\s*--- (FAIL|SKIP)|_test\.go:[0-9]+' "$out/gpu-tests.log" | head -40
echo "gpu check: GPU tests rc=$rc in $(( $(date +%s) - start )) s ($(grep -c -- '--- PASS' "$out/gpu-tests.log") passed), log $out/gpu-tests.log"

start=$(date +%s)
KVPOOL_GPU_REQUIRED=1 KVPOOL_GPU_BENCH=1 KVPOOL_GPU_REPORT="$out/table.md" \
  timeout 200 "$bin" -test.run '^TestGPUBandwidth$' -test.v -test.count=1 >"$out/bench.log" 2>&1
brc=$?
[ $brc -eq 0 ] || tail -20 "$out/bench.log"
echo "gpu check: bandwidth rc=$brc in $(( $(date +%s) - start )) s, log $out/bench.log"
fi

# The Python part.
prc=0
pystate="not run"
if [[ $parts == *" python "* ]]; then
  py=${KVPOOL_PYTHON:-python3}
  lib=$root/hack/gpu/_bin/libkvpool.so
  helper=$root/hack/gpu/_bin/python.test
  why=""
  pyargs=()
  if ! command -v "$py" >/dev/null 2>&1; then
    why="no $py"
  elif [ "${KVPOOL_GPU_PY_DRYRUN:-}" = 1 ]; then
    # A dry run of this part on the simulator with CPU tensors (no GPU needed;
    # its figures mean nothing).
    pyargs=(--device cpu --kv-heads 1 --head-dim 16 --device-pages 256)
  elif ! reason=$("$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch " + torch.__version__ + " sees no CUDA device")' 2>&1); then
    why="python part needs torch with CUDA: $(printf '%s' "$reason" | tail -1)"
  elif [ ! -f "$lib" ] || [ ! -x "$helper" ]; then
    why="no $lib or $helper (run hack/gpu/build.sh where Go is)"
  fi
  if [ -n "$why" ]; then
    pystate="skipped: $why"
    echo "gpu check (python): $pystate"
  else
    start=$(date +%s)
    adir=$(mktemp -d)
    # The agent's plan names the machine's GPUs as the CUDA clients see
    # them (a session on a GPU the plan does not hold is refused).
    uuids=""
    if [ "${KVPOOL_GPU_PY_DRYRUN:-}" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
      uuids=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | paste -sd, -)
    fi
    KVPOOL_STANDALONE_GPU_UUIDS=$uuids KVPOOL_STANDALONE_AGENT=$adir KVPOOL_STANDALONE_MIB=${KVPOOL_GPU_PY_POOL_MIB:-512} \
      "$helper" -test.run '^TestStandaloneAgentHelper$' -test.v >"$out/py-agent.log" 2>&1 &
    apid=$!
    for _ in $(seq 1 300); do
      grep -q '^AGENT-READY' "$out/py-agent.log" 2>/dev/null && break
      kill -0 $apid 2>/dev/null || break
      sleep 0.1
    done
    read -r _ sock tok < <(grep '^AGENT-READY' "$out/py-agent.log" | head -1)
    if [ -z "${sock:-}" ]; then
      tail -20 "$out/py-agent.log"
      pystate="FAIL (the agent did not start)"
      prc=1
    else
      KVPOOL_SOCKET=$sock KVPOOL_TOKEN=$tok KVPOOL_LIBRARY=$lib \
        timeout 240 "$py" "$root/python/gpu_check.py" --go-bin "$helper" --out "$out" "${pyargs[@]}" >"$out/python.log" 2>&1
      prc=$?
      grep -E '^gpu py check|GPU-PY' "$out/python.log"
      [ $prc -eq 0 ] || tail -30 "$out/python.log"
      if grep -q '^GPU-PY-SKIP' "$out/python.log"; then pystate="skipped: $(grep '^GPU-PY-SKIP' "$out/python.log")"
      elif [ $prc -eq 0 ]; then pystate="PASS"; else pystate="FAIL (rc $prc)"; fi
    fi
    kill $apid 2>/dev/null
    wait $apid 2>/dev/null
    rm -rf "$adir"
    echo "gpu check (python): $pystate in $(( $(date +%s) - start )) s, log $out/python.log"
  fi
fi

echo
if [[ $parts == *" go "* ]]; then
  if [ $rc -eq 0 ]; then echo "== GPU tests: PASS"; else echo "== GPU tests: FAIL (rc $rc)"; fi
  [ -f "$out/table.md" ] && cat "$out/table.md"
fi
if [[ $parts == *" python "* ]]; then
  echo "== Python part: $pystate"
  [ -f "$out/python-table.md" ] && cat "$out/python-table.md"
fi
[ $rc -eq 0 ] && [ $brc -eq 0 ] && [ $prc -eq 0 ]
