#!/usr/bin/env bash
# run.sh: kvpool end-to-end on a real single-node Kubernetes made of host
# processes (etcd, kube-apiserver, containerd, kubelet) on this machine.
#
#   hack/e2e/run.sh            preflight, packages, builds, node up, e2e test, teardown
#
# Environment:
#   KVPOOL_E2E=0               skip the whole stage (says so and exits 0)
#   KVPOOL_E2E_KEEP=1          leave the node running after the test (tear down
#                              later with hack/e2e/cluster.sh down)
#   KVPOOL_E2E_RUN=DIR         run directory (default /tmp/kvpool-e2e)
#   KVPOOL_E2E_TEST_ARGS=...   extra `go test` arguments, e.g. "-run TestNode"
#
# Exit status: 0 when the test passed or the stage was skipped because the
# sandbox cannot run containerd/kubelet (the reason is printed); non-zero on
# any failure after preflight.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$E2E_DIR/../.." && pwd)"
TOOLS="$E2E_DIR/tools"
WORK="$E2E_DIR/_work"
export KVPOOL_E2E_BIN="$WORK/bin"
export KVPOOL_E2E_RUN="${KVPOOL_E2E_RUN:-/tmp/kvpool-e2e}"
export PATH="/usr/local/go/bin:$PATH"
RUN="$KVPOOL_E2E_RUN"

STAGE_START=$SECONDS
STEP_NAME="" STEP_START=0
TIMINGS=()
step_end() {
  if [ -n "$STEP_NAME" ]; then
    local d=$((SECONDS - STEP_START))
    TIMINGS+=("$(printf '%-22s %4ds' "$STEP_NAME" "$d")")
    printf '[e2e] --- %s: %ds\n' "$STEP_NAME" "$d"
  fi
  STEP_NAME=""
}
step() {
  step_end
  STEP_NAME=$1 STEP_START=$SECONDS
  printf '\n[e2e] === %s (%s)\n' "$1" "$(date -u +%T)"
}
summary() {
  step_end
  echo
  echo "[e2e] step timings:"
  local t
  for t in "${TIMINGS[@]}"; do echo "[e2e]   $t"; done
  printf '[e2e]   %-22s %4ds\n' "total" "$((SECONDS - STAGE_START))"
}
skip() {
  echo "[e2e] SKIPPED: $*"
  echo "[e2e] (the e2e stage needs root, overlayfs, writable cgroups and namespaces to run containerd and a kubelet)"
  exit 0
}

if [ "${KVPOOL_E2E:-1}" = "0" ]; then
  echo "[e2e] SKIPPED: KVPOOL_E2E=0 was set"
  exit 0
fi

# ---------------------------------------------------------------- preflight
step preflight
[ "$(uname -s)" = Linux ] || skip "not Linux ($(uname -s))"
[ "$(id -u)" = 0 ] || skip "not root (uid $(id -u)); kubelet and containerd need root"
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
grep -qw overlay /proc/filesystems || skip "the kernel has no overlayfs (containerd's snapshotter)"
if [ -d /sys/fs/cgroup/memory ]; then
  probe=/sys/fs/cgroup/memory/kvpool-e2e-probe.$$
  mkdir "$probe" 2>/dev/null && rmdir "$probe" || skip "cgroup v1 memory hierarchy is not writable"
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  probe=/sys/fs/cgroup/kvpool-e2e-probe.$$
  mkdir "$probe" 2>/dev/null && rmdir "$probe" || skip "cgroup v2 hierarchy is not writable"
else
  skip "no cgroup memory controller mounted"
fi
command -v unshare >/dev/null || skip "unshare(1) missing, cannot probe namespaces"
unshare --mount --pid --net --uts --ipc --fork true 2>/dev/null || skip "cannot create mount/pid/net/uts/ipc namespaces (unshare failed)"
"$E2E_DIR/cluster.sh" down >/dev/null 2>&1 || true # our own leftovers (KVPOOL_E2E_KEEP=1, a killed run)
# Our containerd has its own socket, root and state; a kubelet would share
# /var/lib/kubelet (device plugins) with ours.
if pgrep -x kubelet >/dev/null; then
  skip "a kubelet already runs on this machine (pid $(pgrep -x kubelet | head -1)); this stage brings its own and will not share /var/lib/kubelet with it"
fi
command -v go >/dev/null || { echo "[e2e] FAIL: Go is not installed" >&2; exit 1; }
echo "[e2e] preflight ok: $(uname -r), root, overlayfs, writable cgroups, namespaces"

# From here on every failure fails the stage, and the node is always torn down.
cleanup() {
  local rc=$?
  if [ "${KVPOOL_E2E_KEEP:-0}" = 1 ] && [ $rc = 0 ]; then
    echo "[e2e] KVPOOL_E2E_KEEP=1: node left running; stop it with: $E2E_DIR/cluster.sh down"
  else
    step teardown
    "$E2E_DIR/cluster.sh" down || true
    [ -d "$RUN/agent" ] && rm -rf "$RUN/agent" || true
  fi
  summary
  if [ $rc != 0 ]; then
    echo "[e2e] FAILED (exit $rc); component logs:"
    for f in "$RUN"/logs/*.log; do
      [ -f "$f" ] || continue
      echo "[e2e] ----- tail of $f"
      tail -n 25 "$f"
    done
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------ packages
step packages
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
{ [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || need+=(busybox-static)  # static: it runs inside the image
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || skip "packages missing (${need[*]}) and no apt-get to install them"
  echo "[e2e] apt-get install ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }
fi
echo "[e2e] $(etcd --version | head -1); $(containerd --version | cut -d' ' -f3); runc $(runc --version | head -1 | cut -d' ' -f3)"

# ------------------------------------------- the Kubernetes binaries, cached
# kube-apiserver, kube-controller-manager, kube-scheduler and kubelet come
# from one `go build` (shared packages compile once). The result is kept in
# a cache outside the clone, keyed on what decides it (tools/go.sum, the Go
# version, the Kubernetes version and the binary list), so a fresh clone on
# the same machine reuses it; KVPOOL_E2E_CACHE moves it.
step build-kubernetes
mkdir -p "$KVPOOL_E2E_BIN"
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
k8sver=$(cd "$TOOLS" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
CACHE="${KVPOOL_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool-e2e}"
key=$({ cat "$TOOLS/go.sum"; go version; echo "$k8sver ${K8S_BINS[*]} v1"; } | sha256sum | cut -c1-16)
kdir="$CACHE/k8s-$key"
have=1
for b in "${K8S_BINS[@]}"; do [ -x "$kdir/$b" ] || have=0; done
if [ $have = 1 ]; then
  echo "[e2e] cached Kubernetes $k8sver binaries ($key) in $kdir"
else
  minor=$(echo "$k8sver" | cut -d. -f2)
  rm -rf "$kdir.tmp" && mkdir -p "$kdir.tmp"
  pkgs=()
  for b in "${K8S_BINS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  (cd "$TOOLS" && go build -trimpath -o "$kdir.tmp/" \
    -ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8sver -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor" \
    "${pkgs[@]}")
  rm -rf "$kdir" && mv "$kdir.tmp" "$kdir"
  # Older keys are of no use once the inputs changed.
  find "$CACHE" -maxdepth 1 -name 'k8s-*' ! -name "k8s-$key" -exec rm -rf {} + 2>/dev/null || true
  echo "[e2e] built Kubernetes $k8sver binaries into $kdir"
fi
for b in "${K8S_BINS[@]}"; do ln -sfn "$kdir/$b" "$KVPOOL_E2E_BIN/$b"; done

# ---------------------------------------------- containerd 2.x, cached
# containerd, its runc shim and ctr from github.com/containerd/containerd/v2
# (the version containerd/go.mod pins; Debian's 1.6 has no CDI, which DRA
# drivers' container edits need), cached like the Kubernetes binaries: keyed
# on containerd/go.sum, the Go version and the binary list. runc is Debian's.
# cluster.sh uses them when $KVPOOL_E2E_BIN/containerd/ has them.
step build-containerd
CTRD_MOD="$E2E_DIR/containerd"
CTRD_BINS=(containerd containerd-shim-runc-v2 ctr)
ctrdver=$(cd "$CTRD_MOD" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)
ckey=$({ cat "$CTRD_MOD/go.sum"; go version; echo "$ctrdver ${CTRD_BINS[*]} v1"; } | sha256sum | cut -c1-16)
cdir="$CACHE/containerd-$ckey"
have=1
for b in "${CTRD_BINS[@]}"; do [ -x "$cdir/$b" ] || have=0; done
if [ $have = 1 ]; then
  echo "[e2e] cached containerd $ctrdver binaries ($ckey) in $cdir"
else
  rm -rf "$cdir.tmp" && mkdir -p "$cdir.tmp"
  pkgs=()
  for b in "${CTRD_BINS[@]}"; do pkgs+=("github.com/containerd/containerd/v2/cmd/$b"); done
  # Static, without cgo: the btrfs snapshotter (cgo) is left out; the
  # node uses overlayfs.
  (cd "$CTRD_MOD" && CGO_ENABLED=0 go build -trimpath -tags urfave_cli_no_docs -o "$cdir.tmp/" \
    -ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$ctrdver" "${pkgs[@]}")
  rm -rf "$cdir" && mv "$cdir.tmp" "$cdir"
  find "$CACHE" -maxdepth 1 -name 'containerd-*' ! -name "containerd-$ckey" -exec rm -rf {} + 2>/dev/null || true
  echo "[e2e] built containerd $ctrdver binaries into $cdir"
fi
mkdir -p "$KVPOOL_E2E_BIN/containerd"
for b in "${CTRD_BINS[@]}"; do ln -sfn "$cdir/$b" "$KVPOOL_E2E_BIN/containerd/$b"; done
"$KVPOOL_E2E_BIN/containerd/containerd" --version | sed 's/^/[e2e] /'

# ------------------------------------------------------------ our binaries
step build-kvpool
(cd "$TOOLS" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$KVPOOL_E2E_BIN/" ./cmd/pause ./cmd/ociimage)
# The test GPU DRA driver (its own module: the DRA helper stays out of the
# tools module, whose go.sum keys the Kubernetes binaries' cache). A host
# process: built with the flags of e2e.test below, whose client-go it shares.
(cd "$TOOLS/gpudra" && go build -o "$KVPOOL_E2E_BIN/gpudra" . && go vet .)
# The agent as the Dockerfile builds it (cgo: go-nvml dlopens NVML through
# glibc), with the compile flags of `go build ./...` so CI's build cache
# serves it; -s -w only change the link.
(cd "$ROOT" && CGO_ENABLED=1 go build -ldflags="-s -w" -o "$KVPOOL_E2E_BIN/agent" ./cmd/agent)
if [ -d "$ROOT/cmd/kvclient" ]; then
  (cd "$ROOT" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$KVPOOL_E2E_BIN/kvclient" ./cmd/kvclient)
else
  rm -f "$KVPOOL_E2E_BIN/kvclient"
  echo "[e2e] cmd/kvclient is not in this tree yet: the image carries no client"
fi
# KVPOOL_E2E_REPO (default: this tree) is where the chart and the example
# manifests are read from.
export KVPOOL_E2E_REPO="${KVPOOL_E2E_REPO:-$ROOT}"
if [ -f "$KVPOOL_E2E_REPO/charts/kvpool/Chart.yaml" ]; then
  (cd "$E2E_DIR/chart" && go build -o "$KVPOOL_E2E_BIN/kvpool-helm" . && go vet . && go test -count=1 .)
else
  rm -f "$KVPOOL_E2E_BIN/kvpool-helm"
  echo "[e2e] charts/kvpool is not in this tree yet: no chart to render"
fi
(cd "$TOOLS" && go test -c -o "$KVPOOL_E2E_BIN/e2e.test" ./e2e && go vet ./cmd/... ./e2e ./gpuplugin && env -u KVPOOL_E2E_RUN -u KUBECONFIG go test -count=1 ./cmd/... ./e2e ./gpuplugin)  # no node yet: only the node-free tests run
ls -laL "$KVPOOL_E2E_BIN" | sed 's/^/[e2e]   /'

# ------------------------------------------------------------------ images
step images
# A sandbox (pause) image and a workload image; both hold the static pause
# binary, busybox (sh for env checks) and, when it exists, the kvclient.
"$E2E_DIR/cluster.sh" down >/dev/null 2>&1 || true
rm -rf "$RUN"
mkdir -p "$RUN/images"
files=(-file /pause="$KVPOOL_E2E_BIN/pause" -file /bin/busybox=/bin/busybox)
for app in sh cat ls test env sleep grep stat wc head tail printf; do files+=(-link "/bin/$app=busybox"); done
[ -x "$KVPOOL_E2E_BIN/kvclient" ] && files+=(-file /kvclient="$KVPOOL_E2E_BIN/kvclient")
"$KVPOOL_E2E_BIN/ociimage" -o "$RUN/images/e2e.tar" -entrypoint /pause \
  -name kvpool.local/pause:e2e -name kvpool.local/e2e:dev "${files[@]}"
# The agent image the chart installs, as the Dockerfile's runtime has it:
# the binary at the same path plus the shared libraries it is linked
# against (glibc and its loader, found with ldd), at the paths the binary
# names. No shell, nothing else.
files=(-file /usr/local/bin/kvpool-agent="$KVPOOL_E2E_BIN/agent")
while read -r lib; do
  files+=(-file "$lib=$(readlink -f "$lib")")
done < <(ldd "$KVPOOL_E2E_BIN/agent" | grep -o '/[^ ]*' | sort -u)
"$KVPOOL_E2E_BIN/ociimage" -o "$RUN/images/agent.tar" -entrypoint /usr/local/bin/kvpool-agent \
  -name kvpool.local/kvpool-agent:e2e "${files[@]}"
printf '[e2e] agent image: %s\n' "${files[*]}"
ls -la "$RUN/images" | sed 's/^/[e2e]   /'

# ---------------------------------------------------------------- node up
step node-up
"$E2E_DIR/cluster.sh" up

# ------------------------------------------------------------------- test
step e2e-test
set -a
eval "$("$E2E_DIR/cluster.sh" env)"
set +a
export KVPOOL_E2E_AGENT="$KVPOOL_E2E_BIN/agent"
[ -x "$KVPOOL_E2E_BIN/kvclient" ] && export KVPOOL_E2E_KVCLIENT="$KVPOOL_E2E_BIN/kvclient"
[ -x "$KVPOOL_E2E_BIN/kvpool-helm" ] && export KVPOOL_E2E_HELM="$KVPOOL_E2E_BIN/kvpool-helm"
[ -x "$KVPOOL_E2E_BIN/gpudra" ] && export KVPOOL_E2E_GPUDRA="$KVPOOL_E2E_BIN/gpudra"
export KVPOOL_E2E_AGENT_IMAGE=kvpool.local/kvpool-agent:e2e
(cd "$TOOLS/e2e" && "$KVPOOL_E2E_BIN/e2e.test" -test.v -test.timeout 15m ${KVPOOL_E2E_TEST_ARGS:-})

# The chart's own server-side dry run of every value set (test/chart, issue
# 7) against this apiserver, when the tree has it and kubectl is installed.
if [ -z "${KVPOOL_E2E_TEST_ARGS:-}" ] && [ -f "$ROOT/test/chart/dryrun_test.go" ]; then
  step chart-dry-run
  if command -v kubectl >/dev/null; then
    # No race detector: the dry run only renders and hands manifests to
    # kubectl; nothing of ours runs concurrently.
    (cd "$ROOT/test/chart" && KVPOOL_DRYRUN_KUBECONFIG="$KUBECONFIG" go test -count=1 -run DryRun .) # its own module
  else
    echo "[e2e] kubectl is not installed: test/chart's dry run is skipped (TestChartServerDryRun above covered the chart's defaults and the examples)"
  fi
fi

# The agent's KVPoolNode client against a real apiserver of the same build
# (internal/nodestatus's envtest test: it starts its own kube-apiserver and
# etcd from these binaries), with kubectl for the printer columns when the
# machine has one.
if [ -z "${KVPOOL_E2E_TEST_ARGS:-}" ] && [ -f "$ROOT/internal/nodestatus/envtest_test.go" ]; then
  step nodestatus-envtest
  assets="$WORK/envtest-bin" # in the work folder: a failed run leaves nothing elsewhere
  rm -rf "$assets" && mkdir -p "$assets"
  ln -s "$kdir/kube-apiserver" "$(command -v etcd)" "$assets/"
  if command -v kubectl >/dev/null; then ln -s "$(command -v kubectl)" "$assets/"; fi
  (cd "$ROOT" && KUBEBUILDER_ASSETS="$assets" go test -count=1 -tags envtest -run Envtest ./internal/nodestatus/)
fi
