package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// TestDRA: kvpool as a DRA driver on the real node (issue 26), through
// the chart in mode dra, beside a test GPU DRA driver (tools/gpudra) that
// publishes the simulated GPUs as NVIDIA's gpu.nvidia.com would. The pool:
// 4 simulated GPUs (two PCIe roots), 4 chunks of 8 MiB each.
const (
	draRelease    = "kvpool-dra"
	draNS         = "kvpool-dra"
	draDriver     = "kvpool.io"
	draGPUs       = 4
	draChunks     = 4 // per GPU
	draChunkClass = "host-kv.kvpool.io"
	draBytesClass = "host-kv-bytes.kvpool.io"
	gpuDriver     = "gpu.nvidia.com"
	hostPage      = 32 << 10 // kvclient's host page: 16 KiB in each of K and V
)

// draEnv is the DRA test's run: the chart's paths and the helpers around them.
type draEnv struct {
	*cluster
	helmBin, image string
	sockDir, state string
	keeperDir      string
	cdiDir         string
}

func (c *cluster) draValues(e *draEnv) string {
	repo, tag, _ := strings.Cut(e.image, ":")
	return fmt.Sprintf(`image: {repository: %q, tag: %q, pullPolicy: Never}
mode: dra
dra: {cdiDir: %q}
simulateGPUs: %d
pool: {bytes: "%d", chunkBytes: "%d", headroom: 256Mi, reserveBytes: 64Mi}
paths: {socketDir: %q, stateDir: %q, kubeletDir: %q}
keeper: {socketDir: %q}
reclaim: {gracePeriod: %s, interval: %s}
nvidia: {visibleDevices: ""}
log: {level: debug}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: %q}
  - {name: KUBERNETES_SERVICE_PORT, value: %q}
`, repo, tag, e.cdiDir, draGPUs, draGPUs*draChunks*chunkBytes, chunkBytes, e.sockDir, e.state, c.KubeletDir, e.keeperDir,
		gracePeriod, reconcile, os.Getenv("KVPOOL_E2E_API_HOST"), os.Getenv("KVPOOL_E2E_API_PORT"))
}

func (e *draEnv) helm(t *testing.T, cmd string) {
	t.Helper()
	args := []string{cmd, "-name", draRelease, "-namespace", draNS}
	if cmd != "uninstall" {
		f := filepath.Join(e.Run, "values-dra-"+cmd+".yaml")
		if err := os.WriteFile(f, []byte(e.draValues(e)), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-chart", filepath.Join(e.Repo, "charts", "kvpool"), "-values", f)
	}
	out, err := exec.Command(e.helmBin, args...).CombinedOutput()
	t.Logf("kvpool-helm %s:\n%s", strings.Join(args, " "), out)
	if err != nil {
		t.Fatalf("helm %s: %v", cmd, err)
	}
}

func (e *draEnv) agentPod(t *testing.T) *corev1.Pod {
	t.Helper()
	pods, err := e.cs.CoreV1().Pods(draNS).List(ctx(t), metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/instance=" + draRelease + ",app.kubernetes.io/component!=keeper", FieldSelector: "spec.nodeName=" + e.Node})
	if err != nil {
		t.Fatalf("list agent pods: %v", err)
	}
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i]
		}
	}
	return nil
}

func (e *draEnv) waitAgent(t *testing.T, within time.Duration) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if p = e.agentPod(t); p != nil && podReady(p) {
			return p
		}
		time.Sleep(500 * time.Millisecond)
	}
	desc := "no pod"
	if p != nil {
		desc = describePod(p)
	}
	t.Fatalf("DRA agent pod not Ready within %v (%s); log tail:\n%s", within, desc, containerLog(p, "agent", 4000))
	return nil
}

// kvDevices is what the node publishes now: the chunk devices by name and
// each share device's capacity in bytes.
type kvDevices struct {
	chunks map[string]resourcev1.Device
	shares map[string]int64
	all    map[string]resourcev1.Device
}

func (e *draEnv) slices(t *testing.T, driver string) kvDevices {
	t.Helper()
	list, err := e.cs.ResourceV1().ResourceSlices().List(ctx(t), metav1.ListOptions{FieldSelector: "spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list ResourceSlices: %v", err)
	}
	out := kvDevices{chunks: map[string]resourcev1.Device{}, shares: map[string]int64{}, all: map[string]resourcev1.Device{}}
	// Only the newest generation of the pool counts (the controller
	// replaces slices when the pool changes).
	gen := int64(-1)
	for _, s := range list.Items {
		gen = max(gen, s.Spec.Pool.Generation)
	}
	for _, s := range list.Items {
		if s.Spec.Pool.Generation != gen {
			continue
		}
		for _, d := range s.Spec.Devices {
			out.all[d.Name] = d
			switch attrString(d, driver+"/kind") {
			case "chunk":
				out.chunks[d.Name] = d
			case "share":
				q := d.Capacity["memory"].Value
				out.shares[d.Name] = q.Value()
			}
		}
	}
	return out
}

func attrString(d resourcev1.Device, name string) string {
	short := strings.TrimPrefix(name, strings.SplitN(name, "/", 2)[0]+"/")
	for _, k := range []string{name, short} {
		if a, ok := d.Attributes[resourcev1.QualifiedName(k)]; ok {
			switch {
			case a.StringValue != nil:
				return *a.StringValue
			case a.IntValue != nil:
				return fmt.Sprint(*a.IntValue)
			case a.BoolValue != nil:
				return fmt.Sprint(*a.BoolValue)
			}
		}
	}
	return ""
}

// waitFull waits until the node offers its whole pool again: every chunk
// device and every share at its GPU's full capacity.
func (e *draEnv) waitFull(t *testing.T, within time.Duration) {
	t.Helper()
	eventually(t, within, "the whole pool offered", func() (bool, string, error) {
		d := e.slices(t, draDriver)
		full := len(d.chunks) == draGPUs*draChunks && len(d.shares) == draGPUs
		for _, v := range d.shares {
			full = full && v == draChunks*chunkBytes
		}
		return full, fmt.Sprintf("%d chunk devices, shares %v", len(d.chunks), d.shares), nil
	})
}

// holdingScript checks the container contract, runs kvclient with args,
// prints "DONE rc=N" and keeps the pod (and its claim) until it is deleted.
func holdingScript(pre, args string) string {
	return `set -u
fail() { echo "FAIL: $*"; echo "DONE rc=1"; exec sleep 3600; }
[ "$KVPOOL_SOCKET" = /var/run/kvpool/kvpool.sock ] || fail "KVPOOL_SOCKET=$KVPOOL_SOCKET"
[ -n "$KVPOOL_TOKEN" ] || fail "KVPOOL_TOKEN is empty"
[ -S "$KVPOOL_SOCKET" ] || fail "$KVPOOL_SOCKET is not a socket: $(ls -la /var/run/kvpool)"
` + pre + `
/kvclient ` + args + ` 2>&1; rc=$?
echo "DONE rc=$rc"
exec sleep 3600`
}

// draPod is a pod the scheduler places (DRA allocates only there).
func (c *cluster) draPod(name, script string, units int64) *corev1.Pod {
	p := c.podSpec(name, []string{"sh", "-c", script}, units, resourceName)
	p.Spec.NodeName = ""
	p.Spec.Tolerations = nil
	return p
}

// withClaim makes the pod use a claim made from template tmpl.
func withClaim(p *corev1.Pod, tmpl string) *corev1.Pod {
	p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "kv", ResourceClaimTemplateName: &tmpl}}
	p.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "kv"}}
	return p
}

func (c *cluster) claimTemplate(t *testing.T, name string, spec resourcev1.ResourceClaimSpec) {
	t.Helper()
	tmpl := &resourcev1.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: spec}}
	if _, err := c.cs.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx(t), tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ResourceClaimTemplate %s: %v", name, err)
	}
	t.Cleanup(func() {
		_ = c.cs.ResourceV1().ResourceClaimTemplates(namespace).Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

func bytesRequest(name, memory string) resourcev1.DeviceRequest {
	return resourcev1.DeviceRequest{Name: name, Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: draBytesClass,
		Capacity: &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)}}}}
}

// waitDone waits until the pod's container printed "DONE rc=N" and
// returns its log; it fails unless rc is 0.
func (c *cluster) waitDone(t *testing.T, name string, within time.Duration) (*corev1.Pod, string) {
	t.Helper()
	var p *corev1.Pod
	var log string
	eventually(t, within, "pod "+name+" ran its client", func() (bool, string, error) {
		var err error
		p, err = c.cs.CoreV1().Pods(namespace).Get(ctx(t), name, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		log = containerLog(p, "main", 1<<16)
		return strings.Contains(log, "DONE rc="), describePod(p), nil
	})
	if !strings.Contains(log, "DONE rc=0") {
		t.Fatalf("pod %s: the client failed:\n%s", name, log)
	}
	return p, log
}

// claimOf is the pod's ResourceClaim: its extended-resource claim, or the
// one made from its template.
func (c *cluster) claimOf(t *testing.T, p *corev1.Pod) *resourcev1.ResourceClaim {
	t.Helper()
	name := ""
	if s := p.Status.ExtendedResourceClaimStatus; s != nil {
		name = s.ResourceClaimName
	}
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.ResourceClaimName != nil {
			name = *s.ResourceClaimName
		}
	}
	if name == "" {
		t.Fatalf("pod %s names no ResourceClaim in its status: %+v", p.Name, p.Status)
	}
	cl, err := c.cs.ResourceV1().ResourceClaims(namespace).Get(ctx(t), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get claim %s: %v", name, err)
	}
	if cl.Status.Allocation == nil {
		t.Fatalf("claim %s is not allocated", name)
	}
	return cl
}

// results lists a claim's allocated devices of driver, as request=device[=consumed].
func results(cl *resourcev1.ResourceClaim, driver string) []string {
	var out []string
	for _, r := range cl.Status.Allocation.Devices.Results {
		if r.Driver != driver {
			continue
		}
		s := r.Request + "=" + r.Device
		if q, ok := r.ConsumedCapacity["memory"]; ok {
			s += "=" + q.String()
		}
		out = append(out, s)
	}
	return out
}

// nodeClaims is the KVPoolNode's list of prepared claims: UID -> chunks.
func (c *cluster) nodeClaims(t *testing.T) (map[string]int64, int64) {
	t.Helper()
	u := c.kvpoolNode(t)
	list, _, _ := unstructured.NestedSlice(u.Object, "status", "claims")
	out := map[string]int64{}
	for _, x := range list {
		m, _ := x.(map[string]any)
		n, _ := m["chunks"].(int64)
		out[fmt.Sprint(m["uid"])] = n
	}
	granted, _, _ := unstructured.NestedInt64(u.Object, "status", "chunks", "granted")
	return out, granted
}

// cdiSpec is the token in the kvpool CDI spec of claim uid ("" when none).
func (e *draEnv) cdiToken(t *testing.T, uid types.UID) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.cdiDir, draDriver+"_"+string(uid)+".json"))
	if os.IsNotExist(err) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`KVPOOL_TOKEN=([A-Za-z0-9_-]+)`).FindSubmatch(b)
	if m == nil {
		t.Fatalf("CDI spec of claim %s has no token: %s", uid, b)
	}
	return string(m[1])
}

// metric reads one series of the agent's /metrics (its pod IP is reachable
// from the host through the pod network's bridge).
func metric(t *testing.T, p *corev1.Pod, series string) float64 {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://%s:9464/metrics", p.Status.PodIP))
	if err != nil {
		t.Fatalf("agent metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return -1
}

// startGPUDriver runs the test GPU DRA driver as a host process until the
// test ends, and waits for its slice.
func (c *cluster) startGPUDriver(t *testing.T, bin, cdiDir string) {
	t.Helper()
	logf, err := os.Create(filepath.Join(c.Run, "logs", "gpudra.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-kubeconfig", os.Getenv("KUBECONFIG"), "-node", c.Node, "-gpus", fmt.Sprint(draGPUs),
		"-driver", gpuDriver, "-kubelet-dir", c.KubeletDir, "-cdi-dir", cdiDir, "-numa", "0")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		logf.Close()
	})
	e := &draEnv{cluster: c}
	eventually(t, 30*time.Second, "the GPU driver's slice", func() (bool, string, error) {
		return len(e.slices(t, gpuDriver).all) == draGPUs, "", nil
	})
	class := &resourcev1.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: gpuDriver},
		Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{Expression: `device.driver == "` + gpuDriver + `"`}}}}}
	if _, err := c.cs.ResourceV1().DeviceClasses().Create(ctx(t), class, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.cs.ResourceV1().DeviceClasses().Delete(context.Background(), gpuDriver, metav1.DeleteOptions{})
	})
}

func TestDRA(t *testing.T) {
	c := newCluster(t)
	e := &draEnv{cluster: c, helmBin: os.Getenv("KVPOOL_E2E_HELM"), image: os.Getenv("KVPOOL_E2E_AGENT_IMAGE"),
		cdiDir: os.Getenv("KVPOOL_E2E_CDI_DIR")}
	gpudra := os.Getenv("KVPOOL_E2E_GPUDRA")
	switch {
	case e.helmBin == "" || e.image == "" || gpudra == "":
		t.Skip("KVPOOL_E2E_HELM, KVPOOL_E2E_AGENT_IMAGE or KVPOOL_E2E_GPUDRA is unset: run.sh builds them")
	case os.Getenv("KVPOOL_E2E_CONTAINERD_CDI") != "1" || e.cdiDir == "":
		t.Skip("the node's containerd has no CDI (run.sh builds containerd 2.x; cluster.sh uses it when built)")
	case c.KVClient == "":
		t.Skip("cmd/kvclient is not in this tree")
	}
	e.sockDir, e.state, e.keeperDir = filepath.Join(c.Run, "dra", "sock"), filepath.Join(c.Run, "dra", "state"), filepath.Join(c.Run, "dra", "keeper")
	c.waitNodeReady(t, 90*time.Second)
	eventually(t, 60*time.Second, "node without taints", func() (bool, string, error) {
		n, err := c.cs.CoreV1().Nodes().Get(ctx(t), c.Node, metav1.GetOptions{})
		if err != nil {
			return false, "", err
		}
		return len(n.Spec.Taints) == 0, fmt.Sprintf("taints %v", n.Spec.Taints), nil
	})
	c.startGPUDriver(t, gpudra, e.cdiDir)
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"true"}}}`, nfdGPULabel)
	if _, err := c.cs.CoreV1().Nodes().Patch(ctx(t), c.Node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = c.cs.CoreV1().Nodes().Patch(context.Background(), c.Node, types.MergePatchType,
			[]byte(fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, nfdGPULabel)), metav1.PatchOptions{})
	})
	e.helm(t, "install")
	uninstalled := false
	t.Cleanup(func() {
		if !uninstalled {
			_ = exec.Command(e.helmBin, "uninstall", "-name", draRelease, "-namespace", draNS).Run()
		}
	})
	apod := e.waitAgent(t, 120*time.Second)

	t.Run("slices: every chunk and a share per GPU, beside its GPU", func(t *testing.T) {
		e.waitFull(t, 60*time.Second)
		d := e.slices(t, draDriver)
		gpus := e.slices(t, gpuDriver)
		for name, dev := range d.all {
			g := attrString(dev, draDriver+"/gpu")
			gpu := gpus.all["gpu-"+g]
			if attrString(dev, "resource.kubernetes.io/pcieRoot") != attrString(gpu, "resource.kubernetes.io/pcieRoot") ||
				attrString(dev, draDriver+"/gpuUUID") != attrString(gpu, gpuDriver+"/uuid") ||
				attrString(dev, "resource.kubernetes.io/numaNode") != "0" || attrString(dev, draDriver+"/pageSize") == "" {
				t.Errorf("device %s (GPU %s) does not sit beside GPU gpu-%s: %v vs %v", name, g, g, dev.Attributes, gpu.Attributes)
			}
		}
		roots := map[string]bool{}
		for _, g := range gpus.all {
			roots[attrString(g, "resource.kubernetes.io/pcieRoot")] = true
		}
		if len(roots) != draGPUs/2 {
			t.Errorf("the GPU driver publishes %d PCIe roots, want one per GPU pair", len(roots))
		}
		// The driver's writes pass the admission policy; another node's
		// slice does not, with the agent's own (pod-bound) token.
		checkSlicePolicy(t, c, apod)
	})

	t.Run("(1) the extended resource pod spec runs through DRA", func(t *testing.T) {
		c.createPod(t, c.draPod("dra-ext", holdingScript("", "-ops 300"), 3))
		p, _ := c.waitDone(t, "dra-ext", 120*time.Second)
		cl := c.claimOf(t, p)
		got := results(cl, draDriver)
		if len(got) != 3 || !strings.HasPrefix(got[0], "container-0-request-0=gpu") {
			t.Fatalf("extended resource claim %s: %v, want 3 chunk devices", cl.Name, got)
		}
		if p.Spec.NodeName != c.Node {
			t.Errorf("placed on %q", p.Spec.NodeName)
		}
		eventually(t, 30*time.Second, "the claim in the KVPoolNode", func() (bool, string, error) {
			claims, granted := c.nodeClaims(t)
			return claims[string(cl.UID)] == 3 && granted == 3, fmt.Sprintf("claims %v, granted %d", claims, granted), nil
		})
		if e.cdiToken(t, cl.UID) == "" {
			t.Error("no CDI spec for the claim")
		}
		if v := metric(t, apod, `kvpool_dra_operations_total{op="prepare",result="ok"}`); v < 1 {
			t.Errorf("kvpool_dra_operations_total{prepare,ok} = %v", v)
		}
		if v := metric(t, apod, `kvpool_dra_claim_chunks{claim="`+cl.Name+`",namespace="default"}`); v != 3 {
			t.Errorf("kvpool_dra_claim_chunks of %s = %v", cl.Name, v)
		}
		c.deletePod(t, "dra-ext")
	})

	t.Run("(2) a claim in bytes gets the chunks rounded up", func(t *testing.T) {
		// 20 MiB of 8 MiB chunks: 3 chunks (24 MiB), as 20Gi of 1Gi chunks is 20.
		c.claimTemplate(t, "kv-20mi", resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{bytesRequest("kv", "20Mi")}}})
		c.createPod(t, withClaim(c.draPod("dra-bytes", holdingScript("", "-ops 300 -max-pages -1"), 0), "kv-20mi"))
		p, log := c.waitDone(t, "dra-bytes", 120*time.Second)
		cl := c.claimOf(t, p)
		got := results(cl, draDriver)
		if len(got) != 1 || !regexp.MustCompile(`^kv=gpu\d-share=24Mi$`).MatchString(got[0]) {
			t.Fatalf("bytes claim %s: %v, want one share of 24Mi", cl.Name, got)
		}
		if want := fmt.Sprintf("capacity=%d ", 3*chunkBytes/hostPage); !strings.Contains(log, want) {
			t.Errorf("the client did not get exactly 3 chunks (%s):\n%s", want, log)
		}
		eventually(t, 30*time.Second, "the claim's 3 chunks in the KVPoolNode", func() (bool, string, error) {
			claims, _ := c.nodeClaims(t)
			return claims[string(cl.UID)] == 3, fmt.Sprintf("claims %v", claims), nil
		})
		c.deletePod(t, "dra-bytes")
	})

	t.Run("(3) a GPU and host KV beside it", func(t *testing.T) {
		spec := resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{
				{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: gpuDriver, Selectors: []resourcev1.DeviceSelector{{
					CEL: &resourcev1.CELDeviceSelector{Expression: `device.attributes["` + gpuDriver + `"].uuid == "GPU-sim-00000002"`}}}}},
				bytesRequest("kv", "16Mi"),
			},
			Constraints: []resourcev1.DeviceConstraint{{Requests: []string{"gpu", "kv"},
				MatchAttribute: ptrTo(resourcev1.FullyQualifiedName("resource.kubernetes.io/pcieRoot"))}},
		}}
		c.claimTemplate(t, "gpu-kv", spec)
		pre := `[ -n "${KVCLIENT_GPU:-}" ] || fail "no KVCLIENT_GPU from the GPU driver"
[ "$NVIDIA_VISIBLE_DEVICES" = "$(printf 'GPU-sim-%08d' "$KVCLIENT_GPU")" ] || fail "GPU $NVIDIA_VISIBLE_DEVICES is not index $KVCLIENT_GPU"
echo "gpu $NVIDIA_VISIBLE_DEVICES index $KVCLIENT_GPU"`
		// No -gpu: the client takes the GPU the GPU driver gave the
		// container (NVIDIA_VISIBLE_DEVICES), as an engine does.
		c.createPod(t, withClaim(c.draPod("dra-gpu", holdingScript(pre, `-ops 300 -max-pages -1`), 0), "gpu-kv"))
		p, log := c.waitDone(t, "dra-gpu", 120*time.Second)
		cl := c.claimOf(t, p)
		gpu, kv := results(cl, gpuDriver), results(cl, draDriver)
		if len(gpu) != 1 || gpu[0] != "gpu=gpu-2" || len(kv) != 1 {
			t.Fatalf("claim %s: GPU %v, host KV %v", cl.Name, gpu, kv)
		}
		share := strings.Split(kv[0], "=")[1]
		d, gs := e.slices(t, draDriver), e.slices(t, gpuDriver)
		if root := attrString(d.all[share], "resource.kubernetes.io/pcieRoot"); root == "" || root != attrString(gs.all["gpu-2"], "resource.kubernetes.io/pcieRoot") {
			t.Errorf("host KV %s on PCIe root %q, the GPU on %q", share, root, attrString(gs.all["gpu-2"], "resource.kubernetes.io/pcieRoot"))
		}
		if !strings.Contains(log, "gpu GPU-sim-00000002 index 2") ||
			!strings.Contains(log, fmt.Sprintf("device=GPU-sim-00000002 rank=0 capacity=%d chunks=2 ", 2*chunkBytes/hostPage)) {
			t.Errorf("the client did not run on GPU 2 with the claim's 2 chunks:\n%s", log)
		}
		t.Logf("GPU gpu-2 with host KV %s (%s)", share, kv[0])
		c.deletePod(t, "dra-gpu")
	})

	t.Run("(4) claims beyond capacity stay Pending", func(t *testing.T) {
		// A GPU has 32 MiB: a share of 40 fits nowhere; 17 chunks are more
		// than the node has.
		c.claimTemplate(t, "kv-40mi", resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{bytesRequest("kv", "40Mi")}}})
		c.createPod(t, withClaim(c.draPod("dra-huge", "sleep 3600", 0), "kv-40mi"))
		c.createPod(t, c.draPod("dra-greedy", "sleep 3600", draGPUs*draChunks+1))
		for _, name := range []string{"dra-huge", "dra-greedy"} {
			msg := ""
			eventually(t, 60*time.Second, name+" unschedulable", func() (bool, string, error) {
				p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), name, metav1.GetOptions{})
				if err != nil {
					return false, "", err
				}
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodScheduled && cond.Status == corev1.ConditionFalse && cond.Reason == corev1.PodReasonUnschedulable {
						msg = cond.Message
						return strings.Contains(cond.Message, "cannot allocate all claims"), cond.Message, nil
					}
				}
				return false, describePod(p), nil
			})
			t.Logf("%s: PodScheduled=False Unschedulable: %q", name, msg)
		}
		time.Sleep(3 * time.Second)
		for _, name := range []string{"dra-huge", "dra-greedy"} {
			p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if p.Status.Phase != corev1.PodPending || p.Spec.NodeName != "" {
				t.Errorf("%s: %s node %q", name, describePod(p), p.Spec.NodeName)
			}
		}
		// The claim left unallocated is kvpool's: its request names the
		// bytes class.
		p, _ := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "dra-huge", metav1.GetOptions{})
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			cl, err := c.cs.ResourceV1().ResourceClaims(namespace).Get(ctx(t), *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if cl.Status.Allocation != nil || cl.Spec.Devices.Requests[0].Exactly.DeviceClassName != draBytesClass {
				t.Errorf("claim %s: allocated %v, class %s", cl.Name, cl.Status.Allocation != nil, cl.Spec.Devices.Requests[0].Exactly.DeviceClassName)
			}
		}
		c.deletePod(t, "dra-huge")
		c.deletePod(t, "dra-greedy")
	})

	t.Run("(5) delete: unprepare, renew, capacity back, no old byte", func(t *testing.T) {
		e.waitFull(t, 60*time.Second)
		c.createPod(t, c.draPod("dra-first", holdingScript("", "-ops 200"), draChunks))
		p, _ := c.waitDone(t, "dra-first", 120*time.Second)
		cl := c.claimOf(t, p)
		var ids []string
		for _, r := range results(cl, draDriver) {
			ids = append(ids, strings.Split(r, "=")[1])
		}
		_, pid := agentPIDs(t, c.agentPodOf(t, e))
		before := chunkFiles(t, pid, ids)
		if len(before) != len(ids) {
			t.Fatalf("the agent's memfds of %v: %v", ids, before)
		}
		for id, f := range before {
			dirty(t, id, f)
			if nonZero(t, f) == 0 {
				t.Fatalf("chunk %s still zero after writing it", id)
			}
		}
		// The claim's GPU, as the slices say: read again while the
		// controller replaces them (a newer generation written in part
		// lists only some of the devices).
		var share string
		eventually(t, 30*time.Second, "the claim's first chunk in the slices", func() (bool, string, error) {
			gpu := attrString(e.slices(t, draDriver).all[ids[0]], draDriver+"/gpu")
			share = "gpu" + gpu + "-share"
			return gpu != "", fmt.Sprintf("chunk %s of GPU %q", ids[0], gpu), nil
		})
		c.deletePod(t, "dra-first")
		eventually(t, 60*time.Second, "claim unprepared", func() (bool, string, error) {
			claims, granted := c.nodeClaims(t)
			return e.cdiToken(t, cl.UID) == "" && len(claims) == 0 && granted == 0, fmt.Sprintf("claims %v granted %d", claims, granted), nil
		})
		// Capacity back, once renewed: the whole pool.
		e.waitFull(t, 60*time.Second)
		after := chunkFiles(t, pid, ids)
		for _, id := range ids {
			if after[id] == "" {
				t.Fatalf("no memfd of chunk %s after its renewal", id)
			}
			if n := nonZero(t, after[id]); n != 0 {
				t.Errorf("chunk %s holds %d non-zero bytes after its renewal", id, n)
			}
		}
		eventually(t, 30*time.Second, "the share's capacity back after the renewal", func() (bool, string, error) {
			got := e.slices(t, draDriver).shares[share]
			return got == draChunks*chunkBytes, fmt.Sprintf("share %s capacity %d", share, got), nil
		})
		// The next pod gets the same chunks and finds them clean.
		c.createPod(t, c.draPod("dra-next", holdingScript("", "-ops 200"), draChunks))
		p, _ = c.waitDone(t, "dra-next", 120*time.Second)
		var next []string
		for _, r := range results(c.claimOf(t, p), draDriver) {
			next = append(next, strings.Split(r, "=")[1])
		}
		slices.Sort(next)
		slices.Sort(ids)
		t.Logf("first pod's chunks %v, next pod's %v", ids, next)
		c.deletePod(t, "dra-next")
	})

	t.Run("(6) agent and kubelet restarts with prepared claims", func(t *testing.T) {
		e.waitFull(t, 60*time.Second)
		c.claimTemplate(t, "kv-16mi", resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{bytesRequest("kv", "16Mi")}}})
		script := `i=0; while true; do i=$((i+1)); /kvclient -ops 100 >/tmp/out 2>&1; rc=$?; echo "run $i rc=$rc $(tail -n 1 /tmp/out)"; sleep 0.3; done`
		c.createPod(t, withClaim(c.draPod("dra-steady", script, 0), "kv-16mi"))
		if p := c.waitPod(t, "dra-steady", 120*time.Second, corev1.PodRunning, corev1.PodFailed); p.Status.Phase != corev1.PodRunning {
			t.Fatalf("dra-steady: %s", describePod(p))
		}
		steady := func() *corev1.Pod {
			p, err := c.cs.CoreV1().Pods(namespace).Get(ctx(t), "dra-steady", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		runs := func() []clientRun { return clientRuns(steady()) }
		eventually(t, 60*time.Second, "the first client run", func() (bool, string, error) { return len(runs()) > 0, "", nil })
		cl := c.claimOf(t, steady())
		token := e.cdiToken(t, cl.UID)
		check := func(when string) {
			t.Helper()
			if got := e.cdiToken(t, cl.UID); got != token {
				t.Errorf("%s: the claim's CDI token changed", when)
			}
			// The status is rewritten every few seconds and the slices
			// republished (kubelet wipes them when it starts): both settle.
			eventually(t, 60*time.Second, when+": the one claim's 2 chunks, granted once, and every chunk offered", func() (bool, string, error) {
				claims, granted := c.nodeClaims(t)
				d := e.slices(t, draDriver)
				return len(claims) == 1 && claims[string(cl.UID)] == 2 && granted == 2 && len(d.chunks) == draGPUs*draChunks,
					fmt.Sprintf("claims %v, granted %d, %d chunk devices", claims, granted, len(d.chunks)), nil
			})
		}
		check("before the restarts")

		// The agent's container crashes: SIGKILL to its first process (the
		// supervisor and the agent end); kubelet restarts the container,
		// the keeper keeps the pool and the books, the checkpoint the claim.
		ap := c.agentPodOf(t, e)
		restarts := int32(0)
		for _, st := range ap.Status.ContainerStatuses {
			restarts += st.RestartCount
		}
		at := len(runs())
		first, _ := agentPIDs(t, ap)
		if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		eventually(t, 90*time.Second, "the agent container restarted and Ready", func() (bool, string, error) {
			p, err := c.cs.CoreV1().Pods(draNS).Get(ctx(t), ap.Name, metav1.GetOptions{})
			if err != nil {
				return false, "", err
			}
			n := int32(0)
			for _, st := range p.Status.ContainerStatuses {
				n += st.RestartCount
			}
			return n > restarts && podReady(p), fmt.Sprintf("restarts %d ready %v", n, podReady(p)), nil
		})
		eventually(t, 60*time.Second, "three client runs since the agent's crash", func() (bool, string, error) {
			return len(runs())-at >= 3, "", nil
		})
		check("after the agent's crash")

		// kubelet restarts: it registers the driver again and prepares the
		// running pod's claim again (the same answer).
		at = len(runs())
		if out, err := exec.Command(c.Ctl, "restart-kubelet").CombinedOutput(); err != nil {
			t.Fatalf("restart kubelet: %v\n%s", err, out)
		}
		c.waitNodeReady(t, 90*time.Second)
		eventually(t, 90*time.Second, "three client runs since the kubelet restart", func() (bool, string, error) {
			return len(runs())-at >= 3, "", nil
		})
		e.waitAgent(t, 60*time.Second)
		check("after the kubelet restart")
		for _, r := range runs() {
			if r.rc != 0 {
				t.Errorf("client run %d failed (rc %d): %q", r.n, r.rc, r.last)
			}
		}
		t.Logf("%d client runs across the agent's crash and the kubelet restart", len(runs()))
		// A new claim is prepared after both, beside the first.
		c.claimTemplate(t, "kv-8mi", resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{bytesRequest("kv", "8Mi")}}})
		c.createPod(t, withClaim(c.draPod("dra-after", holdingScript("", "-ops 200"), 0), "kv-8mi"))
		c.waitDone(t, "dra-after", 120*time.Second)
		eventually(t, 30*time.Second, "3 chunks granted for claims of 2 and 1", func() (bool, string, error) {
			claims, granted := c.nodeClaims(t)
			return len(claims) == 2 && granted == 3, fmt.Sprintf("claims %v, granted %d", claims, granted), nil
		})
		c.deletePod(t, "dra-after")
		c.deletePod(t, "dra-steady")
	})

	t.Run("(7) uninstall leaves no slices, CDI specs or sockets", func(t *testing.T) {
		eventually(t, 60*time.Second, "every claim unprepared", func() (bool, string, error) {
			claims, granted := c.nodeClaims(t)
			return len(claims) == 0 && granted == 0, fmt.Sprintf("claims %v granted %d", claims, granted), nil
		})
		last := c.agentPodOf(t, e)
		e.helm(t, "uninstall")
		uninstalled = true
		eventually(t, 60*time.Second, "agent pod gone", func() (bool, string, error) {
			_, err := c.cs.CoreV1().Pods(draNS).Get(ctx(t), last.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err), "still there", nil
		})
		gone := time.Now()
		// kubelet removes a driver's slices once it has been unregistered
		// for 30 s.
		eventually(t, 90*time.Second, "no ResourceSlice of "+draDriver, func() (bool, string, error) {
			l, err := c.cs.ResourceV1().ResourceSlices().List(ctx(t), metav1.ListOptions{FieldSelector: "spec.driver=" + draDriver})
			if err != nil {
				return false, "", err
			}
			return len(l.Items) == 0, fmt.Sprintf("%d slices", len(l.Items)), nil
		})
		t.Logf("slices gone %v after the agent", time.Since(gone).Round(time.Second))
		specs, _ := filepath.Glob(filepath.Join(e.cdiDir, draDriver+"_*"))
		if len(specs) > 0 {
			t.Errorf("CDI specs left: %v", specs)
		}
		var socks []string
		for _, d := range []string{filepath.Join(c.KubeletDir, "plugins", draDriver), filepath.Join(c.KubeletDir, "plugins_registry"), e.sockDir, e.state, e.keeperDir} {
			_ = filepath.Walk(d, func(p string, info os.FileInfo, err error) error {
				if err != nil || p == d {
					return nil
				}
				if strings.HasPrefix(d, e.sockDir) || strings.HasPrefix(d, e.state) || strings.HasPrefix(d, e.keeperDir) ||
					(info.Mode()&os.ModeSocket != 0 && strings.Contains(p, draDriver)) {
					socks = append(socks, p)
				}
				return nil
			})
		}
		if len(socks) > 0 {
			t.Errorf("left on the node: %v", socks)
		}
		for _, class := range []string{draChunkClass, draBytesClass} {
			if _, err := c.cs.ResourceV1().DeviceClasses().Get(ctx(t), class, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Errorf("DeviceClass %s left: %v", class, err)
			}
		}
	})
}

func (c *cluster) agentPodOf(t *testing.T, e *draEnv) *corev1.Pod {
	t.Helper()
	p := e.agentPod(t)
	if p == nil {
		t.Fatal("no DRA agent pod")
	}
	return p
}

func ptrTo[T any](v T) *T { return &v }

// checkSlicePolicy: with a token bound to the agent's pod (as its own is),
// the agent's service account may not write a ResourceSlice of another
// node: the chart's policy refuses it.
func checkSlicePolicy(t *testing.T, c *cluster, apod *corev1.Pod) {
	t.Helper()
	tr, err := c.cs.CoreV1().ServiceAccounts(apod.Namespace).CreateToken(ctx(t), apod.Spec.ServiceAccountName, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: apod.Name, UID: apod.UID},
			ExpirationSeconds: ptrTo(int64(600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for the agent's service account: %v", err)
	}
	cfg := rest.CopyConfig(c.cfg)
	cfg.BearerToken, cfg.BearerTokenFile = tr.Status.Token, ""
	cfg.Username, cfg.Password = "", ""
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	slice := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "kvpool-e2e-policy-probe"},
		Spec: resourcev1.ResourceSliceSpec{Driver: draDriver, NodeName: ptrTo("another-node"),
			Pool: resourcev1.ResourcePool{Name: "another-node", ResourceSliceCount: 1}}}
	_, err = as.ResourceV1().ResourceSlices().Create(ctx(t), slice, metav1.CreateOptions{})
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "only the ResourceSlices of driver "+draDriver+" on its own node") {
		_ = c.cs.ResourceV1().ResourceSlices().Delete(context.Background(), slice.Name, metav1.DeleteOptions{})
		t.Errorf("a slice of another node with the agent's token: %v; want Forbidden by the chart's policy", err)
	} else {
		t.Logf("refused as it should be: %v", err)
	}
}
