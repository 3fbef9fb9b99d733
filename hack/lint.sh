#!/usr/bin/env bash
# Runs golangci-lint, at the version pinned here, with the repository's
# .golangci.yml over the main module. The binary is built once with
# `go install` (from the Go module proxy) into a per-version cache folder
# and reused after that; arguments go to `golangci-lint run` (default ./...).
#
#   hack/lint.sh              # lint the main module
#   hack/lint.sh ./pkg/pool/  # one package
#
# KVPOOL_TOOLS moves the cache (default ~/.cache/kvpool/tools, or
# $XDG_CACHE_HOME/kvpool/tools).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=v2.15.0
tools=${KVPOOL_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/tools}
bin="$tools/golangci-lint-$VERSION/golangci-lint"

if [ ! -x "$bin" ]; then
  echo "lint: installing golangci-lint $VERSION into $(dirname "$bin")" >&2
  GOBIN="$(dirname "$bin")" go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$VERSION"
fi
if [ $# -eq 0 ]; then
  set -- ./...
fi
exec "$bin" run "$@"
