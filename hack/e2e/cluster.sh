#!/usr/bin/env bash
# cluster.sh: a one-node Kubernetes "cluster" made of host processes
# (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd,
# kubelet), all private to one run directory and on free ports outside the
# kernel's ephemeral range, so nothing else on the machine is touched.
#
#   hack/e2e/cluster.sh up               start everything, wait for health
#   hack/e2e/cluster.sh down             stop everything, remove mounts, cgroups, links
#   hack/e2e/cluster.sh restart-kubelet  stop the kubelet and start it again
#   hack/e2e/cluster.sh env              print the variables the e2e test reads
#
# Binaries come from $KVPOOL_E2E_BIN (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, built by run.sh) and from the Debian packages etcd-server, containerd, runc,
# containernetworking-plugins.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="${KVPOOL_E2E_BIN:-$E2E_DIR/_work/bin}"
RUN="${KVPOOL_E2E_RUN:-/tmp/kvpool-e2e}"
NODE="${KVPOOL_E2E_NODE:-kvpool-e2e-node}"
# Ports: each component gets the first free port at or above its default,
# all below the ephemeral range (32768-60999) so that no outgoing connection
# can hold them. up writes the choice to $RUN/ports.env; the other commands
# read it back. KVPOOL_E2E_<NAME>_PORT pins one.
PORT_NAMES="ETCD ETCD_PEER API KUBELET KUBELET_HEALTHZ SCHEDULER CONTROLLER_MANAGER"
declare -A PORT_DEFAULT=([ETCD]=23790 [ETCD_PEER]=23791 [API]=26443 [KUBELET]=30250
  [KUBELET_HEALTHZ]=30248 [SCHEDULER]=30259 [CONTROLLER_MANAGER]=30257)
# The pod network. The bridge and its gateway address exist before the
# apiserver starts: the apiserver listens on the gateway address, which pods
# reach through their default route (there is no kube-proxy).
POD_SUBNET=10.244.77.0/24
GATEWAY_IP=10.244.77.1
SERVICE_CIDR=10.0.0.0/24
SERVICE_IP=10.0.0.1
TOKEN="${KVPOOL_E2E_TOKEN:-kvpool-e2e-admin-token}"
BRIDGE="kvpoole2e0"
CNI_BIN="${KVPOOL_E2E_CNI_BIN:-/usr/lib/cni}"
CTRD_SOCK="$RUN/containerd/containerd.sock"
# containerd: the 2.x that run.sh builds (CDI on, for the DRA tests) when
# $BIN/containerd/ has it, else the system's (Debian's 1.6, no CDI).
CTRD_DIR="${KVPOOL_E2E_CONTAINERD:-$BIN/containerd}"
if [ -x "$CTRD_DIR/containerd" ] && [ -x "$CTRD_DIR/containerd-shim-runc-v2" ] && [ -x "$CTRD_DIR/ctr" ]; then
  CTRD_BIN="$CTRD_DIR/containerd" CTR="$CTRD_DIR/ctr" CTRD_V2=1
else
  CTRD_BIN=containerd CTR=ctr CTRD_V2=0
fi
# CDI specs (DRA drivers write them, containerd 2.x reads them): private to
# the run, as everything else.
CDI_DIR="$RUN/cdi"
# The kubelet keeps device plugin sockets in /var/lib/kubelet/device-plugins
# whatever its --root-dir, and the agent finds device-plugins/ and
# pod-resources/ under one directory, so the kubelet gets its default root.
# down removes it again when up created it.
KUBELET_ROOT=/var/lib/kubelet

log() { printf '[cluster %s] %s\n' "$(date -u +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

port_in_use() { ss -Htan "( sport = :$1 )" 2>/dev/null | grep -q .; }

# pick_ports chooses a free port for each component and saves them.
pick_ports() {
  local name p taken=" " var
  : >"$RUN/ports.env"
  for name in $PORT_NAMES; do
    var="KVPOOL_E2E_${name}_PORT"
    if [ -n "${!var:-}" ]; then
      p=${!var}
    else
      p=${PORT_DEFAULT[$name]}
      while port_in_use "$p" || [[ $taken == *" $p "* ]]; do
        p=$((p + 1))
        [ "$p" -lt 32768 ] || die "no free port for $name below the ephemeral range"
      done
    fi
    taken+="$p "
    echo "${name}_PORT=$p" >>"$RUN/ports.env"
  done
  log "ports: $(tr '\n' ' ' <"$RUN/ports.env")"
}

load_ports() {
  if [ -f "$RUN/ports.env" ]; then
    # shellcheck disable=SC1091
    . "$RUN/ports.env"
  fi
  local name var
  for name in $PORT_NAMES; do
    var="${name}_PORT"
    [ -n "${!var:-}" ] || printf -v "$var" '%s' "${PORT_DEFAULT[$name]}"
  done
}

# start NAME CMD...: run CMD in the background with its log under $RUN/logs
# and its pid in $RUN/pids/NAME.
start() {
  local name=$1; shift
  mkdir -p "$RUN/logs" "$RUN/pids"
  setsid "$@" >>"$RUN/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/pids/$name"
  log "started $name (pid $!)"
}

# stop NAME: SIGTERM the process we started, SIGKILL after 10 s.
stop() {
  local name=$1 pidfile="$RUN/pids/$1" pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$name (pid $pid) ignored SIGTERM; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
  log "stopped $name"
}

alive() { [ -f "$RUN/pids/$1" ] && kill -0 "$(cat "$RUN/pids/$1")" 2>/dev/null; }

# wait_for WHAT SECONDS CMD...: poll CMD every 0.5 s; on timeout show the
# component's log tail and fail.
wait_for() {
  local what=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ! alive "$what"; then
      tail -n 40 "$RUN/logs/$what.log" >&2 || true
      die "$what exited while starting (log: $RUN/logs/$what.log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 40 "$RUN/logs/$what.log" >&2 || true
      die "$what not healthy after ${secs}s (log: $RUN/logs/$what.log)"
    fi
    sleep 0.5
  done
  log "$what healthy"
}

# write_containerd_v2_config: Debian's containerd 1.6 (config version 2).
write_containerd_v2_config() {
  cat >"$RUN/containerd/config.toml" <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$CTRD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "kvpool.local/pause:e2e"
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$RUN/cni/net.d"
EOF
}

# write_containerd_v3_config: the containerd 2.x run.sh builds (config
# version 3, read and migrated by 2.4). CDI is always on in 2.x; its spec
# directory is the run's.
write_containerd_v3_config() {
  mkdir -p "$CDI_DIR"
  cat >"$RUN/containerd/config.toml" <<EOF
version = 3
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$CTRD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "kvpool.local/pause:e2e"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  cdi_spec_dirs = ["$CDI_DIR"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$RUN/cni/net.d"
EOF
}

write_configs() {
  mkdir -p "$RUN"/{pki,etcd,containerd/root,containerd/state,cni/net.d,kubelet,logs,pids,sock,state}
  if [ ! -f "$RUN/pki/sa.key" ]; then
    openssl genrsa -out "$RUN/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$RUN/pki/sa.key" -pubout -out "$RUN/pki/sa.pub" 2>/dev/null
  fi
  # A CA of the run and the apiserver's serving certificate, valid for every
  # name a client uses: the pod network's gateway (host and pods) and the
  # kubernetes Service. The controller-manager publishes the CA as
  # kube-root-ca.crt, so service-account clients verify the apiserver.
  if [ ! -f "$RUN/pki/apiserver.crt" ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=kvpool-e2e-ca" \
      -keyout "$RUN/pki/ca.key" -out "$RUN/pki/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
      -keyout "$RUN/pki/apiserver.key" -out "$RUN/pki/apiserver.csr" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' \
      "$GATEWAY_IP" "$SERVICE_IP" >"$RUN/pki/apiserver.ext"
    openssl x509 -req -in "$RUN/pki/apiserver.csr" -CA "$RUN/pki/ca.crt" -CAkey "$RUN/pki/ca.key" -CAcreateserial \
      -days 2 -extfile "$RUN/pki/apiserver.ext" -out "$RUN/pki/apiserver.crt" 2>/dev/null
  fi
  echo "$TOKEN,admin,admin,system:masters" >"$RUN/pki/tokens.csv"

  cat >"$RUN/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://$GATEWAY_IP:$API_PORT
    certificate-authority: $RUN/pki/ca.crt
users:
- name: admin
  user:
    token: $TOKEN
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
EOF

  if [ "$CTRD_V2" = 1 ]; then
    write_containerd_v3_config
  else
    write_containerd_v2_config
  fi

  cat >"$RUN/cni/net.d/10-kvpool-e2e.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "kvpool-e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$RUN/cni/ipam",
        "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$GATEWAY_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "loopback"}
  ]
}
EOF

  cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$CTRD_SOCK
address: 127.0.0.1
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
failSwapOn: false
registerNode: true
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%"}
nodeStatusUpdateFrequency: 2s
nodeStatusReportFrequency: 2s
syncFrequency: 5s
fileCheckFrequency: 5s
resolvConf: /etc/resolv.conf
# As docs/install.md recommends for GPU nodes: a pod's devices (GPUs, kvpool
# chunks) on one NUMA node, all its containers together.
topologyManagerPolicy: single-numa-node
topologyManagerScope: pod
EOF
}

up() {
  local b c img
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    [ -x "$BIN/$b" ] || die "missing $BIN/$b (run hack/e2e/run.sh, which builds it)"
  done
  for c in etcd containerd runc ctr openssl curl ss ip; do command -v "$c" >/dev/null || die "missing $c (apt-get install etcd-server containerd runc openssl curl iproute2)"; done
  [ -x "$CNI_BIN/bridge" ] || die "missing $CNI_BIN/bridge (apt-get install containernetworking-plugins)"
  mkdir -p "$RUN"
  pick_ports
  load_ports
  write_configs

  # The pod network's bridge with its gateway address, before anything
  # listens on it (the CNI bridge plugin adopts it).
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$GATEWAY_IP/${POD_SUBNET#*/}" dev "$BRIDGE"
  ip link set "$BRIDGE" up

  start etcd etcd --name kvpool-e2e --data-dir "$RUN/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "kvpool-e2e=http://127.0.0.1:$ETCD_PEER_PORT"
  wait_for etcd 30 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

  # It listens on the pod network's gateway address only: pods reach it
  # there through their default route (there is no kube-proxy; the chart is
  # installed with KUBERNETES_SERVICE_HOST/PORT naming it), and so does the
  # host. ServiceAccount admission is on, so pods get tokens.
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --cert-dir="$RUN/pki" --tls-cert-file="$RUN/pki/apiserver.crt" --tls-private-key-file="$RUN/pki/apiserver.key" \
    --secure-port="$API_PORT" --bind-address="$GATEWAY_IP" --advertise-address="$GATEWAY_IP" \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$RUN/pki/sa.pub" --service-account-signing-key-file="$RUN/pki/sa.key" \
    --token-auth-file="$RUN/pki/tokens.csv" --authorization-mode=RBAC \
    --service-cluster-ip-range="$SERVICE_CIDR"
  wait_for kube-apiserver 90 curl -fsS --cacert "$RUN/pki/ca.crt" -H "Authorization: Bearer $TOKEN" "https://$GATEWAY_IP:$API_PORT/readyz"

  # The controllers the chart needs: DaemonSet pods, garbage collection of
  # what helm uninstall deletes, the Node's not-ready taint, service
  # accounts, their tokens and kube-root-ca.crt (the CA in token volumes);
  # and for DRA the ResourceClaims of pods' claim templates and their
  # reservations.
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$RUN/kubeconfig" --authentication-kubeconfig="$RUN/kubeconfig" --authorization-kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$CONTROLLER_MANAGER_PORT" --cert-dir="$RUN/pki/controller-manager" \
    --leader-elect=false --use-service-account-credentials=false \
    --service-account-private-key-file="$RUN/pki/sa.key" --root-ca-file="$RUN/pki/ca.crt" \
    --controllers=daemonset-controller,garbage-collector-controller,node-lifecycle-controller,serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,resourceclaim-controller
  wait_for kube-controller-manager 60 curl -fsSk "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz"
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$RUN/kubeconfig" --authentication-kubeconfig="$RUN/kubeconfig" --authorization-kubeconfig="$RUN/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" --cert-dir="$RUN/pki/scheduler" --leader-elect=false
  wait_for kube-scheduler 60 curl -fsSk "https://127.0.0.1:$SCHEDULER_PORT/healthz"

  ls /run/netns 2>/dev/null >"$RUN/netns-before" || true
  # containerd finds its shim (and the shim runc) on PATH: ours first.
  start containerd env PATH="$CTRD_DIR:$PATH" "$CTRD_BIN" --config "$RUN/containerd/config.toml"
  wait_for containerd 30 "$CTR" --address "$CTRD_SOCK" version

  for img in "$RUN"/images/*.tar; do
    [ -f "$img" ] || continue
    "$CTR" --address "$CTRD_SOCK" -n k8s.io images import --no-unpack=false "$img" >&2
  done
  "$CTR" --address "$CTRD_SOCK" -n k8s.io images ls -q | sed 's/^/[cluster] image: /' >&2

  if [ ! -e "$KUBELET_ROOT" ]; then
    mkdir -p "$KUBELET_ROOT"
    touch "$RUN/created-kubelet-root"
  fi
  start_kubelet
  # Pods of the default namespace need its ServiceAccount (admission checks).
  wait_for kube-controller-manager 60 curl -fsS --cacert "$RUN/pki/ca.crt" -H "Authorization: Bearer $TOKEN" \
    "https://$GATEWAY_IP:$API_PORT/api/v1/namespaces/default/serviceaccounts/default"
}

start_kubelet() {
  start kubelet "$BIN/kubelet" --config="$RUN/kubelet/config.yaml" --kubeconfig="$RUN/kubeconfig" \
    --root-dir="$KUBELET_ROOT" --cert-dir="$RUN/kubelet/pki" \
    --hostname-override="$NODE" -v=1
  wait_for kubelet 60 curl -fsS "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz"
}

restart_kubelet() {
  stop kubelet
  start_kubelet
}

# down is safe to run repeatedly and after a partial up.
down() {
  stop kubelet
  if alive containerd; then
    # Kill and remove every task and container this containerd runs so that
    # the shims exit and no container outlives the run.
    local c
    for c in $("$CTR" --address "$CTRD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
      "$CTR" --address "$CTRD_SOCK" -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
    done
    sleep 1
    for c in $("$CTR" --address "$CTRD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
      "$CTR" --address "$CTRD_SOCK" -n k8s.io tasks delete -f "$c" >/dev/null 2>&1 || true
    done
    for c in $("$CTR" --address "$CTRD_SOCK" -n k8s.io containers ls -q 2>/dev/null); do
      "$CTR" --address "$CTRD_SOCK" -n k8s.io containers delete "$c" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  # Shims started by our containerd carry our socket path on their command
  # line; end exactly those, by pid.
  local p
  for p in /proc/[0-9]*; do
    if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- "-address $CTRD_SOCK"; then
      kill -KILL "${p#/proc/}" 2>/dev/null || true
    fi
  done
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
  # Mounts (pod volumes, overlay rootfs, netns, shm) under the run dir, deepest first.
  # (the kubelet also bind-mounts its root directory onto itself)
  awk -v run="$RUN" -v kr="$KUBELET_ROOT" 'index($2, run) == 1 || $2 == kr || index($2, kr "/") == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
  if [ -f "$RUN/created-kubelet-root" ]; then
    rm -rf "$KUBELET_ROOT"
    rm -f "$RUN/created-kubelet-root"
  fi
  # Network namespaces of sandboxes live in /run/netns/cni-*; remove the ones
  # that appeared after up (containerd removes them itself when the kubelet
  # stops a sandbox, not when the harness kills what is left).
  if [ -f "$RUN/netns-before" ]; then
    local ns
    for ns in /run/netns/cni-*; do
      [ -e "$ns" ] || continue
      grep -qxF "$(basename "$ns")" "$RUN/netns-before" && continue
      umount "$ns" 2>/dev/null || true
      rm -f "$ns"
    done
  fi
  ip link del "$BRIDGE" 2>/dev/null || true
  # Pod cgroups: kubelet's cgroupfs driver makes /kubepods in every hierarchy.
  local d
  for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/unified/kubepods; do
    [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  log "down: done (logs kept in $RUN/logs)"
}

print_env() {
  cat <<EOF
KUBECONFIG=$RUN/kubeconfig
KVPOOL_E2E_API_HOST=$GATEWAY_IP
KVPOOL_E2E_API_PORT=$API_PORT
KVPOOL_E2E_RUN=$RUN
KVPOOL_E2E_NODE=$NODE
KVPOOL_E2E_KUBELET_DIR=$KUBELET_ROOT
KVPOOL_E2E_CTL=$E2E_DIR/cluster.sh
KVPOOL_E2E_CDI_DIR=$CDI_DIR
KVPOOL_E2E_CONTAINERD_CDI=$CTRD_V2
EOF
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced: functions only

load_ports
case "${1:-}" in
  up) up ;;
  down) down ;;
  restart-kubelet) restart_kubelet ;;
  env) print_env ;;
  *) echo "usage: $0 up|down|restart-kubelet|env" >&2; exit 2 ;;
esac
