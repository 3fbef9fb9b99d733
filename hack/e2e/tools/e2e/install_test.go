package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
)

// The release the chart test installs.
const (
	release        = "kvpool"
	releaseNS      = "kvpool-system"
	nfdGPULabel    = "feature.node.kubernetes.io/pci-10de.present"
	heartbeatEvery = 10 * time.Second // nodestatus.Heartbeat
	// strictUpgradeEnv tunes the upgrade check. By default nothing may be
	// lost: every client run during the upgrade must succeed (the keeper
	// keeps the pool's memory and books, issue 16). "0" relaxes that to
	// "fails cleanly, works again after"; "1" also requires the old agent's
	// final status to be seen on the watch.
	strictUpgradeEnv = "KVPOOL_E2E_STRICT_UPGRADE"
)

var kvpoolNodes = schema.GroupVersionResource{Group: "kvpool.io", Version: "v1alpha1", Resource: "kvpoolnodes"}

// chartValues are the values for this node: the agent image run.sh built,
// simulated GPUs (there is no NVIDIA GPU or runtime here), a small pool in
// small chunks, paths inside the run directory, a short reclaim grace, and
// the apiserver's address for in-cluster clients (there is no kube-proxy to
// make the kubernetes Service reachable).
func (c *cluster) chartValues(image, extra string) string {
	repo, tag, _ := strings.Cut(image, ":")
	return fmt.Sprintf(`image: {repository: %q, tag: %q, pullPolicy: Never}
simulateGPUs: 2
pool: {bytes: "%d", chunkBytes: "%d", headroom: 256Mi, reserveBytes: 64Mi}
paths: {socketDir: %q, stateDir: %q, kubeletDir: %q}
keeper: {socketDir: %q}
reclaim: {gracePeriod: %s, interval: %s}
nvidia: {visibleDevices: ""}
log: {level: debug}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: %q}
  - {name: KUBERNETES_SERVICE_PORT, value: %q}
%s`, repo, tag, poolChunks*chunkBytes, chunkBytes,
		filepath.Join(c.Run, "chart", "sock"), filepath.Join(c.Run, "chart", "state"), c.KubeletDir,
		filepath.Join(c.Run, "chart", "keeper"), gracePeriod, reconcile, os.Getenv("KVPOOL_E2E_API_HOST"), os.Getenv("KVPOOL_E2E_API_PORT"), extra)
}

// helm runs kvpool-helm (the Helm SDK: install, upgrade, uninstall).
func (c *cluster) helm(t *testing.T, bin, cmd string, values string) {
	t.Helper()
	args := []string{cmd, "-name", release, "-namespace", releaseNS}
	if cmd != "uninstall" {
		f := filepath.Join(c.Run, "values-"+cmd+".yaml")
		if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-chart", filepath.Join(c.Repo, "charts", "kvpool"), "-values", f)
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	t.Logf("kvpool-helm %s:\n%s", strings.Join(args, " "), out)
	if err != nil {
		t.Fatalf("helm %s: %v", cmd, err)
	}
}

// agentPod is the release's agent pod on the node, nil when there is none.
func (c *cluster) agentPod(t *testing.T) *corev1.Pod {
	t.Helper()
	pods, err := c.cs.CoreV1().Pods(releaseNS).List(ctx(t), metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/instance=" + release + ",app.kubernetes.io/component!=keeper", FieldSelector: "spec.nodeName=" + c.Node})
	if err != nil {
		t.Fatalf("list agent pods: %v", err)
	}
	var live *corev1.Pod
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			live = &pods.Items[i]
		}
	}
	return live
}

// containerLog is the tail of a container's log, read from the kubelet's
// log directory on this host (the apiserver cannot reach this kubelet's
// port, which listens on the loopback address only).
func containerLog(p *corev1.Pod, container string, n int) string {
	if p == nil {
		return "(no pod)"
	}
	dir := filepath.Join("/var/log/pods", fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), container)
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	if len(files) == 0 {
		return fmt.Sprintf("(no log in %s)", dir)
	}
	var all strings.Builder
	for _, f := range files {
		fmt.Fprintf(&all, "== %s\n%s", f, logTail(f, n))
	}
	return all.String()
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// waitAgentPod waits until an agent pod other than `not` is Ready; past the
// bound it fails with the pod's state and log tail.
func (c *cluster) waitAgentPod(t *testing.T, not types.UID, within time.Duration) *corev1.Pod {
	t.Helper()
	deadline := time.Now().Add(within)
	var p *corev1.Pod
	last := ""
	for time.Now().Before(deadline) {
		p = c.agentPod(t)
		switch {
		case p == nil:
			last = "no agent pod yet"
		case p.UID == not:
			last = "still the old pod " + p.Name
		case podReady(p):
			return p
		default:
			last = p.Name + ": " + describePod(p)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Fatalf("agent pod not Ready within %v (%s); agent log tail:\n%s", within, last, containerLog(p, "agent", 4000))
	return nil
}

// scheduledPod is a pod the scheduler places (no nodeName).
func (c *cluster) scheduledPod(name string, command []string, units int64) *corev1.Pod {
	p := c.podSpec(name, command, units, resourceName)
	p.Spec.NodeName = ""
	p.Spec.Tolerations = nil
	return p
}

func (c *cluster) kvpoolNode(t *testing.T) *unstructured.Unstructured {
	t.Helper()
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	u, err := dyn.Resource(kvpoolNodes).Get(context.Background(), c.Node, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get kvpoolnode %s: %v", c.Node, err)
	}
	return u
}

func statusTime(u *unstructured.Unstructured) time.Time {
	s, _, _ := unstructured.NestedString(u.Object, "status", "lastUpdateTime")
	ts, _ := time.Parse(time.RFC3339, s)
	return ts
}

// readyCondition is the KVPoolNode's Ready condition: status and reason.
func readyCondition(u *unstructured.Unstructured) (string, string) {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Ready" {
			return fmt.Sprint(m["status"]), fmt.Sprint(m["reason"])
		}
	}
	return "", ""
}

// all returns every status seen, in order.
func (s *statusLog) all() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.seen...)
}

// statusLog records every KVPoolNode status the watch delivers.
type statusLog struct {
	mu   sync.Mutex
	seen []string // "health/readyStatus/readyReason"
}

func (s *statusLog) has(sub string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.seen {
		if strings.Contains(x, sub) {
			return true
		}
	}
	return false
}

func (c *cluster) watchStatus(t *testing.T) *statusLog {
	t.Helper()
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	log := &statusLog{}
	note := func(s string) {
		log.mu.Lock()
		log.seen = append(log.seen, s)
		log.mu.Unlock()
	}
	// A watch that ends (the apiserver closes long watches; an error event)
	// is started again from the last version seen, so no write is missed.
	rv := ""
	go func() {
		for wctx.Err() == nil {
			w, err := dyn.Resource(kvpoolNodes).Watch(wctx, metav1.ListOptions{FieldSelector: "metadata.name=" + c.Node, ResourceVersion: rv})
			if err != nil {
				if wctx.Err() == nil {
					note("watch: " + err.Error())
				}
				time.Sleep(200 * time.Millisecond)
				continue
			}
			for ev := range w.ResultChan() {
				u, ok := ev.Object.(*unstructured.Unstructured)
				if !ok {
					if st, isStatus := ev.Object.(*metav1.Status); isStatus {
						note("watch error: " + st.Message)
						rv = "" // expired: start from the current state
					}
					continue
				}
				rv = u.GetResourceVersion()
				h, _, _ := unstructured.NestedString(u.Object, "status", "health")
				st, reason := readyCondition(u)
				note(h + "/" + st + "/" + reason)
			}
			w.Stop()
		}
	}()
	return log
}

// workloadLine is one kvclient run of the upgrade workload.
var workloadLine = regexp.MustCompile(`run (\d+) rc=(\d+) (.*)`)

type clientRun struct {
	n, rc int
	last  string
}

// clientRuns parses the workload pod's log (from the host).
func clientRuns(p *corev1.Pod) []clientRun {
	var out []clientRun
	for _, m := range workloadLine.FindAllStringSubmatch(containerLog(p, "main", 1<<20), -1) {
		n, _ := strconv.Atoi(m[1])
		rc, _ := strconv.Atoi(m[2])
		out = append(out, clientRun{n: n, rc: rc, last: m[3]})
	}
	return out
}

// TestChartInstall installs charts/kvpool for real with the Helm SDK and
// checks what an operator relies on: the DaemonSet's pod is placed by the
// NFD label and becomes Ready, the node advertises the pool, scheduled pods
// use it and an over-ask stays Pending, the agent writes its KVPoolNode (with
// a heartbeat) and events with its own service account, `helm upgrade`
// rolls the agent under a running workload (with a final not-Ready status
// from the old agent), and `helm uninstall` leaves nothing on the node.
func TestChartInstall(t *testing.T) {
	c := newCluster(t)
	helmBin, image := os.Getenv("KVPOOL_E2E_HELM"), os.Getenv("KVPOOL_E2E_AGENT_IMAGE")
	if helmBin == "" || image == "" {
		t.Skip("KVPOOL_E2E_HELM or KVPOOL_E2E_AGENT_IMAGE is unset: run.sh builds kvpool-helm and the agent image")
	}
	if c.KVClient == "" {
		t.Skip("cmd/kvclient is not in this tree: nothing to run in the pods")
	}
	c.waitNodeReady(t, 90*time.Second)
	// The node-lifecycle controller lifts the not-ready taint; the
	// scheduler places pods only then.
	eventually(t, 60*time.Second, "node without taints", func() (bool, string, error) {
		n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		return len(n.Spec.Taints) == 0, fmt.Sprintf("taints %v", n.Spec.Taints), nil
	})
	// The chart's default affinity selects nodes NFD labels with an NVIDIA
	// PCI device; label this one so (a node without either label gets no
	// agent, checked below before the label goes on).
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"true"}}}`, nfdGPULabel)
	defer func() {
		_, _ = c.cs.CoreV1().Nodes().Patch(context.Background(), c.Node, types.MergePatchType,
			[]byte(fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, nfdGPULabel)), metav1.PatchOptions{})
	}()
	sockDir, stateDir := filepath.Join(c.Run, "chart", "sock"), filepath.Join(c.Run, "chart", "state")
	keeperDir := filepath.Join(c.Run, "chart", "keeper")
	installed := time.Now().Truncate(time.Second)
	c.helm(t, helmBin, "install", c.chartValues(image, ""))
	uninstalled := false
	t.Cleanup(func() {
		if !uninstalled {
			_ = exec.Command(helmBin, "uninstall", "-name", release, "-namespace", releaseNS).Run()
		}
	})
	time.Sleep(3 * time.Second)
	if p := c.agentPod(t); p != nil {
		t.Fatalf("an agent pod %s was created on a node without a GPU label", p.Name)
	}
	if _, err := c.cs.CoreV1().Nodes().Patch(ctx(t), c.Node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	var apod *corev1.Pod
	t.Run("agent pod Ready", func(t *testing.T) {
		apod = c.waitAgentPod(t, "", 120*time.Second)
		t.Logf("agent pod %s Ready, image %s", apod.Name, apod.Spec.Containers[0].Image)
	})
	if apod == nil {
		t.FailNow()
	}

	t.Run("node advertises the pool", func(t *testing.T) {
		eventually(t, 60*time.Second, "node capacity", func() (bool, string, error) {
			cp, al := c.capacity(t)
			return cp == poolChunks && al == poolChunks, fmt.Sprintf("capacity=%d allocatable=%d", cp, al), nil
		})
	})

	t.Run("the keeper holds the pool's lock", func(t *testing.T) {
		// The keeper pod (IPC_LOCK) locks each chunk in a mapping of its own
		// and the agent unmaps it, so that an agent restart unmaps nothing.
		eventually(t, 60*time.Second, "agent log: the keeper holds the pool's lock", func() (bool, string, error) {
			l := containerLog(apod, "agent", 1<<20)
			if strings.Contains(l, "the keeper cannot hold the pool's lock") {
				return false, "", fmt.Errorf("the keeper refused the lock:\n%s", logTailString(l, 3000))
			}
			return strings.Contains(l, "the keeper holds the pool's lock"), "not yet", nil
		})
	})

	t.Run("agent uses the API with its own service account", func(t *testing.T) {
		eventually(t, 30*time.Second, "agent log: connected through the in-cluster service account", func() (bool, string, error) {
			l := containerLog(apod, "agent", 1<<20)
			return strings.Contains(l, "connected to the API server") && strings.Contains(l, "in-cluster service account"), "not yet", nil
		})
		eventually(t, 45*time.Second, "KVPoolNode written by this agent", func() (bool, string, error) {
			u := c.kvpoolNode(t)
			h, _, _ := unstructured.NestedString(u.Object, "status", "health")
			ts := statusTime(u)
			return h == "Healthy" && !ts.Before(installed), fmt.Sprintf("health %s, lastUpdateTime %s (installed %s)", h, ts.Format(time.TimeOnly), installed.Format(time.TimeOnly)), nil
		})
		eventually(t, 45*time.Second, "KVPoolReady event after the install", func() (bool, string, error) {
			evs, err := c.cs.CoreV1().Events(metav1.NamespaceAll).List(ctx(t), metav1.ListOptions{
				FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + c.Node + ",reason=KVPoolReady"})
			if err != nil {
				return false, "", err
			}
			for _, e := range evs.Items {
				last := e.LastTimestamp.Time
				if e.EventTime.After(last) {
					last = e.EventTime.Time
				}
				if !last.Before(installed) {
					return true, e.Message, nil
				}
			}
			return false, fmt.Sprintf("%d older events", len(evs.Items)), nil
		})
		// The heartbeat: an unchanged status is rewritten every 10 s.
		first := statusTime(c.kvpoolNode(t))
		eventually(t, 3*heartbeatEvery, "heartbeat moves lastUpdateTime", func() (bool, string, error) {
			ts := statusTime(c.kvpoolNode(t))
			return ts.After(first), "lastUpdateTime " + ts.Format(time.TimeOnly), nil
		})
	})

	t.Run("scheduled pod runs the client", func(t *testing.T) {
		c.createPod(t, c.scheduledPod("chart-client", []string{"sh", "-c", podCheck{socket: true, client: true}.script()}, 2))
		p := c.waitPod(t, "chart-client", 120*time.Second, corev1.PodSucceeded, corev1.PodFailed)
		if p.Status.Phase != corev1.PodSucceeded {
			t.Fatalf("chart-client: %s\n%s", describePod(p), terminationMessage(p))
		}
		if p.Spec.NodeName != c.Node {
			t.Errorf("scheduled to %q", p.Spec.NodeName)
		}
		t.Logf("chart-client said:\n%s", terminationMessage(p))
	})

	t.Run("over-ask stays Pending", func(t *testing.T) {
		c.createPod(t, c.scheduledPod("chart-greedy", []string{"/pause"}, poolChunks+1))
		eventually(t, 60*time.Second, "chart-greedy unschedulable", func() (bool, string, error) {
			p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "chart-greedy", metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			for _, cond := range p.Status.Conditions {
				if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
					return strings.Contains(cond.Message, resourceName), cond.Message, nil
				}
			}
			return false, describePod(p), nil
		})
		time.Sleep(3 * time.Second)
		p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "chart-greedy", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Status.Phase != corev1.PodPending || p.Spec.NodeName != "" {
			t.Fatalf("chart-greedy is not Pending and unbound: %s node=%q", describePod(p), p.Spec.NodeName)
		}
		c.deletePod(t, "chart-greedy")
	})

	t.Run("upgrade rolls the agent under a workload", func(t *testing.T) {
		// With the keeper nothing is lost across an upgrade: every client
		// run must pass (KVPOOL_E2E_STRICT_UPGRADE=0 relaxes it). The old
		// agent's final status is required only with =1 (see below).
		strict := os.Getenv(strictUpgradeEnv) != "0"
		strictFinal := os.Getenv(strictUpgradeEnv) == "1"
		script := `i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); /kvclient -ops 100 >/tmp/out 2>&1; rc=$?; echo "run $i rc=$rc $(tail -n 1 /tmp/out)"; sleep 0.3; done; sleep 3600`
		c.createPod(t, c.scheduledPod("chart-workload", []string{"sh", "-c", script}, 2))
		if p := c.waitPod(t, "chart-workload", 120*time.Second, corev1.PodRunning, corev1.PodFailed, corev1.PodSucceeded); p.Status.Phase != corev1.PodRunning {
			t.Fatalf("chart-workload: %s", describePod(p))
		}
		wl := func() *corev1.Pod {
			p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "chart-workload", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		eventually(t, 60*time.Second, "workload's first client run", func() (bool, string, error) {
			r := clientRuns(wl())
			return len(r) > 0, fmt.Sprint(len(r), " runs"), nil
		})
		if r := clientRuns(wl()); r[0].rc != 0 {
			t.Fatalf("the workload's client failed before the upgrade: %+v\n%s", r[0], containerLog(wl(), "main", 4000))
		}
		statuses := c.watchStatus(t)
		old := c.agentPod(t)
		c.helm(t, helmBin, "upgrade", c.chartValues(image, "podAnnotations: {kvpool.io/e2e-upgrade: \"2\"}\n"))
		rolled := time.Now()
		apod = c.waitAgentPod(t, old.UID, 120*time.Second)
		t.Logf("agent rolled from %s to %s in %v", old.Name, apod.Name, time.Since(rolled).Round(100*time.Millisecond))
		// The old agent said it stopped (final status), before the new one
		// reported again.
		// The status watch restarts when the apiserver ends it; a final
		// status the new agent overwrote within the watch's restart would
		// be missed, so this is required only with =1 (the host-process
		// agent's final status is checked in TestAgent).
		finalBy := time.Now().Add(10 * time.Second)
		for !statuses.has("Unhealthy/False/AgentStopped") && time.Now().Before(finalBy) {
			time.Sleep(200 * time.Millisecond)
		}
		if !statuses.has("Unhealthy/False/AgentStopped") {
			if strictFinal {
				t.Errorf("%s=1: the old agent's final status (Unhealthy/False/AgentStopped) was not seen within 10s; seen: %v", strictUpgradeEnv, statuses.all())
			} else {
				t.Logf("KNOWN GAP: the old agent's final status was not seen within 10s; seen: %v", statuses.all())
			}
		}
		ready := time.Now()
		runsAtReady := len(clientRuns(wl()))
		eventually(t, 60*time.Second, "a client run succeeds after the new agent is Ready", func() (bool, string, error) {
			r := clientRuns(wl())
			for _, x := range r[min(runsAtReady, len(r)):] {
				if x.rc == 0 {
					return true, "", nil
				}
			}
			return false, fmt.Sprintf("%d runs since", len(r)-runsAtReady), nil
		})
		runs := clientRuns(wl())
		failed := 0
		for _, r := range runs {
			if r.rc == 0 {
				continue
			}
			failed++
			// Failing cleanly: an error the client names, never a data
			// mismatch (which would mean a pod read memory it should not).
			if strings.Contains(strings.ToLower(r.last), "mismatch") || r.last == "" {
				t.Errorf("client run %d failed uncleanly (rc %d): %q", r.n, r.rc, r.last)
			}
		}
		t.Logf("workload: %d client runs, %d failed around the upgrade (new agent Ready %v after the upgrade)", len(runs), failed, ready.Sub(rolled).Round(100*time.Millisecond))
		if strict && failed > 0 {
			t.Errorf("%d client runs failed across the upgrade, want none (the keeper keeps the pool; %s=0 relaxes this)\n%s", failed, strictUpgradeEnv, containerLog(wl(), "main", 4000))
		} else if failed > 0 {
			t.Logf("(%s=0: failed runs allowed)", strictUpgradeEnv)
		}
		c.deletePod(t, "chart-workload")
	})

	t.Run("agent killed under a workload", func(t *testing.T) {
		// A crash: SIGKILL to the serving agent. The supervisor that is
		// its container's first process (restartInPlace, on in the chart)
		// starts it again at once, kubelet restarts nothing; the new agent
		// adopts the keeper's pool and books, and the workload's clients
		// ride out the gap. (The keeper's and the DRA tests kill the
		// container's first process instead: kubelet's restart.)
		script := `i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); /kvclient -ops 100 >/tmp/out 2>&1; rc=$?; echo "run $i rc=$rc $(tail -n 1 /tmp/out)"; sleep 0.3; done; sleep 3600`
		c.createPod(t, c.scheduledPod("chart-crash", []string{"sh", "-c", script}, 2))
		if p := c.waitPod(t, "chart-crash", 120*time.Second, corev1.PodRunning, corev1.PodFailed, corev1.PodSucceeded); p.Status.Phase != corev1.PodRunning {
			t.Fatalf("chart-crash: %s", describePod(p))
		}
		wl := func() *corev1.Pod {
			p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "chart-crash", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		eventually(t, 60*time.Second, "workload's first client run", func() (bool, string, error) {
			return len(clientRuns(wl())) > 0, "no run yet", nil
		})
		ap := c.agentPod(t)
		restarts := restartsOf(ap)
		first, pid := agentPIDs(t, ap)
		if first == pid {
			t.Fatalf("the agent's container has no supervisor (pid %d serves): restartInPlace is on in the chart", pid)
		}
		runsAtKill := len(clientRuns(wl()))
		// Two crashes: kubelet would restart the second only after its
		// back-off (10 s); in place both are served again at once, each by
		// a spare (restartInPlace.spare starts one 500 ms after a restart).
		var killed time.Time
		for kill := 1; kill <= 2; kill++ {
			if kill > 1 {
				time.Sleep(3 * time.Second)
				_, pid = agentPIDs(t, ap)
			}
			gapsBefore := len(restartGaps(containerLog(ap, "agent", 8<<20)))
			killed = time.Now()
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatalf("kill the agent (pid %d): %v", pid, err)
			}
			var gaps []restart
			eventually(t, 60*time.Second, "the agent serving again in place", func() (bool, string, error) {
				gaps = restartGaps(containerLog(ap, "agent", 8<<20))
				return len(gaps) > gapsBefore, fmt.Sprintf("%d restarts served, %d before the kill", len(gaps), gapsBefore), nil
			})
			r := gaps[len(gaps)-1]
			t.Logf("kill %d: agent restarted in place, serving again %s after the SIGKILL (its own gap, from the killed agent's last sign of life: %v)", kill, r.since(killed), r.gap)
			log := containerLog(ap, "agent", 8<<20)
			logRestartSteps(t, log, "agent ended abnormally; restarting it in place")
			// A restart that adopts the pool does not wait for the API
			// server: it plans with the Node as its predecessor read it.
			l := strings.Join(linesSince(log, "agent ended abnormally; restarting it in place"), "\n")
			if !strings.Contains(l, "the Node is read beside serving") {
				t.Errorf("kill %d: the restarted agent read the Node before serving", kill)
			}
			// The spare it woke (started 500 ms after the agent before it,
			// which served a few seconds) had read the books ahead: the
			// restore replays only their last records.
			if !strings.Contains(l, `"readAhead":true`) {
				t.Errorf("kill %d: the restarted agent replayed the books whole; the spare did not read them ahead", kill)
			}
		}
		// The pod's restart count does not show it; a Node event does.
		eventually(t, 30*time.Second, "KVPoolAgentRestartedInPlace event on the Node", func() (bool, string, error) {
			evs, err := c.cs.CoreV1().Events(metav1.NamespaceAll).List(ctx(t), metav1.ListOptions{
				FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + c.Node + ",reason=KVPoolAgentRestartedInPlace"})
			if err != nil {
				return false, "", err
			}
			for _, e := range evs.Items {
				if strings.Contains(e.Message, "signal: killed") {
					return true, e.Message, nil
				}
			}
			return false, fmt.Sprintf("%d events, none for the kill", len(evs.Items)), nil
		})
		// Both restarts woke the spare rather than starting a process.
		if l := containerLog(ap, "agent", 8<<20); len(regexp.MustCompile(`"msg":"agent ended abnormally; restarting it in place".*"spare":true`).FindAllString(l, -1)) != 2 {
			t.Errorf("the two restarts in place did not each wake a spare:\n%s", logTailString(l, 3000))
		}
		eventually(t, 60*time.Second, "the agent pod Ready", func() (bool, string, error) {
			p, err := c.cs.CoreV1().Pods(releaseNS).Get(ctx(t), ap.Name, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			return podReady(p), fmt.Sprintf("restarts %d, ready %v", restartsOf(p), podReady(p)), nil
		})
		if p, err := c.cs.CoreV1().Pods(releaseNS).Get(ctx(t), ap.Name, metav1.GetOptions{}); err != nil {
			t.Fatal(err)
		} else if restartsOf(p) != restarts {
			t.Errorf("kubelet restarted the agent's container (restarts %d -> %d); its supervisor should have restarted the agent", restarts, restartsOf(p))
		}
		if now, _ := agentPIDs(t, ap); now != first {
			t.Errorf("the container's first process changed (%d -> %d)", first, now)
		}
		eventually(t, 60*time.Second, "three client runs since the kill", func() (bool, string, error) {
			n := len(clientRuns(wl())) - runsAtKill
			return n >= 3, fmt.Sprint(n, " runs"), nil
		})
		failed := 0
		runs := clientRuns(wl())
		for _, r := range runs[runsAtKill:] {
			if r.rc != 0 {
				failed++
				t.Errorf("client run %d across the agent's crash failed (rc %d): %q", r.n, r.rc, r.last)
			}
		}
		t.Logf("workload: %d client runs since the kill, %d failed", len(runs)-runsAtKill, failed)
		if log := containerLog(c.agentPod(t), "agent", 1<<20); !strings.Contains(log, "restarting it in place") || !strings.Contains(log, "restarted in place") {
			t.Errorf("the supervisor and the restarted agent did not report the restart in place:\n%s", logTailString(log, 3000))
		}
		// While no agent ran, kubelet held every chunk unhealthy
		// (allocatable 0); it reports the new agent's healthy list at its
		// next node status update (every 2 s on this node, cluster.sh; 10 s
		// by default), which may come after the client runs above (a CI
		// run read allocatable 0 two seconds after the re-registration).
		eventually(t, 20*time.Second, "capacity and allocatable back after the crash", func() (bool, string, error) {
			cp, al := c.capacity(t)
			return cp == poolChunks && al == poolChunks, fmt.Sprintf("capacity %d, allocatable %d; want %d and %d", cp, al, poolChunks, poolChunks), nil
		})
		t.Logf("capacity and allocatable whole %v after SIGKILL", time.Since(killed).Round(100*time.Millisecond))
		c.deletePod(t, "chart-crash")
		c.createPod(t, c.scheduledPod("chart-after-crash", []string{"sh", "-c", podCheck{socket: true, client: true}.script()}, 2))
		if p := c.waitPod(t, "chart-after-crash", 120*time.Second, corev1.PodSucceeded, corev1.PodFailed); p.Status.Phase != corev1.PodSucceeded {
			t.Fatalf("a new pod after the crash: %s\n%s", describePod(p), terminationMessage(p))
		}
		c.deletePod(t, "chart-after-crash")
	})

	t.Run("keeper deleted under a workload", c.keeperDeletedUnderWorkload) // keeper_test.go

	t.Run("uninstall leaves nothing on the node", func(t *testing.T) {
		// Pods are gone; their allocations are reclaimed (grace + reconcile)
		// before the agent goes, so nothing is left to keep.
		eventually(t, gracePeriod+2*reconcile+10*time.Second, "allocations reclaimed", func() (bool, string, error) {
			b, err := os.ReadFile(filepath.Join(stateDir, "plugin-checkpoint.json"))
			if os.IsNotExist(err) {
				return true, "", nil
			}
			var f struct {
				Records []json.RawMessage `json:"records"`
			}
			_ = json.Unmarshal(b, &f)
			return len(f.Records) == 0, fmt.Sprintf("%d records", len(f.Records)), nil
		})
		last := c.agentPod(t)
		c.helm(t, helmBin, "uninstall", "")
		uninstalled = true
		gone := time.Now()
		eventually(t, 60*time.Second, "agent pod gone", func() (bool, string, error) {
			_, err := c.cs.CoreV1().Pods(releaseNS).Get(ctx(t), last.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err), "still there", nil
		})
		eventually(t, 30*time.Second, "no "+resourceName+" capacity on the Node", func() (bool, string, error) {
			n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			cp, hasCap := n.Status.Capacity[corev1.ResourceName(resourceName)]
			al, hasAl := n.Status.Allocatable[corev1.ResourceName(resourceName)]
			zero := func(q resource.Quantity, has bool) bool { return !has || q.IsZero() }
			return zero(cp, hasCap) && zero(al, hasAl), fmt.Sprintf("capacity %v, allocatable %v", cp.String(), al.String()), nil
		})
		t.Logf("capacity gone %v after the uninstall", time.Since(gone).Round(100*time.Millisecond))
		for _, d := range []string{sockDir, stateDir, keeperDir} {
			var left []string
			_ = filepath.Walk(d, func(p string, info os.FileInfo, err error) error {
				if err == nil && p != d {
					left = append(left, p)
				}
				return nil
			})
			if len(left) > 0 {
				t.Errorf("left on the node in %s: %v", d, left)
			}
		}
		if _, err := os.Stat(filepath.Join(c.KubeletDir, "device-plugins", "kvpool-kvpool_io_host-kv.sock")); !os.IsNotExist(err) {
			t.Errorf("the device plugin's socket is still in %s (%v)", filepath.Join(c.KubeletDir, "device-plugins"), err)
		}
		// The KVPoolNode no longer claims a serving agent: the final status
		// (when the agent could still write it; helm may delete its service
		// account first) or a heartbeat older than the stale bound.
		eventually(t, 3*heartbeatEvery+10*time.Second, "KVPoolNode not claiming a live agent", func() (bool, string, error) {
			u := c.kvpoolNode(t)
			st, reason := readyCondition(u)
			age := time.Since(statusTime(u))
			return st == "False" || age > 3*heartbeatEvery, fmt.Sprintf("Ready=%s (%s), heartbeat %v old", st, reason, age.Round(time.Second)), nil
		})
		if ds, err := c.cs.AppsV1().DaemonSets(releaseNS).List(ctx(t), metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + release}); err != nil || len(ds.Items) > 0 {
			t.Errorf("DaemonSets left: %v %v", err, ds)
		}
	})
}

// agentPIDs are the host PIDs of the agent pod's processes: first, its
// container's first process (the supervisor where restartInPlace is on),
// and serving, the agent that serves (first itself where it is off; with
// a spare, the child the last "kvpool agent serving" line names). The pod
// shares the host's PID namespace (hostPID: token binding reads every
// process), so the first process is the one whose parent is not another
// kvpool-agent of the pod.
func agentPIDs(t *testing.T, p *corev1.Pod) (first, serving int) {
	t.Helper()
	dash, under := string(p.UID), strings.ReplaceAll(string(p.UID), "-", "_")
	procs, _ := filepath.Glob("/proc/[0-9]*")
	parent := map[int]int{}
	for _, d := range procs {
		name, err := os.ReadFile(filepath.Join(d, "comm"))
		if err != nil || strings.TrimSpace(string(name)) != "kvpool-agent" {
			continue
		}
		cg, err := os.ReadFile(filepath.Join(d, "cgroup"))
		if err != nil || !(strings.Contains(string(cg), dash) || strings.Contains(string(cg), under)) {
			continue
		}
		st, err := os.ReadFile(filepath.Join(d, "status"))
		if err != nil {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		if _, pp, ok := strings.Cut(string(st), "\nPPid:"); ok {
			parent[pid], _ = strconv.Atoi(strings.Fields(pp)[0])
		}
	}
	var kids []int
	for pid, pp := range parent {
		if _, ok := parent[pp]; ok {
			kids = append(kids, pid)
		} else {
			first = pid
		}
	}
	switch {
	case first == 0:
	case len(kids) == 0:
		return first, first
	case len(kids) == 1:
		return first, kids[0]
	default: // a spare beside the serving agent
		var pid float64
		for _, line := range strings.Split(containerLog(p, "agent", 8<<20), "\n") {
			if i := strings.IndexByte(line, '{'); i >= 0 && strings.Contains(line, `"kvpool agent serving"`) {
				var m struct {
					PID float64 `json:"pid"`
				}
				if json.Unmarshal([]byte(line[i:]), &m) == nil {
					pid = m.PID
				}
			}
		}
		if slices.Contains(kids, int(pid)) {
			return first, int(pid)
		}
	}
	t.Fatalf("kvpool-agent processes in pod %s (pid: parent) %v: want the container's first and, where it supervises, its children", p.UID, parent)
	return 0, 0
}

// logRestartSteps logs, from the lines of log after the last that contains
// after, the start-up steps on one line (ms each; the agent logs them at
// debug level, which the chart values here set), the API server's line
// (the Node read before serving or beside it), the serving line (the whole
// start-up) and every warning or error: where a restart's gap went.
func logRestartSteps(t *testing.T, log, after string) {
	t.Helper()
	var steps []string
	for _, l := range linesSince(log, after) {
		i := strings.IndexByte(l, '{')
		if i < 0 {
			continue
		}
		var m struct {
			Level, Msg, Step string
			Took             float64
		}
		if json.Unmarshal([]byte(l[i:]), &m) != nil {
			continue
		}
		switch {
		case m.Msg == "start-up step":
			steps = append(steps, fmt.Sprintf("%s %.1f", m.Step, m.Took/1e6))
		case m.Level == "WARN" || m.Level == "ERROR" || m.Msg == "kvpool agent serving" || strings.HasPrefix(m.Msg, "connected to the API server") ||
			m.Msg == "pool adopted from the keeper" || strings.HasPrefix(m.Msg, "the spare did not read"):
			t.Logf("  %s", l[i:])
		}
	}
	t.Logf("  start-up steps (ms): %s", strings.Join(steps, ", "))
}

// linesSince is log's lines from the last one that contains after (all
// of them when none does).
func linesSince(log, after string) []string {
	lines := strings.Split(log, "\n")
	from := 0
	for i, l := range lines {
		if strings.Contains(l, after) {
			from = i
		}
	}
	return lines[from:]
}

// restart is one "serving again after a restart" line of an agent's log:
// when it was written, and the gap the agent measured from its
// predecessor's last sign of life (written every 100 ms).
type restart struct {
	at  time.Time
	gap time.Duration
}

// restartGaps are the restarts the agents in log reported serving again
// after (JSON lines; a text line counts with a zero time), in order.
func restartGaps(log string) []restart {
	var out []restart
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "serving again after a restart") {
			continue
		}
		if i := strings.IndexByte(line, '{'); i >= 0 {
			var m struct {
				Time time.Time `json:"time"`
				Gap  any       `json:"gap"`
			}
			if json.Unmarshal([]byte(line[i:]), &m) == nil {
				if ns, ok := m.Gap.(float64); ok {
					out = append(out, restart{m.Time, time.Duration(ns)})
				}
				continue
			}
		}
		if _, v, ok := strings.Cut(line, " gap="); ok {
			if d, err := time.ParseDuration(strings.Fields(v)[0]); err == nil {
				out = append(out, restart{gap: d})
			}
		}
	}
	return out
}

// since says how long after t0 r's agent served: from its log line's time
// (the same clock: the agent runs on this host), or unknown.
func (r restart) since(t0 time.Time) string {
	if r.at.IsZero() {
		return "unknown"
	}
	return r.at.Sub(t0).Round(time.Millisecond).String()
}

func logTailString(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
