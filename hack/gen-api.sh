#!/usr/bin/env bash
# Regenerates what controller-gen makes from the API types in api/v1alpha1:
# the deep copies (api/v1alpha1/zz_generated.deepcopy.go) and the KVPoolNode
# CRD (config/crd/kvpool.io_kvpoolnodes.yaml, copied byte for byte to the
# chart's charts/kvpool/crds). Run it after changing api/v1alpha1/types.go
# and commit the results; `go test ./api/...` fails while they are stale
# (when this script has installed the tool; it skips that check otherwise).
#
# controller-gen is built once, at the version pinned here, with
# `go install` (from the Go module proxy) into a per-version cache folder,
# as hack/lint.sh does for golangci-lint. KVPOOL_TOOLS moves the cache
# (default ~/.cache/kvpool/tools, or $XDG_CACHE_HOME/kvpool/tools).
#
#   hack/gen-api.sh           # regenerate
#   hack/gen-api.sh --path    # install if needed; print the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=v0.23.0
tools=${KVPOOL_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/tools}
bin="$tools/controller-gen-$VERSION/controller-gen"

if [ ! -x "$bin" ]; then
  echo "gen-api: installing controller-gen $VERSION into $(dirname "$bin")" >&2
  GOBIN="$(dirname "$bin")" go install "sigs.k8s.io/controller-tools/cmd/controller-gen@$VERSION"
fi
case "${1:-}" in
  --path) echo "$bin"; exit 0 ;;
  "") ;;
  *) echo "gen-api: unknown argument $1 (want none or --path)" >&2; exit 2 ;;
esac

"$bin" object paths=./api/... crd paths=./api/... output:crd:dir=config/crd
cp config/crd/kvpool.io_kvpoolnodes.yaml charts/kvpool/crds/kvpool.io_kvpoolnodes.yaml
