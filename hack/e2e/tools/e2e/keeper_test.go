package e2e

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// keeperPod is the release's keeper pod on the node, nil when there is
// none (or only one being deleted).
func (c *cluster) keeperPod(t *testing.T) *corev1.Pod {
	t.Helper()
	pods, err := c.cs.CoreV1().Pods(releaseNS).List(ctx(t), metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/instance=" + release + ",app.kubernetes.io/component=keeper", FieldSelector: "spec.nodeName=" + c.Node})
	if err != nil {
		t.Fatalf("list keeper pods: %v", err)
	}
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i]
		}
	}
	return nil
}

func restartsOf(p *corev1.Pod) int32 {
	n := int32(0)
	for _, st := range p.Status.ContainerStatuses {
		n += st.RestartCount
	}
	return n
}

// poolKept is the KVPoolNode's PoolKept condition (status and reason) and
// status.restart.keeperConnected.
func poolKept(u *unstructured.Unstructured) (string, string, bool) {
	connected, _, _ := unstructured.NestedBool(u.Object, "status", "restart", "keeperConnected")
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "PoolKept" {
			return fmt.Sprint(m["status"]), fmt.Sprint(m["reason"]), connected
		}
	}
	return "", "", connected
}

// keeperDeletedUnderWorkload deletes the keeper's pod on the node while a
// workload's clients run (issue 23: the agent never connected to the new
// keeper, every chunk renewal failed with "keeper put: broken pipe",
// allocatable dropped from 8 to 6 and stayed there, an 8-unit pod stayed
// Pending, and on a busy node the agent exited later). It wants: the agent
// sees the loss, connects to the DaemonSet's new keeper pod and hands it
// the pool, without a restart of its own; the workload's every client run
// succeeds; allocatable is the full count throughout and after; the
// workload's chunks, reclaimed once it goes, are renewed through the new
// keeper, so a pod asking for every chunk schedules and runs; and a crash
// of the agent afterwards adopts the whole pool from the new keeper. It
// logs the times from the deletion to the agent holding the pool with the
// new keeper, and to allocatable full again.
func (c *cluster) keeperDeletedUnderWorkload(t *testing.T) {
	script := `i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); /kvclient -ops 100 >/tmp/out 2>&1; rc=$?; echo "run $i rc=$rc $(tail -n 1 /tmp/out)"; sleep 0.3; done; sleep 3600`
	c.createPod(t, c.scheduledPod("chart-keeper", []string{"sh", "-c", script}, 2))
	if p := c.waitPod(t, "chart-keeper", 120*time.Second, corev1.PodRunning, corev1.PodFailed, corev1.PodSucceeded); p.Status.Phase != corev1.PodRunning {
		t.Fatalf("chart-keeper: %s", describePod(p))
	}
	wl := func() *corev1.Pod {
		p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "chart-keeper", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	eventually(t, 60*time.Second, "workload's first client run", func() (bool, string, error) {
		return len(clientRuns(wl())) > 0, "no run yet", nil
	})
	ap := c.agentPod(t)
	agentRestarts := restartsOf(ap)
	kpod := c.keeperPod(t)
	if kpod == nil {
		t.Fatal("no keeper pod on the node")
	}
	reconnects := strings.Count(containerLog(ap, "agent", 1<<20), "keeper reconnected")
	runsAtDelete := len(clientRuns(wl()))

	// Sample allocatable all along, from the deletion on.
	var mu sync.Mutex
	minAlloc, fullAgain, dropped := int64(poolChunks), time.Time{}, false
	stop := make(chan struct{})
	sampled := make(chan struct{})
	var deleted time.Time
	go func() {
		defer close(sampled)
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			n, err := c.cs.CoreV1().Nodes().Get(context.Background(), c.Node, metav1.GetOptions{})
			if err != nil {
				continue
			}
			q := n.Status.Allocatable[corev1.ResourceName(resourceName)]
			al := q.Value()
			mu.Lock()
			minAlloc = min(minAlloc, al)
			switch {
			case al < poolChunks:
				dropped, fullAgain = true, time.Time{}
			case dropped && fullAgain.IsZero():
				fullAgain = time.Now()
			}
			mu.Unlock()
		}
	}()
	if err := c.cs.CoreV1().Pods(releaseNS).Delete(ctx(t), kpod.Name, metav1.DeleteOptions{}); err != nil {
		close(stop)
		t.Fatalf("delete the keeper pod: %v", err)
	}
	deleted = time.Now()
	var held time.Duration
	eventually(t, 120*time.Second, "the agent hands the new keeper pod the pool", func() (bool, string, error) {
		l := containerLog(c.agentPod(t), "agent", 1<<20)
		n := strings.Count(l, "keeper reconnected")
		if n > reconnects && held == 0 {
			held = time.Since(deleted)
		}
		np := c.keeperPod(t)
		return n > reconnects && np != nil && np.UID != kpod.UID, fmt.Sprintf("%d reconnects in the log, keeper pod %v", n, np != nil), nil
	})
	t.Logf("keeper pod deleted: the agent held the pool with the new keeper %v after the delete", held.Round(100*time.Millisecond))
	if l := containerLog(c.agentPod(t), "agent", 1<<20); !strings.Contains(l, "keeper lost") {
		t.Errorf("the agent did not say it lost the keeper:\n%s", logTailString(l, 3000))
	}
	eventually(t, 30*time.Second, "KVPoolNode PoolKept True, keeper connected", func() (bool, string, error) {
		st, reason, connected := poolKept(c.kvpoolNode(t))
		return st == "True" && connected, fmt.Sprintf("PoolKept=%s (%s), keeperConnected %v", st, reason, connected), nil
	})
	eventually(t, 60*time.Second, "three client runs since the delete", func() (bool, string, error) {
		n := len(clientRuns(wl())) - runsAtDelete
		return n >= 3, fmt.Sprint(n, " runs"), nil
	})
	close(stop)
	<-sampled
	mu.Lock()
	lowest, full := minAlloc, fullAgain
	mu.Unlock()
	runs := clientRuns(wl())
	failed := 0
	for _, r := range runs[runsAtDelete:] {
		if r.rc != 0 {
			failed++
			t.Errorf("client run %d across the keeper's deletion failed (rc %d): %q", r.n, r.rc, r.last)
		}
	}
	fullAfter := "never dropped"
	if lowest < poolChunks && !full.IsZero() {
		fullAfter = full.Sub(deleted).Round(100 * time.Millisecond).String()
	}
	t.Logf("workload: %d client runs since the delete, %d failed; allocatable at least %d of %d throughout, full again: %s",
		len(runs)-runsAtDelete, failed, lowest, poolChunks, fullAfter)
	if cp, al := c.capacity(t); cp != poolChunks || al != poolChunks {
		t.Errorf("after the keeper's deletion: capacity %d, allocatable %d; want %d and %d", cp, al, poolChunks, poolChunks)
	}
	if p := c.agentPod(t); p.UID != ap.UID || restartsOf(p) != agentRestarts {
		t.Errorf("the agent restarted across the keeper's deletion: pod %s (was %s), restarts %d (were %d)", p.Name, ap.Name, restartsOf(p), agentRestarts)
	}

	// The workload goes; its chunks are reclaimed and renewed, handed to
	// the new keeper: a pod asking for every chunk gets them.
	c.deletePod(t, "chart-keeper")
	gone := time.Now()
	c.createPod(t, c.scheduledPod("chart-all-chunks", []string{"sh", "-c", podCheck{socket: true, client: true}.script()}, poolChunks))
	if p := c.waitPod(t, "chart-all-chunks", gracePeriod+2*reconcile+120*time.Second, corev1.PodSucceeded, corev1.PodFailed); p.Status.Phase != corev1.PodSucceeded {
		t.Fatalf("a pod asking for every chunk after the keeper's deletion: %s\n%s\nagent log:\n%s", describePod(p), terminationMessage(p),
			logTailString(containerLog(c.agentPod(t), "agent", 1<<20), 4000))
	}
	t.Logf("a pod of all %d chunks ran %v after the workload went (its chunks renewed through the new keeper)", poolChunks, time.Since(gone).Round(100*time.Millisecond))
	if l := containerLog(c.agentPod(t), "agent", 1<<20); strings.Contains(l, "broken pipe") {
		t.Errorf("the agent's log has a broken pipe to the keeper:\n%s", logTailString(l, 3000))
	}
	c.deletePod(t, "chart-all-chunks")

	// A crash of the agent's container now (its first process: the
	// supervisor and the agent end; kubelet restarts the container): the
	// new keeper holds the whole pool.
	ap = c.agentPod(t)
	restarts := restartsOf(ap)
	pid, _ := agentPIDs(t, ap)
	killed := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill the agent (pid %d): %v", pid, err)
	}
	eventually(t, 120*time.Second, "the agent container restarted and Ready", func() (bool, string, error) {
		p, err := c.cs.CoreV1().Pods(releaseNS).Get(ctx(t), ap.Name, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		return restartsOf(p) > restarts && podReady(p), fmt.Sprintf("restarts %d, ready %v", restartsOf(p), podReady(p)), nil
	})
	t.Logf("agent container back and Ready %v after SIGKILL (kubelet's restart back-off included)", time.Since(killed).Round(100*time.Millisecond))
	l := containerLog(c.agentPod(t), "agent", 1<<20)
	if gaps := restartGaps(l); len(gaps) > 0 {
		r := gaps[len(gaps)-1]
		t.Logf("the agent restarted by kubelet: serving again %s after the SIGKILL (its own gap, from the killed agent's last sign of life: %v)", r.since(killed), r.gap)
		logRestartSteps(t, l, "configuration")
	}
	if !regexp.MustCompile(fmt.Sprintf(`pool adopted from the keeper\W+chunks\W+%d\b`, poolChunks)).MatchString(l) {
		t.Errorf("the agent after the crash did not adopt all %d chunks from the new keeper:\n%s", poolChunks, logTailString(l, 3000))
	}
	if strings.Contains(l, "the keeper lost the pool") {
		t.Errorf("the agent after the crash says the keeper lost the pool:\n%s", logTailString(l, 3000))
	}
	// Kubelet sees the device plugin go and come back: allocatable
	// returns to the whole pool once it has registered again.
	eventually(t, 60*time.Second, "capacity and allocatable the whole pool after the crash", func() (bool, string, error) {
		cp, al := c.capacity(t)
		return cp == poolChunks && al == poolChunks, fmt.Sprintf("capacity=%d allocatable=%d", cp, al), nil
	})
	t.Logf("allocatable the whole pool again %v after SIGKILL", time.Since(killed).Round(100*time.Millisecond))
}
