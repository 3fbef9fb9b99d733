#!/usr/bin/env bash
# Builds pkg/cudart's test binary into hack/gpu/_bin for a machine without
# Go (the device machine): carry hack/gpu/_bin and run hack/gpu/check.sh
# there. The binary loads libcuda.so.1 at run time and links only libc.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PATH="/usr/local/go/bin:$PATH"
mkdir -p hack/gpu/_bin
CGO_ENABLED=1 go test -c -o hack/gpu/_bin/cudart.test ./pkg/cudart
ls -l hack/gpu/_bin/cudart.test
ldd hack/gpu/_bin/cudart.test || true
