package nodestatus

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kvpool/kvpool/api/v1alpha1"
)

// NewClient's requests, against a server that answers each with what an API
// server would: the paths (the status subresource for UpdateStatus), the
// object sent as kvpool.io/v1alpha1 JSON, the stored object decoded from the
// answer, and the API server's errors kept as *StatusError, so that the
// Writer's apierrors.IsNotFound, IsConflict and IsAlreadyExists see them.
// envtest_test.go runs the same calls against a real kube-apiserver.
func TestClientRequests(t *testing.T) {
	type reply struct {
		code int
		body any // encoded as JSON; a *metav1.Status for an error
	}
	var mu sync.Mutex
	var got []string // "METHOD path content-type body"
	var next reply
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type")+" "+string(body))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(next.code)
		if err := json.NewEncoder(w).Encode(next.body); err != nil {
			t.Error(err)
		}
	}))
	defer srv.Close()
	rc := &rest.Config{Host: srv.URL}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(rc, cs)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	status := func(err error) *metav1.Status {
		var se *apierrors.StatusError
		if !errors.As(err, &se) {
			t.Fatalf("%v is not a StatusError", err)
		}
		st := se.Status()
		st.Kind, st.APIVersion = "Status", "v1"
		return &st
	}
	last := func() string {
		mu.Lock()
		defer mu.Unlock()
		return got[len(got)-1]
	}
	answer := func(r reply) {
		mu.Lock()
		next = r
		mu.Unlock()
	}

	answer(reply{200, map[string]any{"kind": "Node", "apiVersion": "v1", "metadata": map[string]any{"name": "n1", "uid": "u-1"}}})
	if n, err := c.GetNode(ctx, "n1"); err != nil || n.UID != "u-1" || !strings.HasPrefix(last(), "GET /api/v1/nodes/n1 ") {
		t.Errorf("GetNode: %v %+v; request %q", err, n, last())
	}

	answer(reply{404, status(apierrors.NewNotFound(kvpoolnodesGR, "n1"))})
	if _, err := c.Get(ctx, "n1"); !apierrors.IsNotFound(err) || !strings.HasPrefix(last(), "GET /apis/kvpool.io/v1alpha1/kvpoolnodes/n1 ") {
		t.Errorf("Get of a missing object: %v; request %q", err, last())
	}

	obj := &v1alpha1.KVPoolNode{ObjectMeta: metav1.ObjectMeta{Name: "n1",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "n1", UID: "u-1"}}}}
	stored := obj.DeepCopy()
	stored.ResourceVersion, stored.Generation = "7", 1
	answer(reply{201, stored})
	created, err := c.Create(ctx, obj)
	if err != nil || created.ResourceVersion != "7" || created.Name != "n1" {
		t.Errorf("Create: %v %+v", err, created)
	}
	if want := `POST /apis/kvpool.io/v1alpha1/kvpoolnodes application/json {"kind":"KVPoolNode","apiVersion":"kvpool.io/v1alpha1","metadata":{"name":"n1",`; !strings.HasPrefix(last(), want) ||
		!strings.Contains(last(), `"uid":"u-1"`) {
		t.Errorf("Create sent %q, want %q... with the owner reference", last(), want)
	}
	answer(reply{409, status(apierrors.NewAlreadyExists(kvpoolnodesGR, "n1"))})
	if _, err := c.Create(ctx, obj); !apierrors.IsAlreadyExists(err) {
		t.Errorf("Create of an existing object: %v", err)
	}

	created.Status.Health = v1alpha1.HealthHealthy
	answer(reply{409, status(apierrors.NewConflict(kvpoolnodesGR, "n1", errors.New("the object has been modified")))})
	if _, err := c.UpdateStatus(ctx, created); !apierrors.IsConflict(err) || !strings.Contains(err.Error(), "the object has been modified") {
		t.Errorf("UpdateStatus meeting a conflict: %v", err)
	}
	updated := created.DeepCopy()
	updated.ResourceVersion = "8"
	answer(reply{200, updated})
	out, err := c.UpdateStatus(ctx, created)
	if err != nil || out.ResourceVersion != "8" || out.Status.Health != v1alpha1.HealthHealthy {
		t.Errorf("UpdateStatus: %v %+v", err, out)
	}
	if !strings.HasPrefix(last(), "PUT /apis/kvpool.io/v1alpha1/kvpoolnodes/n1/status application/json ") ||
		!strings.Contains(last(), `"resourceVersion":"7"`) || !strings.Contains(last(), `"health":"Healthy"`) {
		t.Errorf("UpdateStatus sent %q", last())
	}
}
