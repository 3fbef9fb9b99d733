package events

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	fakecorev1 "k8s.io/client-go/kubernetes/typed/core/v1/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
)

func TestMessages(t *testing.T) {
	ids := make([]string, 10)
	for i := range ids {
		ids[i] = fmt.Sprintf("gpu0-numa0-%d", i)
	}
	for _, c := range []struct {
		name string
		post func(Events)
		want string
	}{
		{"ready", func(e Events) { e.PoolReady(64<<30, 64, 12345*time.Millisecond) },
			"Normal KVPoolReady host KV pool ready: 64Gi in 64 chunks, allocated and pinned in 12.345s"},
		{"hugepages", func(e Events) { e.HugePagesFallback("HugePages_Free 0 of 0") },
			"Warning KVPoolHugePagesFallback huge pages unavailable (HugePages_Free 0 of 0); the pool uses 4 KiB pages"},
		{"chunk sick", func(e Events) { e.ChunkUnhealthy("gpu1-numa0-3", "mlock lost") },
			"Warning KVPoolChunkUnhealthy chunk gpu1-numa0-3 unhealthy: mlock lost"},
		{"chunk well", func(e Events) { e.ChunkRecovered("gpu1-numa0-3") },
			"Normal KVPoolChunkRecovered chunk gpu1-numa0-3 healthy again"},
		{"restarted in place", func(e Events) { e.RestartedInPlace("signal: killed", 2) },
			"Warning KVPoolAgentRestartedInPlace the agent died (signal: killed) and its container's supervisor started it again at once (restart in place 2 in this container; the pod's restart count does not show it)"},
		{"reclaim few", func(e Events) { e.ChunksReclaimed("ns/pod-a", ids[:2]) },
			"Normal KVPoolChunksReclaimed reclaimed 2 chunks of pod ns/pod-a, which is gone: gpu0-numa0-0, gpu0-numa0-1"},
		{"reclaim many", func(e Events) { e.ChunksReclaimed("ns/pod-b", ids) },
			"Normal KVPoolChunksReclaimed reclaimed 10 chunks of pod ns/pod-b, which is gone: gpu0-numa0-0, gpu0-numa0-1, gpu0-numa0-2, gpu0-numa0-3, gpu0-numa0-4, gpu0-numa0-5, gpu0-numa0-6, gpu0-numa0-7 and 2 more"},
	} {
		rec := record.NewFakeRecorder(4)
		c.post(New(rec, NodeRef("node-a", "")))
		select {
		case got := <-rec.Events:
			if got != c.want {
				t.Errorf("%s:\n got %q\nwant %q", c.name, got, c.want)
			}
		default:
			t.Errorf("%s: no event", c.name)
		}
		Nop.PoolReady(1, 1, 0) // the no-op must not panic
	}
}

// Events go through a real broadcaster into a (fake) API server, attached to
// the Node.
func TestBroadcasterPostsOnNode(t *testing.T) {
	tracker := clienttesting.NewObjectTracker(scheme.Scheme, scheme.Codecs.UniversalDecoder())
	fake := &clienttesting.Fake{}
	fake.AddReactor("*", "*", clienttesting.ObjectReaction(tracker))
	core := &fakecorev1.FakeCoreV1{Fake: fake}
	ev, stop := NewBroadcaster(&typedcorev1.EventSinkImpl{Interface: core.Events("")}, NodeRef("node-a", "4f1c"))
	ev.HugePagesFallback("nr_hugepages is 0")
	ev.ChunksReclaimed("ns/gone", []string{"gpu0-numa0-1"})

	var got []corev1.Event
	deadline := time.Now().Add(10 * time.Second)
	for len(got) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("events not posted: %+v", got)
		}
		time.Sleep(20 * time.Millisecond)
		list, err := core.Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got = list.Items
	}
	stop()
	reasons := map[string]corev1.Event{}
	for _, e := range got {
		reasons[e.Reason] = e
	}
	e, ok := reasons[ReasonHugePagesFallback]
	if !ok || e.Type != corev1.EventTypeWarning || e.InvolvedObject.Kind != "Node" || e.InvolvedObject.Name != "node-a" ||
		e.InvolvedObject.UID != "4f1c" || e.Source.Component != Component || e.Source.Host != "node-a" ||
		!strings.Contains(e.Message, "nr_hugepages is 0") {
		t.Errorf("huge pages event %+v", e)
	}
	if e, ok := reasons[ReasonChunksReclaimed]; !ok || e.Type != corev1.EventTypeNormal {
		t.Errorf("reclaim event %+v", e)
	}
	if ref := NodeRef("n", ""); ref.UID != "n" {
		t.Errorf("default UID %q", ref.UID)
	}
}
