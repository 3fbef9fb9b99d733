package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// The agent under test: sized so that the node advertises poolChunks
// devices, reclaiming quickly so the reclaim scenario stays short.
const (
	resourceName = "kvpool.io/host-kv"
	chunkBytes   = 8 << 20
	poolChunks   = 8
	gracePeriod  = 5 * time.Second
	reconcile    = 2 * time.Second
)

// freePort asks the kernel for a free TCP port on the loopback interface.
// (Another process could take it before the agent binds it; the agent then
// fails to start and says so, which the readiness bound turns into a test
// failure with its log, not a hang.)
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// agentReadyWithin bounds how long a started agent may take to pass its
// readiness check; past it the test fails with the agent's log tail.
const agentReadyWithin = 90 * time.Second

func agentConfig(run, kubeletDir string, metricsPort, healthPort int) string {
	return fmt.Sprintf(`apiVersion: config.kvpool.io/v1alpha1
kind: AgentConfig
resourceName: %s
socketDir: %s
kubeletDir: %s
stateDir: %s
sizing:
  poolBytes: "%d"
  chunkBytes: "%d"
  hugePages: never
reclaim:
  gracePeriod: %s
  interval: %s
metrics:
  address: 127.0.0.1:%d
health:
  address: 127.0.0.1:%d
log:
  level: debug
standalone:
  gpus: 2
`, resourceName, filepath.Join(run, "sock"), kubeletDir, filepath.Join(run, "state"),
		poolChunks*chunkBytes, chunkBytes, gracePeriod, reconcile, metricsPort, healthPort)
}

// agent is the kvpool agent running on the node as a host process, the way
// the DaemonSet runs it but without the container.
type agent struct {
	cmd    *exec.Cmd
	done   chan error
	log    string
	health string // http://127.0.0.1:PORT
}

// startAgent runs the agent in cluster mode with simulated GPUs: it reads
// its Node through the API server ($KUBECONFIG, NODE_NAME), registers with
// the kubelet and posts Node events. KVPOOL_E2E_AGENT_ARGS replaces the
// arguments
// KVPOOL_E2E_AGENT_ARGS replaces them (space separated; {config} stands for
// the AgentConfig file written here, {run} for the run directory, {kubelet}
// for the kubelet root directory).
func (c *cluster) startAgent(t *testing.T) *agent {
	t.Helper()
	args := "--simulate-gpus 2 --resource-name " + resourceName +
		" --kubelet-dir {kubelet} --socket-dir {run}/sock --state-dir {run}/state" +
		" --reclaim-grace-period " + gracePeriod.String() + " --reclaim-interval " + reconcile.String()
	if s := os.Getenv("KVPOOL_E2E_AGENT_ARGS"); s != "" {
		args = s
	}
	return c.startAgentWith(t, "agent", args)
}

// startAgentWith runs the agent with args (as startAgent's), its config
// and log named after name.
func (c *cluster) startAgentWith(t *testing.T, name, argLine string) *agent {
	t.Helper()
	dir := filepath.Join(c.Run, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yaml")
	healthPort := freePort(t)
	if err := os.WriteFile(cfg, []byte(agentConfig(c.Run, c.KubeletDir, freePort(t), healthPort)), 0o644); err != nil {
		t.Fatal(err)
	}
	args := strings.Fields(argLine)
	r := strings.NewReplacer("{config}", cfg, "{run}", c.Run, "{kubelet}", c.KubeletDir)
	for i := range args {
		args[i] = r.Replace(args[i])
	}
	logPath := filepath.Join(c.Run, "logs", name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(c.Agent, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "NODE_NAME="+c.Node, "KVPOOL_CONFIG="+cfg)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start agent %s %v: %v", c.Agent, args, err)
	}
	a := &agent{cmd: cmd, done: make(chan error, 1), log: logPath, health: fmt.Sprintf("http://127.0.0.1:%d", healthPort)}
	go func() { a.done <- cmd.Wait(); logf.Close() }()
	t.Logf("agent started: pid %d, %s %s (log %s)", cmd.Process.Pid, c.Agent, strings.Join(args, " "), logPath)
	t.Cleanup(func() { a.stop(t) })
	a.waitReady(t, agentReadyWithin)
	return a
}

// waitReady waits for the agent's /readyz (chunks ready, socket answering,
// registered with the kubelet). An agent that exits, or is alive but not
// ready within the bound (a hung agent looks alive), fails the test with its
// log tail instead of letting later checks fail for misleading reasons.
func (a *agent) waitReady(t *testing.T, within time.Duration) {
	t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second}
	start := time.Now()
	last := "no answer yet"
	for time.Since(start) < within {
		a.exited(t)
		resp, err := hc.Get(a.health + "/readyz")
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				t.Logf("agent ready after %v", time.Since(start).Round(100*time.Millisecond))
				return
			}
			last = fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(body)))
		} else {
			last = err.Error()
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("agent not ready within %v (last /readyz: %s); log tail:\n%s", within, last, logTail(a.log, 4000))
}

// logTail is the last n bytes of a log file.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func (a *agent) stop(t *testing.T) {
	select {
	case err := <-a.done:
		a.done <- err
		return
	default:
	}
	_ = a.cmd.Process.Signal(os.Interrupt)
	select {
	case <-a.done:
	case <-time.After(15 * time.Second):
		t.Errorf("agent ignored SIGINT for 15s; killing it")
		_ = a.cmd.Process.Kill()
		<-a.done
	}
}

// exited fails the test when the agent has died, with its log tail.
func (a *agent) exited(t *testing.T) {
	t.Helper()
	select {
	case err := <-a.done:
		a.done <- err
		t.Fatalf("agent exited (%v); log tail:\n%s", err, logTail(a.log, 4000))
	default:
	}
}

func (c *cluster) capacity(t *testing.T) (capacity, allocatable int64) {
	n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get node: %v", err)
	}
	q1 := n.Status.Capacity[corev1.ResourceName(resourceName)]
	q2 := n.Status.Allocatable[corev1.ResourceName(resourceName)]
	return q1.Value(), q2.Value()
}

func (c *cluster) waitCapacity(t *testing.T, a *agent, want int64, timeout time.Duration) {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("node capacity %s=%d", resourceName, want), func() (bool, string, error) {
		a.exited(t)
		cp, al := c.capacity(t)
		return cp == want && al == want, fmt.Sprintf("capacity=%d allocatable=%d", cp, al), nil
	})
}

// podDevices asks the kubelet's PodResources API (the real one, on its
// socket) which devices of our resource each pod holds.
func (c *cluster) podDevices(t *testing.T) map[string][]string {
	t.Helper()
	sock := filepath.Join(c.KubeletDir, "pod-resources", "kubelet.sock")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("podresources %s: %v", sock, err)
	}
	defer conn.Close()
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(cctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		t.Fatalf("podresources List: %v", err)
	}
	out := map[string][]string{}
	for _, p := range resp.GetPodResources() {
		for _, ctr := range p.GetContainers() {
			for _, d := range ctr.GetDevices() {
				if d.GetResourceName() == resourceName {
					out[p.GetName()] = append(out[p.GetName()], d.GetDeviceIds()...)
				}
			}
		}
	}
	return out
}

// chunkFiles maps chunk IDs to the agent's memfds, opened through
// /proc/<agent>/fd: the test reads the very memory the pool hands out.
// A memfd belongs to a chunk when it is named after the chunk: the ID
// itself or "kvpool-" + ID (pkg/standalone's naming).
func chunkFiles(t *testing.T, pid int, ids []string) map[string]string {
	t.Helper()
	fdDir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(fdDir)
	if err != nil {
		t.Fatalf("list agent fds: %v", err)
	}
	out := map[string]string{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(fdDir, e.Name()))
		if err != nil || !strings.HasPrefix(target, "/memfd:") {
			continue
		}
		for _, id := range ids {
			name := strings.TrimSuffix(strings.TrimPrefix(target, "/memfd:"), " (deleted)")
			if name == id || name == "kvpool-"+id {
				out[id] = filepath.Join(fdDir, e.Name())
			}
		}
	}
	return out
}

// dirty writes a pattern into the first and last page of a chunk in place
// (no truncation: the agent has the file mapped).
func dirty(t *testing.T, id, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatalf("open chunk %s: %v", id, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatalf("stat chunk %s: %v", id, err)
	}
	page := bytes.Repeat([]byte{0xA5}, 4096)
	if st.Size() < int64(len(page)) {
		t.Fatalf("chunk %s is %d bytes", id, st.Size())
	}
	for _, off := range []int64{0, st.Size() - int64(len(page))} {
		if _, err := f.WriteAt(page, off); err != nil {
			t.Fatalf("dirty chunk %s at %d: %v", id, off, err)
		}
	}
}

// nonZero counts the non-zero bytes of a chunk's memory.
func nonZero(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read chunk %s: %v", path, err)
	}
	return len(b) - bytes.Count(b, []byte{0})
}

// checkpointHolders reads the device plugin's checkpoint in the state
// directory: which devices each allocation holds and which pod it was last
// seen with. ok is false when the agent keeps no such file.
func (c *cluster) checkpointHolders(t *testing.T) (holders map[string][]string, ok bool) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.Run, "state", "plugin-checkpoint.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, false
	}
	if err != nil {
		t.Fatalf("read checkpoint: %v", err)
	}
	var f struct {
		Records []struct {
			Devices []string `json:"devices"`
			Pod     string   `json:"pod"`
			Token   string   `json:"token"`
		} `json:"records"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	holders = map[string][]string{}
	for _, r := range f.Records {
		key := r.Pod
		if key == "" {
			key = "(no pod yet) " + r.Token
		}
		holders[key] = append(holders[key], r.Devices...)
	}
	return holders, true
}

// podCheck is what a pod checks inside its container.
type podCheck struct {
	socket bool // the agent serves its socket: it must be in the container
	client bool // run the kvclient against it
	// ranks, when not zero, runs one kvclient per GPU 0..ranks-1 at once
	// (a tensor-parallel pod whose engine declares its world size, -ranks:
	// the pod requests no nvidia.com/gpu for the agent to count), each
	// asking for its fair share (-max-pages -1), and wants each to get
	// rankPages host pages; and one more on a GPU the node does not have,
	// which must be refused.
	ranks, rankPages int
}

// script checks the container contract (socket directory mounted,
// KVPOOL_SOCKET and KVPOOL_TOKEN set, the socket itself when the agent
// serves one) and then runs the kvclient, which moves random pages through
// offload, reload, discard and remove_request and verifies every byte. Its
// output becomes the termination message.
func (pc podCheck) script() string {
	s := `set -u
fail() { echo "FAIL: $*" >/dev/termination-log; exit 1; }
[ "$KVPOOL_SOCKET" = /var/run/kvpool/kvpool.sock ] || fail "KVPOOL_SOCKET=$KVPOOL_SOCKET"
[ -n "$KVPOOL_TOKEN" ] || fail "KVPOOL_TOKEN is empty"
[ -d /var/run/kvpool ] || fail "socket directory /var/run/kvpool not mounted"
`
	if pc.socket {
		s += `[ -S "$KVPOOL_SOCKET" ] || fail "$KVPOOL_SOCKET is not a socket: $(ls -la /var/run/kvpool)"
`
	}
	if !pc.client {
		return s + `echo "contract ok: token ${#KVPOOL_TOKEN} bytes, $(ls /var/run/kvpool | wc -l) entries in /var/run/kvpool" >/dev/termination-log`
	}
	args := os.Getenv("KVPOOL_E2E_KVCLIENT_ARGS")
	if args == "" {
		args = "-ops 500"
	}
	if pc.ranks > 0 {
		for g := range pc.ranks {
			s += fmt.Sprintf("/kvclient %s -gpu %d -ranks %d -max-pages -1 >/tmp/rank%d 2>&1 & pid%d=$!\n", args, g, pc.ranks, g, g)
		}
		stranger := pc.ranks + 8
		s += fmt.Sprintf("/kvclient -ops 10 -gpu %d >/tmp/stranger 2>&1 && fail \"a kvclient on GPU %d, which the node does not have, was served\"\n", stranger, stranger)
		s += "grep -q 'unknown gpu' /tmp/stranger || fail \"stranger: $(tail -c 300 /tmp/stranger)\"\n"
		for g := range pc.ranks {
			s += fmt.Sprintf("wait $pid%d || fail \"rank %d: $(tail -c 800 /tmp/rank%d)\"\n", g, g, g)
			s += fmt.Sprintf("grep -q 'kvclient result.* device=GPU-sim-%08d .*capacity=%d ' /tmp/rank%d || fail \"rank %d did not get its share, %d pages: $(grep 'kvclient result' /tmp/rank%d)\"\n",
				g, pc.rankPages, g, g, pc.rankPages, g)
		}
		return s + `printf 'contract ok; ranks ok\n%s\n' "$(grep -h 'kvclient result' /tmp/rank*)" | tail -c 3500 >/dev/termination-log`
	}
	return s + `out=$(/kvclient ` + args + ` 2>&1); rc=$?
printf 'contract ok\n%s\n' "$out" | tail -c 3500 >/dev/termination-log
exit $rc`
}

// runPod runs a pod requesting units of the resource to completion and
// fails the test unless it succeeded.
func (c *cluster) runPod(t *testing.T, name string, units int64, pc podCheck) {
	t.Helper()
	c.createPod(t, c.podSpec(name, []string{"sh", "-c", pc.script()}, units, resourceName))
	p := c.waitPod(t, name, 120*time.Second, corev1.PodSucceeded, corev1.PodFailed)
	msg := terminationMessage(p)
	if p.Status.Phase != corev1.PodSucceeded {
		t.Fatalf("%s: %s\n%s", name, describePod(p), msg)
	}
	t.Logf("%s said:\n%s", name, msg)
}

// TestAgent is the agent's life on a real node, in order: registration and
// capacity, a pod that uses its memory, admission refusal, reclaim, and a
// kubelet restart.
func TestAgent(t *testing.T) {
	c := newCluster(t)
	if _, err := os.Stat(filepath.Join(c.Repo, "pkg", "plugin")); err != nil {
		t.Skip("agent scenarios need the device plugin (pkg/plugin, issue 6), not in this tree yet")
	}
	if os.Getenv("KVPOOL_E2E_AGENT_ARGS") == "" {
		// The default arguments need cmd/agent to offer the device plugin.
		help, _ := exec.Command(c.Agent, "-h").CombinedOutput()
		if !bytes.Contains(help, []byte("-device-plugin")) {
			t.Skipf("cmd/agent in this tree has no -device-plugin flag (pkg/plugin is not wired into `agent serve`), so it cannot register with the kubelet; set KVPOOL_E2E_AGENT_ARGS to the agent's cluster-mode arguments. agent -h:\n%s", help)
		}
	}
	c.waitNodeReady(t, 90*time.Second)
	// The status object's CRD, as helm install puts it in place first.
	c.installCRDs(t, filepath.Join(c.Repo, "config", "crd"))
	a := c.startAgent(t)
	sock := filepath.Join(c.Run, "sock", "kvpool.sock")
	parent := t // pods that outlive one subtest

	t.Run("capacity", func(t *testing.T) {
		c.waitCapacity(t, a, poolChunks, 60*time.Second)
	})

	t.Run("agent reads its Node and posts events", func(t *testing.T) {
		eventually(t, 30*time.Second, "agent log names the Node's allocatable memory", func() (bool, string, error) {
			a.exited(t)
			data, err := os.ReadFile(a.log)
			if err != nil {
				return false, "", err
			}
			for _, line := range strings.Split(string(data), "\n") {
				if strings.Contains(line, "connected to the API server") && strings.Contains(line, "node="+c.Node) &&
					!strings.Contains(line, "allocatable=0") {
					return true, line, nil
				}
			}
			return false, "no line yet", nil
		})
		eventually(t, 30*time.Second, "KVPoolReady event on the Node", func() (bool, string, error) {
			evs, err := c.cs.CoreV1().Events(metav1.NamespaceAll).List(context.Background(), metav1.ListOptions{
				FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + c.Node + ",reason=KVPoolReady"})
			if err != nil {
				return false, "", err
			}
			if len(evs.Items) == 0 {
				return false, "none yet", nil
			}
			return true, evs.Items[0].Message, nil
		})
		dyn, err := dynamic.NewForConfig(c.cfg)
		if err != nil {
			t.Fatal(err)
		}
		res := schema.GroupVersionResource{Group: "kvpool.io", Version: "v1alpha1", Resource: "kvpoolnodes"}
		eventually(t, 45*time.Second, "KVPoolNode status with the pool's capacity", func() (bool, string, error) {
			u, err := dyn.Resource(res).Get(context.Background(), c.Node, metav1.GetOptions{})
			if err != nil {
				return false, err.Error(), nil
			}
			capacity, _, _ := unstructured.NestedString(u.Object, "status", "capacity")
			health, _, _ := unstructured.NestedString(u.Object, "status", "health")
			want := resource.NewQuantity(poolChunks*chunkBytes, resource.BinarySI)
			got, err := resource.ParseQuantity(capacity)
			return err == nil && got.Cmp(*want) == 0 && health != "",
				fmt.Sprintf("capacity %q (want %s), health %q", capacity, want, health), nil
		})
	})

	// What the pods can check depends on what the agent serves.
	var pc podCheck
	if st, err := os.Stat(sock); err == nil && st.Mode()&os.ModeSocket != 0 {
		pc.socket = true
		pc.client = c.KVClient != ""
	}

	t.Run("pod gets memory", func(t *testing.T) {
		c.runPod(t, "kv-user", 2, pc)
		switch {
		case !pc.socket:
			t.Skipf("contract checked (socket dir mounted, env set); the agent serves no socket at %s (copy API, issue 3, not in this build), so no bytes were moved", sock)
		case !pc.client:
			t.Skip("contract and socket checked; cmd/kvclient (issue 3) is not in this tree, so no bytes were moved")
		}
	})

	t.Run("over-ask refused by admission", func(t *testing.T) {
		c.createPod(parent, c.podSpec("holder", []string{"/pause"}, poolChunks-2, resourceName))
		if p := c.waitPod(t, "holder", 90*time.Second, corev1.PodRunning, corev1.PodFailed); p.Status.Phase != corev1.PodRunning {
			t.Fatalf("holder: %s", describePod(p))
		}
		c.createPod(t, c.podSpec("greedy", []string{"/pause"}, 3, resourceName))
		p := c.waitPod(t, "greedy", 60*time.Second, corev1.PodFailed, corev1.PodRunning)
		// The kubelet runs the Topology Manager: no NUMA placement of 3
		// devices exists when 2 are free, so its admission refuses first.
		if p.Status.Phase != corev1.PodFailed || (p.Status.Reason != "UnexpectedAdmissionError" &&
			p.Status.Reason != "TopologyAffinityError" && !strings.HasPrefix(p.Status.Reason, "OutOf")) {
			t.Fatalf("greedy (3 units, 2 free) was not refused by admission: %s", describePod(p))
		}
		t.Logf("greedy refused: %s: %s", p.Status.Reason, p.Status.Message)
		c.deletePod(t, "greedy")
	})

	t.Run("deleted pod's chunks return zeroed", func(t *testing.T) {
		held := c.podDevices(t)["holder"]
		if len(held) != poolChunks-2 {
			t.Fatalf("PodResources: holder holds %v, want %d devices", held, poolChunks-2)
		}
		// The agent recorded the holder's allocation.
		eventually(t, 2*reconcile+5*time.Second, "checkpoint lists default/holder", func() (bool, string, error) {
			h, ok := c.checkpointHolders(t)
			if !ok {
				return false, "no checkpoint yet", nil
			}
			return len(h["default/holder"]) == len(held), fmt.Sprintf("checkpoint: %v", h), nil
		})
		// Where the chunks are memfds, dirty them the way the pod's client
		// would (it maps the same files), so that zeroing is observable.
		files := chunkFiles(t, a.cmd.Process.Pid, held)
		if len(files) > 0 && len(files) != len(held) {
			t.Fatalf("found the agent's memfds for %d of the holder's chunks %v", len(files), held)
		}
		for id, f := range files {
			dirty(t, id, f)
		}
		c.deletePod(t, "holder")
		deleted := time.Now()
		limit := gracePeriod + reconcile + 5*time.Second
		eventually(t, limit, "holder's allocation reclaimed", func() (bool, string, error) {
			a.exited(t)
			h, _ := c.checkpointHolders(t)
			dirty := []string{}
			for id, f := range files {
				if n := nonZero(t, f); n > 0 {
					dirty = append(dirty, id+":"+strconv.Itoa(n))
				}
			}
			return len(h["default/holder"]) == 0 && len(dirty) == 0,
				fmt.Sprintf("checkpoint %v; chunks with non-zero bytes %v", h, dirty), nil
		})
		t.Logf("holder's %d chunks reclaimed %v after deletion (limit %v)", len(held), time.Since(deleted).Round(100*time.Millisecond), limit)

		// The pool hands out every chunk again: a pod takes all of them,
		// and runs one rank per GPU (GPU 1 is a non-zero-based host GPU):
		// each rank, asking for its fair share, binds half the chunks
		// (poolChunks/2 chunks of 8 MiB in 32 KiB host pages).
		all := pc
		if pc.client {
			all.ranks, all.rankPages = 2, poolChunks/2*chunkBytes/(32<<10)
		}
		c.runPod(t, "all", poolChunks, all)
		c.deletePod(t, "all")
		if len(files) == 0 {
			t.Skip("reclaim checked through the agent's checkpoint; the agent's chunks are not memfds in this build (simulated chunks hold no bytes), so zeroing was not observable")
		}
	})

	t.Run("kubelet restart", func(t *testing.T) {
		restarted := time.Now().Truncate(time.Second)
		c.ctl(t, "restart-kubelet")
		// The plugin re-registers with the new kubelet: the new kubelet
		// reports the devices allocatable again (a status it posted after the
		// restart), and a new pod is admitted (Allocate reaches the plugin)
		// and works.
		eventually(t, 60*time.Second, "the restarted kubelet reports "+resourceName+" allocatable", func() (bool, string, error) {
			a.exited(t)
			n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			var beat time.Time
			for _, cond := range n.Status.Conditions {
				if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
					beat = cond.LastHeartbeatTime.Time
				}
			}
			q := n.Status.Allocatable[corev1.ResourceName(resourceName)]
			return beat.After(restarted) && q.Value() == poolChunks,
				fmt.Sprintf("Ready heartbeat %s (restart %s), allocatable %d", beat.Format(time.TimeOnly), restarted.Format(time.TimeOnly), q.Value()), nil
		})
		// Right after a restart the kubelet admits pods before it has synced
		// with the re-registered plugin and may refuse them
		// (UnexpectedAdmissionError, "Available: 0"; with the Topology
		// Manager, TopologyAffinityError: no device yet to place); a
		// scheduler would retry. The plugin must become usable within the
		// deadline.
		deadline := time.Now().Add(60 * time.Second)
		for try := 1; ; try++ {
			name := fmt.Sprintf("after-restart-%d", try)
			c.createPod(t, c.podSpec(name, []string{"sh", "-c", pc.script()}, 1, resourceName))
			p := c.waitPod(t, name, 120*time.Second, corev1.PodSucceeded, corev1.PodFailed)
			if p.Status.Phase == corev1.PodSucceeded {
				t.Logf("%s (try %d, %v after the restart) said:\n%s", name, try, time.Since(restarted).Round(100*time.Millisecond), terminationMessage(p))
				break
			}
			if (p.Status.Reason != "UnexpectedAdmissionError" && p.Status.Reason != "TopologyAffinityError") || time.Now().After(deadline) {
				t.Fatalf("%s: %s\n%s", name, describePod(p), terminationMessage(p))
			}
			t.Logf("%s refused by admission (%s); retrying", name, p.Status.Message)
			c.deletePod(t, name)
			time.Sleep(time.Second)
		}
	})
}
