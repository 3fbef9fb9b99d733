//go:build envtest

// Against a real kube-apiserver (controller-runtime envtest). Run with
//
//	KUBEBUILDER_ASSETS=/dir/with/kube-apiserver,etcd,kubectl go test -tags envtest -run Envtest -v ./internal/nodestatus
//
// It is behind a build tag so that CI machines without the binaries neither
// build envtest nor skip silently.
package nodestatus

import (
	"context"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/pool"
)

func TestEnvtestWriterAgainstAPIServer(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Fatal("KUBEBUILDER_ASSETS must name a folder with kube-apiserver, etcd and kubectl")
	}
	env := &envtest.Environment{CRDDirectoryPaths: []string{"../../config/crd"}, ErrorIfCRDPathMissing: true}
	cfg, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: s})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	nd := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-1"}}
	if err := c.Create(ctx, nd); err != nil {
		t.Fatal(err)
	}

	// A pool like a node with two GPUs of 8 chunks each, one pod holding 4.
	p := pool.New()
	for g := range 2 {
		for i := range 8 {
			if err := p.AddChunk(pool.Chunk{ID: chunkID(g, i), GPU: g, NUMA: g, Size: 1 << 30}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := p.Grant("pod-1", []string{chunkID(0, 0), chunkID(0, 1), chunkID(0, 2), chunkID(0, 3)}); err != nil {
		t.Fatal(err)
	}
	sess, err := p.Open("pod-1", pool.Spec{GPU: 0, PageSize: 2 << 20, DevicePages: 4096})
	if err != nil {
		t.Fatal(err)
	}
	gpuPages := make([]int32, 640)
	for i := range gpuPages {
		gpuPages[i] = int32(i)
	}
	if _, err := sess.Offload("req-7", "layer-group-0", gpuPages, pool.Meta{}, nil); err != nil {
		t.Fatal(err)
	}
	snap := report.Take(p, map[int]int64{0: 8 << 30, 1: 8 << 30}, time.Now())

	w := NewWriter(c, nd.Name, Options{})
	w.Set(Build(nd.Name, Input{Snapshot: snap, Ready: true, ResourceName: "kvpool.io/host-kv", AgentVersion: "dev"}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatalf("first write: %v", err)
	}
	obj := &v1alpha1.KVPoolNode{}
	if err := c.Get(ctx, client.ObjectKey{Name: nd.Name}, obj); err != nil {
		t.Fatal(err)
	}
	if obj.Status.Health != v1alpha1.HealthHealthy || obj.Status.Ready.String() != "16Gi" || obj.Status.Allocated.String() != "4Gi" ||
		obj.Status.Used.String() != "1280Mi" || len(obj.Status.GPUs) != 2 || obj.Status.Sessions != 1 {
		t.Errorf("stored status %+v", obj.Status)
	}
	if len(obj.OwnerReferences) != 1 || obj.OwnerReferences[0].UID != nd.UID {
		t.Errorf("owner %+v, node UID %s", obj.OwnerReferences, nd.UID)
	}

	// The apiserver enforces the CRD's schema.
	bad := Build(nd.Name, Input{Snapshot: snap, Ready: true})
	bad.Health = "Fine"
	w.Set(bad)
	if err := w.Sync(ctx, false); err == nil || !strings.Contains(err.Error(), "Unsupported value") {
		t.Errorf("invalid health accepted: %v", err)
	}
	w.Set(Build(nd.Name, Input{Snapshot: snap, Ready: true, UnhealthyGPUs: map[int]bool{1: true}, ResourceName: "kvpool.io/host-kv", AgentVersion: "dev"}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatalf("degraded write: %v", err)
	}

	checkRBAC(t, env, c, nd.Name, snap)

	user, err := env.AddUser(envtest.User{Name: "viewer", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubectl, err := user.Kubectl()
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"get", "kvpoolnodes"}, {"get", "kvpn", "-o", "wide"}} {
		stdout, stderr, err := kubectl.Run(args...)
		out, _ := io.ReadAll(stdout)
		errOut, _ := io.ReadAll(stderr)
		if err != nil {
			t.Fatalf("kubectl %v: %v\n%s", args, err, errOut)
		}
		t.Logf("$ kubectl %s\n%s", strings.Join(args, " "), out)
		header := strings.Fields(strings.SplitN(string(out), "\n", 2)[0])
		want := []string{"NAME", "CAPACITY", "READY", "ALLOCATED", "HEALTH", "AGE"}
		if len(args) > 2 {
			want = []string{"NAME", "CAPACITY", "READY", "ALLOCATED", "USED", "SESSIONS", "HEALTH", "AGE"}
		}
		if strings.Join(header, " ") != strings.Join(want, " ") {
			t.Errorf("kubectl %v header %v, want %v", args, header, want)
		}
		if !strings.Contains(string(out), "gpu-node-1   16Gi") || !strings.Contains(string(out), "Degraded") {
			t.Errorf("kubectl %v:\n%s", args, out)
		}
	}
}

// checkRBAC applies config/rbac/observability.yaml and acts as the agent's
// service account: writing the status and posting Node events must work with
// those rules alone, and reading other nodes' objects in bulk must not.
func checkRBAC(t *testing.T, env *envtest.Environment, admin client.Client, node string, snap report.Snapshot) {
	t.Helper()
	ctx := context.Background()
	b, err := os.ReadFile("../../config/rbac/observability.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			t.Fatal(err)
		}
		if err := admin.Create(ctx, u); err != nil {
			t.Fatalf("create %s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
	if err := admin.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvpool-system"}}); err != nil {
		t.Fatal(err)
	}
	sa, err := env.AddUser(envtest.User{Name: "system:serviceaccount:kvpool-system:kvpool-agent", Groups: []string{"system:serviceaccounts"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(sa.Config(), client.Options{Scheme: admin.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	// A second node's object, written only with the agent's rights.
	other := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-2"}}
	if err := admin.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	w := NewWriter(c, other.Name, Options{})
	w.Set(Build(other.Name, Input{Snapshot: snap, Reason: "socket: starting"}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatalf("write with the agent's RBAC: %v", err)
	}
	w.Set(Build(other.Name, Input{Snapshot: snap, Ready: true}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatalf("update with the agent's RBAC: %v", err)
	}
	if err := c.List(ctx, &v1alpha1.KVPoolNodeList{}); !apierrors.IsForbidden(err) {
		t.Errorf("list with the agent's RBAC: %v, want forbidden", err)
	}
	if err := c.Delete(ctx, &v1alpha1.KVPoolNode{ObjectMeta: metav1.ObjectMeta{Name: node}}); !apierrors.IsForbidden(err) {
		t.Errorf("delete with the agent's RBAC: %v, want forbidden", err)
	}

	core, err := typedcorev1.NewForConfig(sa.Config())
	if err != nil {
		t.Fatal(err)
	}
	ev, stop := events.NewBroadcaster(&typedcorev1.EventSinkImpl{Interface: core.Events("")}, events.NodeRef(other.Name, other.UID))
	ev.PoolReady(16<<30, 16, 3*time.Second)
	deadline := time.Now().Add(20 * time.Second)
	for {
		list := &corev1.EventList{}
		if err := admin.List(ctx, list, client.InNamespace(metav1.NamespaceDefault)); err != nil {
			t.Fatal(err)
		}
		if len(list.Items) > 0 {
			e := list.Items[0]
			t.Logf("event posted with the agent's RBAC: %s %s %s/%s: %s", e.Type, e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Message)
			if e.Reason != events.ReasonPoolReady || e.InvolvedObject.Name != other.Name {
				t.Errorf("event %+v", e)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no event posted with the agent's RBAC")
		}
		time.Sleep(100 * time.Millisecond)
	}
	stop()
}

func chunkID(gpu, i int) string {
	return "gpu" + string(rune('0'+gpu)) + "-numa" + string(rune('0'+gpu)) + "-" + string(rune('0'+i))
}
