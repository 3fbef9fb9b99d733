#!/usr/bin/env bash
# Builds pkg/cudart's test binary, libkvpool.so and the python package's
# test binary into hack/gpu/_bin for a machine without Go (the device
# machine): carry hack/gpu/_bin and run hack/gpu/check.sh there. They load
# libcuda.so.1 at run time and link only libc.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export PATH="/usr/local/go/bin:$PATH"
mkdir -p hack/gpu/_bin
CGO_ENABLED=1 go test -c -o hack/gpu/_bin/cudart.test ./pkg/cudart
# The Python part: the C library the kvpool package loads, and the python
# package's test binary (the Go client side of the comparison, and a
# standalone agent to serve both).
CGO_ENABLED=1 go build -buildmode=c-shared -trimpath -ldflags='-s -w' -o hack/gpu/_bin/libkvpool.so ./cmd/libkvpool
rm -f hack/gpu/_bin/libkvpool.h
CGO_ENABLED=1 go test -c -trimpath -ldflags='-s -w' -o hack/gpu/_bin/python.test ./python
ls -l hack/gpu/_bin/
ldd hack/gpu/_bin/cudart.test || true
