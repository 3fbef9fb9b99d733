//go:build envtest

// Against a real kube-apiserver (controller-runtime envtest). Run with
//
//	KUBEBUILDER_ASSETS=/dir/with/kube-apiserver,etcd[,kubectl] go test -tags envtest -run Envtest -v ./internal/nodestatus
//
// hack/e2e/run.sh runs it with the apiserver it built (CI's e2e stage).
//
// It is behind a build tag so that CI machines without the binaries neither
// build envtest nor skip silently.
package nodestatus

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/pool"
)

func TestEnvtestWriterAgainstAPIServer(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Fatal("KUBEBUILDER_ASSETS must name a folder with kube-apiserver and etcd (and kubectl, for the printer columns)")
	}
	env := &envtest.Environment{CRDDirectoryPaths: []string{"../../config/crd"}, ErrorIfCRDPathMissing: true}
	cfg, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(cfg, cs)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	nd, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-1"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// What the Writer tells apart is the API server's own answer.
	if _, err := c.Get(ctx, nd.Name); !apierrors.IsNotFound(err) {
		t.Errorf("Get before the first write: %v, want not found", err)
	}
	if _, err := c.GetNode(ctx, "no-such-node"); !apierrors.IsNotFound(err) {
		t.Errorf("GetNode of a missing Node: %v, want not found", err)
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
	obj, err := c.Get(ctx, nd.Name)
	if err != nil {
		t.Fatal(err)
	}
	if obj.Status.Health != v1alpha1.HealthHealthy || obj.Status.Ready.String() != "16Gi" || obj.Status.Allocated.String() != "4Gi" ||
		obj.Status.Used.String() != "1280Mi" || len(obj.Status.GPUs) != 2 || obj.Status.Sessions != 1 {
		t.Errorf("stored status %+v", obj.Status)
	}
	if len(obj.OwnerReferences) != 1 || obj.OwnerReferences[0].UID != nd.UID {
		t.Errorf("owner %+v, node UID %s", obj.OwnerReferences, nd.UID)
	}
	checkClientErrors(t, c, obj)

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

	checkRBAC(t, env, cs, nd.Name, snap)
	checkPrinterColumns(t, env)
	checkStoppedRetriesConflict(t, c, nd.Name, snap)
}

// checkPrinterColumns checks the columns `kubectl get` shows for
// KVPoolNodes (the CRD's printer columns), when KUBEBUILDER_ASSETS holds a
// kubectl (hack/e2e/run.sh links one in when the machine has it).
func checkPrinterColumns(t *testing.T, env *envtest.Environment) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(os.Getenv("KUBEBUILDER_ASSETS"), "kubectl")); err != nil {
		t.Logf("no kubectl in KUBEBUILDER_ASSETS (%v): the printer columns are not checked", err)
		return
	}
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
		want := []string{"NAME", "CAPACITY", "READY", "ALLOCATED", "HEALTH", "HEARTBEAT", "AGE"}
		if len(args) > 2 {
			want = []string{"NAME", "CAPACITY", "READY", "ALLOCATED", "USED", "SESSIONS", "HEALTH", "HEARTBEAT", "AGE"}
		}
		if strings.Join(header, " ") != strings.Join(want, " ") {
			t.Errorf("kubectl %v header %v, want %v", args, header, want)
		}
		if !strings.Contains(string(out), "gpu-node-1   16Gi") || !strings.Contains(string(out), "Degraded") {
			t.Errorf("kubectl %v:\n%s", args, out)
		}
	}
}

// checkClientErrors checks NewClient's answers for what the Writer tells
// apart, given the stored obj: creating it again is AlreadyExists, and
// writing a status over a resourceVersion that has moved is a conflict.
func checkClientErrors(t *testing.T, c Client, obj *v1alpha1.KVPoolNode) {
	t.Helper()
	ctx := context.Background()
	again := &v1alpha1.KVPoolNode{ObjectMeta: metav1.ObjectMeta{Name: obj.Name}}
	if _, err := c.Create(ctx, again); !apierrors.IsAlreadyExists(err) {
		t.Errorf("Create of an existing object: %v, want already exists", err)
	}
	other := obj.DeepCopy()
	other.Status.Message = "another writer"
	moved, err := c.UpdateStatus(ctx, other)
	if err != nil {
		t.Fatalf("status update: %v", err)
	}
	if moved.ResourceVersion == obj.ResourceVersion || moved.Status.Message != "another writer" {
		t.Errorf("status update returned resourceVersion %s (was %s), message %q", moved.ResourceVersion, obj.ResourceVersion, moved.Status.Message)
	}
	if _, err := c.UpdateStatus(ctx, obj); !apierrors.IsConflict(err) {
		t.Errorf("status update over a stale resourceVersion: %v, want a conflict", err)
	}
}

// touchFirst is a Client whose first UpdateStatus comes after another
// writer's: the object it writes is then stale.
type touchFirst struct {
	Client
	calls int
	errs  []error
}

func (c *touchFirst) UpdateStatus(ctx context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	c.calls++
	if c.calls == 1 {
		fresh, err := c.Get(ctx, obj.Name)
		if err != nil {
			return nil, err
		}
		fresh.Status.Message = "another writer"
		if _, err := c.Client.UpdateStatus(ctx, fresh); err != nil {
			return nil, err
		}
	}
	out, err := c.Client.UpdateStatus(ctx, obj)
	c.errs = append(c.errs, err)
	return out, err
}

// checkStoppedRetriesConflict: the final write on a stop meets a real
// conflict (the object changed between its read and its write), and
// retries it at once with the object read afresh.
func checkStoppedRetriesConflict(t *testing.T, c Client, node string, snap report.Snapshot) {
	t.Helper()
	ctx := context.Background()
	tc := &touchFirst{Client: c}
	w := NewWriter(tc, node, Options{})
	w.Set(Build(node, Input{Snapshot: snap, Ready: true}))
	if err := w.Stopped(ctx, "agent stopped"); err != nil {
		t.Fatalf("Stopped: %v", err)
	}
	if len(tc.errs) != 2 || !apierrors.IsConflict(tc.errs[0]) || tc.errs[1] != nil {
		t.Errorf("Stopped's writes returned %v, want a conflict and then success", tc.errs)
	}
	obj, err := c.Get(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	if obj.Status.Health != v1alpha1.HealthUnhealthy || obj.Status.Message != "agent stopped" {
		t.Errorf("after Stopped: health %s, message %q", obj.Status.Health, obj.Status.Message)
	}
}

// checkRBAC applies config/rbac/observability.yaml and acts as the agent's
// service account: writing the status and posting Node events must work with
// those rules alone, and reading other nodes' objects in bulk must not.
func checkRBAC(t *testing.T, env *envtest.Environment, admin kubernetes.Interface, node string, snap report.Snapshot) {
	t.Helper()
	ctx := context.Background()
	b, err := os.ReadFile("../../config/rbac/observability.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		obj, _, err := clientgoscheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		create := metav1.CreateOptions{}
		switch o := obj.(type) {
		case *rbacv1.ClusterRole:
			_, err = admin.RbacV1().ClusterRoles().Create(ctx, o, create)
		case *rbacv1.ClusterRoleBinding:
			_, err = admin.RbacV1().ClusterRoleBindings().Create(ctx, o, create)
		case *rbacv1.Role:
			_, err = admin.RbacV1().Roles(o.Namespace).Create(ctx, o, create)
		case *rbacv1.RoleBinding:
			_, err = admin.RbacV1().RoleBindings(o.Namespace).Create(ctx, o, create)
		default:
			t.Fatalf("observability.yaml: unexpected %T", obj)
		}
		if err != nil {
			t.Fatalf("create %T: %v", obj, err)
		}
	}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvpool-system"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sa, err := env.AddUser(envtest.User{Name: "system:serviceaccount:kvpool-system:kvpool-agent", Groups: []string{"system:serviceaccounts"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	saCS, err := kubernetes.NewForConfig(sa.Config())
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(sa.Config(), saCS)
	if err != nil {
		t.Fatal(err)
	}
	// A second node's object, written only with the agent's rights.
	other, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-2"}}, metav1.CreateOptions{})
	if err != nil {
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
	dyn, err := dynamic.NewForConfig(sa.Config())
	if err != nil {
		t.Fatal(err)
	}
	kvpn := dyn.Resource(v1alpha1.GroupVersion.WithResource("kvpoolnodes"))
	if _, err := kvpn.List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("list with the agent's RBAC: %v, want forbidden", err)
	}
	if err := kvpn.Delete(ctx, node, metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("delete with the agent's RBAC: %v, want forbidden", err)
	}

	ev, stop := events.NewBroadcaster(&typedcorev1.EventSinkImpl{Interface: saCS.CoreV1().Events("")}, events.NodeRef(other.Name, other.UID))
	ev.PoolReady(16<<30, 16, 3*time.Second)
	deadline := time.Now().Add(20 * time.Second)
	for {
		list, err := admin.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
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
