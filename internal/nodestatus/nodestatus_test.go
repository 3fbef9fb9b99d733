package nodestatus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

const gib = 1 << 30

func snapshot(t *testing.T) report.Snapshot {
	t.Helper()
	p := pool.New()
	for i := range 4 {
		if err := p.AddChunk(pool.Chunk{ID: fmt.Sprintf("gpu%d-numa0-%d", i/2, i), GPU: i / 2, NUMA: 0, Size: gib}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Grant("pod", []string{"gpu0-numa0-0"}); err != nil {
		t.Fatal(err)
	}
	return report.Take(p, map[int]int64{0: 4 * gib, 1: 2 * gib}, time.Now())
}

func TestBuild(t *testing.T) {
	snap := snapshot(t)
	empty := report.Take(pool.New(), map[int]int64{0: 4 * gib}, time.Now())
	for _, c := range []struct {
		name       string
		in         Input
		health     string
		msg        string
		readyCond  metav1.ConditionStatus
		completeOK metav1.ConditionStatus
	}{
		{"healthy", Input{Snapshot: snap, Ready: true}, v1alpha1.HealthHealthy, "", metav1.ConditionTrue, metav1.ConditionFalse},
		{"starting", Input{Snapshot: empty, Reason: "chunks: no chunk ready"}, v1alpha1.HealthStarting, "chunks: no chunk ready", metav1.ConditionFalse, metav1.ConditionFalse},
		{"unhealthy", Input{Snapshot: snap, Reason: "socket: dial: refused"}, v1alpha1.HealthUnhealthy, "socket: dial: refused", metav1.ConditionFalse, metav1.ConditionFalse},
		{"sick gpu", Input{Snapshot: snap, Ready: true, UnhealthyGPUs: map[int]bool{1: true}}, v1alpha1.HealthDegraded, "GPU 1 unhealthy", metav1.ConditionTrue, metav1.ConditionFalse},
		{"sick chunks", Input{Snapshot: snap, Ready: true, UnhealthyChunks: map[int]int{0: 2}}, v1alpha1.HealthDegraded, "GPU 0: 2 chunks unhealthy", metav1.ConditionTrue, metav1.ConditionFalse},
	} {
		st := Build("n1", c.in)
		if st.Health != c.health || st.Message != c.msg {
			t.Errorf("%s: health %q %q, want %q %q", c.name, st.Health, st.Message, c.health, c.msg)
		}
		if len(st.Conditions) != 2 || st.Conditions[0].Status != c.readyCond || st.Conditions[1].Status != c.completeOK {
			t.Errorf("%s: conditions %+v", c.name, st.Conditions)
		}
	}
	st := Build("n1", Input{Snapshot: snap, Ready: true, UnhealthyChunks: map[int]int{1: 1}, ResourceName: "kvpool.io/host-kv"})
	if st.Capacity.String() != "6Gi" || st.Ready.String() != "4Gi" || st.Allocated.String() != "1Gi" || st.Used.String() != "0" {
		t.Errorf("bytes: capacity %s ready %s allocated %s used %s", &st.Capacity, &st.Ready, &st.Allocated, &st.Used)
	}
	if st.Chunks != (v1alpha1.ChunkCounts{Free: 3, Granted: 1, Unhealthy: 1}) || len(st.GPUs) != 2 || st.GPUs[1].Chunks.Unhealthy != 1 || st.NodeName != "n1" {
		t.Errorf("chunks %+v gpus %+v", st.Chunks, st.GPUs)
	}
	if g := st.GPUs[0]; g.Capacity.String() != "4Gi" || g.Ready.String() != "2Gi" || !g.Healthy || g.NUMANode != 0 {
		t.Errorf("gpu0 %+v", g)
	}
}

// fakeAPI is the API server of the Writer's unit tests: Nodes to read and
// KVPoolNodes kept in memory, with what of the real one the Writer relies
// on: its errors (NotFound, AlreadyExists, Conflict), a resourceVersion
// checked on update (a stale one is a conflict), and a status update that
// changes only the status. NewClient's REST client is tested against a real
// kube-apiserver in envtest_test.go, and its requests in client_test.go.
type fakeAPI struct {
	// hook, when set, runs before each Create ("create") and UpdateStatus
	// ("update") with the object given; an error it returns is the call's,
	// and the call then changes nothing.
	hook func(op string, obj *v1alpha1.KVPoolNode) error

	// creates and updates count the calls, failed ones too.
	creates, updates atomic.Int32

	mu    sync.Mutex
	nodes map[string]*corev1.Node
	objs  map[string]*v1alpha1.KVPoolNode
	rv    int
}

var kvpoolnodesGR = schema.GroupResource{Group: "kvpool.io", Resource: "kvpoolnodes"}

func newFake(nodes ...*corev1.Node) *fakeAPI {
	f := &fakeAPI{nodes: map[string]*corev1.Node{}, objs: map[string]*v1alpha1.KVPoolNode{}}
	for _, n := range nodes {
		f.nodes[n.Name] = n
	}
	return f
}

func (f *fakeAPI) GetNode(_ context.Context, name string) (*corev1.Node, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.nodes[name]
	if !ok {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "nodes"}, name)
	}
	return n.DeepCopy(), nil
}

func (f *fakeAPI) Get(_ context.Context, name string) (*v1alpha1.KVPoolNode, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	obj, ok := f.objs[name]
	if !ok {
		return nil, apierrors.NewNotFound(kvpoolnodesGR, name)
	}
	return obj.DeepCopy(), nil
}

func (f *fakeAPI) Create(_ context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	f.creates.Add(1)
	if f.hook != nil {
		if err := f.hook("create", obj); err != nil {
			return nil, err
		}
	}
	return f.create(obj)
}

// create stores obj as the API server would: without its status, with a
// resourceVersion and generation 1.
func (f *fakeAPI) create(obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.objs[obj.Name]; ok {
		return nil, apierrors.NewAlreadyExists(kvpoolnodesGR, obj.Name)
	}
	stored := obj.DeepCopy()
	stored.Status = v1alpha1.KVPoolNodeStatus{}
	stored.Generation = 1
	f.store(stored)
	return stored.DeepCopy(), nil
}

func (f *fakeAPI) UpdateStatus(_ context.Context, obj *v1alpha1.KVPoolNode) (*v1alpha1.KVPoolNode, error) {
	f.updates.Add(1)
	if f.hook != nil {
		if err := f.hook("update", obj); err != nil {
			return nil, err
		}
	}
	return f.update(obj, func(stored *v1alpha1.KVPoolNode) { stored.Status = *obj.Status.DeepCopy() })
}

// update applies change to the stored object when obj's resourceVersion is
// the stored one, and is a conflict otherwise.
func (f *fakeAPI) update(obj *v1alpha1.KVPoolNode, change func(stored *v1alpha1.KVPoolNode)) (*v1alpha1.KVPoolNode, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old, ok := f.objs[obj.Name]
	if !ok {
		return nil, apierrors.NewNotFound(kvpoolnodesGR, obj.Name)
	}
	if obj.ResourceVersion != old.ResourceVersion {
		return nil, apierrors.NewConflict(kvpoolnodesGR, obj.Name,
			errors.New("the object has been modified; please apply your changes to the latest version and try again"))
	}
	stored := old.DeepCopy()
	change(stored)
	f.store(stored)
	return stored.DeepCopy(), nil
}

// label sets a label on the stored object, as another writer would: its
// resourceVersion moves.
func (f *fakeAPI) label(name, key, value string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	old, ok := f.objs[name]
	if !ok {
		return apierrors.NewNotFound(kvpoolnodesGR, name)
	}
	stored := old.DeepCopy()
	if stored.Labels == nil {
		stored.Labels = map[string]string{}
	}
	stored.Labels[key] = value
	f.store(stored)
	return nil
}

func (f *fakeAPI) store(obj *v1alpha1.KVPoolNode) {
	f.rv++
	obj.ResourceVersion = strconv.Itoa(f.rv)
	f.objs[obj.Name] = obj
}

func node(name string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, UID: "uid-" + types.UID(name)}}
}

func get(t *testing.T, c Client, name string) *v1alpha1.KVPoolNode {
	t.Helper()
	obj, err := c.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return obj
}

func TestSyncCreatesThenUpdatesOnChange(t *testing.T) {
	ctx := context.Background()
	c := newFake(node("n1"))
	clock := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)
	w := NewWriter(c, "n1", Options{Now: func() time.Time { return clock }})

	if err := w.Sync(ctx, false); err != nil || c.creates.Load() != 0 {
		t.Fatalf("sync with nothing set: %v, %d creates", err, c.creates.Load())
	}
	snap := snapshot(t)
	w.Set(Build("n1", Input{Snapshot: snap, Reason: "socket: not yet"}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatal(err)
	}
	obj := get(t, c, "n1")
	if len(obj.OwnerReferences) != 1 || obj.OwnerReferences[0].Kind != "Node" || obj.OwnerReferences[0].Name != "n1" || obj.OwnerReferences[0].UID != "uid-n1" {
		t.Errorf("owner references %+v", obj.OwnerReferences)
	}
	if obj.Status.Health != v1alpha1.HealthUnhealthy || obj.Status.Ready.String() != "4Gi" || !obj.Status.LastUpdateTime.Time.Equal(clock) {
		t.Errorf("status %+v", obj.Status)
	}
	t0 := obj.Status.Conditions[0].LastTransitionTime

	// The same status again, within the heartbeat: no write.
	clock = clock.Add(Heartbeat / 2)
	w.Set(Build("n1", Input{Snapshot: snap, Reason: "socket: not yet"}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatal(err)
	}
	if c.creates.Load() != 1 || c.updates.Load() != 1 {
		t.Errorf("unchanged status written: %d creates, %d updates", c.creates.Load(), c.updates.Load())
	}
	// Forced (resync): written, transition times kept.
	if err := w.Sync(ctx, true); err != nil {
		t.Fatal(err)
	}
	obj = get(t, c, "n1")
	if c.updates.Load() != 2 || !obj.Status.LastUpdateTime.Time.Equal(clock) || !obj.Status.Conditions[0].LastTransitionTime.Equal(&t0) {
		t.Errorf("resync: %d updates, status %+v", c.updates.Load(), obj.Status)
	}
	// Readiness flips: written, Ready's transition time moves.
	clock = clock.Add(time.Minute)
	w.Set(Build("n1", Input{Snapshot: snap, Ready: true}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatal(err)
	}
	obj = get(t, c, "n1")
	rc := obj.Status.Conditions[0]
	if c.updates.Load() != 3 || obj.Status.Health != v1alpha1.HealthHealthy || rc.Status != metav1.ConditionTrue || !rc.LastTransitionTime.Time.Equal(clock) {
		t.Errorf("after ready: %d updates, %+v", c.updates.Load(), obj.Status)
	}
	if c.creates.Load() != 1 {
		t.Errorf("%d creates", c.creates.Load())
	}
}

func TestSyncErrorsChangeNothing(t *testing.T) {
	ctx := context.Background()
	snap := snapshot(t)
	for _, c := range []struct {
		name  string
		nodes []*corev1.Node
		hook  func(op string, obj *v1alpha1.KVPoolNode) error
		want  string
	}{
		{"no node", nil, nil, "get node n1 for the owner reference"},
		{"create forbidden", []*corev1.Node{node("n1")}, func(op string, _ *v1alpha1.KVPoolNode) error {
			if op == "create" {
				return apierrors.NewForbidden(kvpoolnodesGR, "n1", errors.New("RBAC"))
			}
			return nil
		}, "create kvpoolnode n1"},
	} {
		cl := newFake(c.nodes...)
		cl.hook = c.hook
		w := NewWriter(cl, "n1", Options{})
		w.Set(Build("n1", Input{Snapshot: snap, Ready: true}))
		err := w.Sync(ctx, false)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v, want %q", c.name, err, c.want)
		}
		if _, err := cl.Get(ctx, "n1"); !apierrors.IsNotFound(err) {
			t.Errorf("%s: object exists after failure (%v)", c.name, err)
		}
		if !w.LastWrite().IsZero() {
			t.Errorf("%s: LastWrite set", c.name)
		}
	}
}

// Run writes at most once per MinInterval however often Set is called, the
// last status set wins, and a conflict is retried. In a synctest bubble the
// clock is virtual: the Sets come exactly 5ms apart and every gap between
// writes is measured exactly, whatever the machine's load.
func TestRunCoalescesAndRateLimits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var writes []time.Time
		c := newFake(node("n1"))
		c.hook = func(op string, _ *v1alpha1.KVPoolNode) error {
			if op != "update" {
				return nil
			}
			writes = append(writes, time.Now())
			if len(writes) == 2 { // the second write meets a conflict
				return apierrors.NewConflict(kvpoolnodesGR, "n1", errors.New("changed"))
			}
			return nil
		}
		const interval = 100 * time.Millisecond
		var failures atomic.Int32
		w := NewWriter(c, "n1", Options{MinInterval: interval, Resync: -1, OnError: func(error) { failures.Add(1) }})
		rec := &observe.Recorder{}
		w.ReportTo(rec)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()

		start := time.Now()
		const sets = 60
		for i := 1; i <= sets; i++ {
			w.Set(v1alpha1.KVPoolNodeStatus{Health: v1alpha1.HealthHealthy, Sessions: int32(i), Capacity: resource.MustParse("1Gi")})
			time.Sleep(5 * time.Millisecond)
		}
		// The last Set is written within one interval, and a retried
		// conflict costs one more.
		time.Sleep(2 * interval)
		synctest.Wait()
		elapsed := time.Since(start)
		if obj := get(t, c, "n1"); obj.Status.Sessions != sets {
			t.Errorf("last status not written after %s: sessions %d, want %d", elapsed, obj.Status.Sessions, sets)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v", err)
		}
		attempts := c.updates.Load()
		// Writes are spaced by at least interval, so at most
		// elapsed/interval+1 of them fit; coalescing keeps it far below the
		// number of Sets.
		if limit := int32(elapsed/interval) + 1; attempts > limit || attempts >= sets/2 {
			t.Errorf("%d write attempts in %s for %d sets (limit %d)", attempts, elapsed, sets, limit)
		}
		for i := 1; i < len(writes); i++ {
			if gap := writes[i].Sub(writes[i-1]); gap < interval {
				t.Errorf("writes %d and %d %s apart, less than MinInterval %s", i-1, i, gap, interval)
			}
		}
		if failures.Load() != 1 {
			t.Errorf("%d failures reported, want the one conflict", failures.Load())
		}
		// The same failure goes to the observer (metrics and the error ring).
		if ops := rec.Ops(); len(ops) != 1 || ops[0].Component != observe.ComponentNodeStatus || ops[0].Name != observe.OpWrite ||
			!apierrors.IsConflict(ops[0].Err) {
			t.Errorf("observer got %+v, want the one conflict as nodestatus/write", ops)
		}
		t.Logf("%d sets over %s became %d write attempts (1 conflict)", sets, elapsed, attempts)
	})
}

// Feed plus Run: the status follows the pool, and an unchanged pool causes
// no writes (checked over exactly 20 feeds, on synctest's virtual clock).
func TestFeedFollowsPool(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newFake(node("n1"))
		p := pool.New()
		if err := p.AddChunk(pool.Chunk{ID: "gpu0-numa0-0", Size: gib}); err != nil {
			t.Fatal(err)
		}
		const feed, minInterval = 5 * time.Millisecond, 20 * time.Millisecond
		w := NewWriter(c, "n1", Options{MinInterval: minInterval, Resync: -1})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() { _ = w.Run(ctx) }()
		go Feed(ctx, w, feed, func() v1alpha1.KVPoolNodeStatus {
			return Build("n1", Input{Snapshot: report.Take(p, nil, time.Now()), Ready: true})
		})
		// A change is written within MinInterval plus one feed.
		settle := func() { time.Sleep(minInterval + feed); synctest.Wait() }
		settle()
		if got := get(t, c, "n1").Status.Ready.String(); got != "1Gi" {
			t.Fatalf("first chunk: ready %s, want 1Gi", got)
		}
		if err := p.Grant("pod", []string{"gpu0-numa0-0"}); err != nil {
			t.Fatal(err)
		}
		settle()
		if got := get(t, c, "n1").Status.Allocated.String(); got != "1Gi" {
			t.Fatalf("grant: allocated %s, want 1Gi", got)
		}
		before := c.updates.Load()
		time.Sleep(20 * feed) // 20 feeds of an unchanged pool
		synctest.Wait()
		if after := c.updates.Load(); after != before {
			t.Errorf("unchanged pool caused %d writes", after-before)
		}
		cancel()
	})
}

// Stopped writes at once a status that no longer claims a serving agent;
// before any status was set it writes nothing.
func TestStoppedWritesFinalStatus(t *testing.T) {
	ctx := context.Background()
	c := newFake(node("n1"))
	clock := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)
	w := NewWriter(c, "n1", Options{Now: func() time.Time { return clock }})
	if err := w.Stopped(ctx, "agent stopped"); err != nil || c.creates.Load() != 0 || c.updates.Load() != 0 {
		t.Fatalf("Stopped before any status: %v, %d creates, %d updates", err, c.creates.Load(), c.updates.Load())
	}
	w.Set(Build("n1", Input{Snapshot: snapshot(t), Ready: true}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatal(err)
	}
	if obj := get(t, c, "n1"); obj.Status.Health != v1alpha1.HealthHealthy || obj.Status.Ready.IsZero() {
		t.Fatalf("before stop: %+v", obj.Status)
	}
	clock = clock.Add(time.Second) // within MinInterval: Stopped writes anyway
	if err := w.Stopped(ctx, "agent stopped (SIGTERM)"); err != nil {
		t.Fatal(err)
	}
	st := get(t, c, "n1").Status
	if st.Health != v1alpha1.HealthUnhealthy || st.Message != "agent stopped (SIGTERM)" || !st.Ready.IsZero() || st.Sessions != 0 || !st.LastUpdateTime.Time.Equal(clock) {
		t.Errorf("after stop: health %s %q ready %s sessions %d updated %s", st.Health, st.Message, st.Ready.String(), st.Sessions, st.LastUpdateTime)
	}
	for _, g := range st.GPUs {
		if !g.Ready.IsZero() {
			t.Errorf("GPU %d still has %s ready", g.Index, g.Ready.String())
		}
	}
	for _, cond := range st.Conditions {
		if cond.Status != metav1.ConditionFalse || cond.Reason != "AgentStopped" {
			t.Errorf("condition %s after stop: %+v", cond.Type, cond)
		}
		// Ready was True: its transition time moves to the stop.
		if cond.Type == v1alpha1.ConditionReady && !cond.LastTransitionTime.Time.Equal(clock) {
			t.Errorf("Ready's transition time %s, want the stop %s", cond.LastTransitionTime, clock)
		}
	}
}

// An unchanged status is rewritten every Resync (the heartbeat), so its
// lastUpdateTime moves while the agent lives. With the agent's own timings
// (MinInterval 10s, Resync Heartbeat) on synctest's virtual clock: one
// write per heartbeat, each stamped with its time.
func TestHeartbeatRefreshesUnchangedStatus(t *testing.T) {
	if Heartbeat > 30*time.Second || StaleAfter < 2*Heartbeat {
		t.Fatalf("Heartbeat %v, StaleAfter %v: readers need a short heartbeat and room for one missed write", Heartbeat, StaleAfter)
	}
	synctest.Test(t, func(t *testing.T) {
		c := newFake(node("n1"))
		w := NewWriter(c, "n1", Options{})
		w.Set(Build("n1", Input{Snapshot: snapshot(t), Ready: true}))
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		synctest.Wait()
		first := c.updates.Load()
		if first == 0 {
			t.Fatal("the status set before Run was not written")
		}
		for beat := int32(1); beat <= 4; beat++ {
			time.Sleep(Heartbeat)
			synctest.Wait()
			if got := c.updates.Load() - first; got != beat {
				t.Errorf("after %d heartbeats: %d rewrites of an unchanged status, want %d", beat, got, beat)
			}
			if st := get(t, c, "n1").Status; !st.LastUpdateTime.Time.Equal(time.Now()) {
				t.Errorf("heartbeat %d: lastUpdateTime %s, want now (%s)", beat, st.LastUpdateTime, time.Now())
			}
		}
		cancel()
		<-done
	})
}

func TestBuildRestart(t *testing.T) {
	st := Build("n", Input{})
	if st.Restart != nil {
		t.Fatalf("restart without a keeper: %+v", st.Restart)
	}
	st = Build("n", Input{Restart: &report.Restart{AdoptedChunks: 7, FreshChunks: 1, KeeperLockedChunks: 6, KeeperLosses: 2, PoolLost: true,
		KeeperConnected: true, LastGapSeconds: 0.1234}})
	if r := st.Restart; r == nil || r.AdoptedChunks != 7 || r.FreshChunks != 1 || r.LastGapMilliseconds != 123 || r.KeeperLockedChunks != 6 ||
		r.KeeperLosses != 2 || !r.PoolLost || !r.KeeperConnected {
		t.Fatalf("restart %+v", st.Restart)
	}
}

// The front door and the DRA driver's prepared claims are in the status:
// each claim's requests, chunks, bytes and GPUs.
func TestBuildClaims(t *testing.T) {
	st := Build("n", Input{Mode: "dra", DRADriver: "kvpool.io", Claims: []report.Claim{
		{Namespace: "ns", Name: "kv", UID: "u1", Requests: []report.ClaimRequest{{Name: "a"}, {Name: "b"}}, Chunks: 3, Bytes: 3 << 30, GPUs: []int{0, 1}},
	}})
	if st.Mode != "dra" || st.DRADriver != "kvpool.io" || len(st.Claims) != 1 {
		t.Fatalf("status %+v", st)
	}
	c := st.Claims[0]
	if c.Namespace != "ns" || c.Name != "kv" || c.UID != "u1" || c.Requests != 2 || c.Chunks != 3 || c.Bytes.String() != "3Gi" ||
		len(c.GPUs) != 2 || c.GPUs[1] != 1 {
		t.Errorf("claim %+v", c)
	}
	if st := Build("n", Input{Mode: "devicePlugin"}); st.Claims != nil || st.DRADriver != "" {
		t.Errorf("no claims: %+v", st)
	}
}

// The heartbeat does not depend on which wake-up Run acts on: an unchanged
// status is rewritten by any Sync once lastUpdateTime is Resync old, so a
// status fed more often than MinInterval (the agent feeds every 5s, writes at
// most every 10s) cannot crowd it out.
func TestHeartbeatDueOnAnySync(t *testing.T) {
	ctx := context.Background()
	c := newFake(node("n1"))
	clock := time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC)
	w := NewWriter(c, "n1", Options{Now: func() time.Time { return clock }})
	w.Set(Build("n1", Input{Snapshot: snapshot(t), Ready: true}))
	if err := w.Sync(ctx, false); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		advance time.Duration
		writes  int32
	}{
		{0, 0},                         // unchanged, just written
		{Heartbeat - time.Second, 0},   // not yet due
		{time.Second, 1},               // a Heartbeat old: rewritten
		{time.Second, 0},               // fresh again
		{2*Heartbeat + time.Second, 1}, // long silent (a slow API): one write
	} {
		clock = clock.Add(step.advance)
		before := c.updates.Load()
		if err := w.Sync(ctx, false); err != nil {
			t.Fatal(err)
		}
		if got := c.updates.Load() - before; got != step.writes {
			t.Errorf("at +%s: %d writes, want %d", clock.Sub(time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC)), got, step.writes)
		}
		if st := get(t, c, "n1").Status; step.writes > 0 && !st.LastUpdateTime.Time.Equal(clock) {
			t.Errorf("lastUpdateTime %s after the heartbeat at %s", st.LastUpdateTime, clock)
		}
	}
}

// Stopped is the last write, with no later pass to retry it: a conflict (the
// object changed between its read and its write) or a create that lost a
// race is retried at once, with the object read afresh; any other error is
// returned without a retry and leaves the object as it was.
func TestStoppedRetriesConflicts(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name          string
		synced        bool // a status was written before Stopped
		hook          func(f *fakeAPI) func(op string, obj *v1alpha1.KVPoolNode) error
		wantErr       string
		wantUpdates   int32
		wantCreates   int32
		wantUnhealthy bool
	}{
		{"conflict", true, func(f *fakeAPI) func(string, *v1alpha1.KVPoolNode) error {
			return func(op string, obj *v1alpha1.KVPoolNode) error {
				if op == "update" && f.updates.Load() == 2 { // Stopped's first write: someone labels the object first
					return f.label(obj.Name, "touched", "yes")
				}
				return nil // the write goes on with a stale resourceVersion: a real conflict
			}
		}, "", 3, 1, true},
		{"create lost a race", false, func(f *fakeAPI) func(string, *v1alpha1.KVPoolNode) error {
			return func(op string, obj *v1alpha1.KVPoolNode) error {
				if op != "create" {
					return nil
				}
				if _, err := f.create(obj); err != nil {
					return err
				}
				return apierrors.NewAlreadyExists(kvpoolnodesGR, obj.Name)
			}
		}, "", 1, 1, true},
		{"forbidden", true, func(f *fakeAPI) func(string, *v1alpha1.KVPoolNode) error {
			return func(op string, obj *v1alpha1.KVPoolNode) error {
				if op == "update" && f.updates.Load() == 2 {
					return apierrors.NewForbidden(kvpoolnodesGR, obj.Name, errors.New("denied"))
				}
				return nil
			}
		}, "forbidden", 2, 1, false},
	} {
		cl := newFake(node("n1"))
		cl.hook = c.hook(cl)
		w := NewWriter(cl, "n1", Options{})
		w.Set(Build("n1", Input{Snapshot: snapshot(t), Ready: true}))
		if c.synced {
			if err := w.Sync(ctx, false); err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
		}
		err := w.Stopped(ctx, "agent stopped")
		switch {
		case c.wantErr == "" && err != nil:
			t.Errorf("%s: Stopped: %v", c.name, err)
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%s: Stopped returned %v, want %q", c.name, err, c.wantErr)
		}
		if got := cl.updates.Load(); got != c.wantUpdates {
			t.Errorf("%s: %d status updates, want %d", c.name, got, c.wantUpdates)
		}
		if got := cl.creates.Load(); got != c.wantCreates {
			t.Errorf("%s: %d creates, want %d", c.name, got, c.wantCreates)
		}
		obj := get(t, cl, "n1")
		if got := obj.Status.Health == v1alpha1.HealthUnhealthy; got != c.wantUnhealthy {
			t.Errorf("%s: health %s after Stopped (want the final status: %v)", c.name, obj.Status.Health, c.wantUnhealthy)
		}
		if c.name == "conflict" && obj.Labels["touched"] != "yes" {
			t.Errorf("conflict: the other writer's label is gone: %v", obj.Labels)
		}
	}
}

// A change of health or of a condition (the agent became ready) is
// written at once, within UrgentInterval, however recent the last write;
// other changes still wait out MinInterval; and the heartbeat comes Resync
// after the last write, so no status goes unwritten longer (issue 23: the
// status said "device plugin not registered" for 5-10 s after the pod was
// Ready). On synctest's virtual clock, with the agent's own timings.
func TestUrgentChangesWrittenAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var writeTimes []time.Time
		c := newFake(node("n1"))
		c.hook = func(op string, _ *v1alpha1.KVPoolNode) error {
			if op == "update" {
				mu.Lock()
				writeTimes = append(writeTimes, time.Now())
				mu.Unlock()
			}
			return nil
		}
		writes := func() []time.Time {
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(writeTimes)
		}
		w := NewWriter(c, "n1", Options{})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		start := time.Now()
		at := func(d time.Duration) { time.Sleep(time.Until(start.Add(d))); synctest.Wait() }
		snap := snapshot(t)
		w.Set(Build("n1", Input{Snapshot: snap, Ready: false, Reason: "device plugin not registered with kubelet"}))
		at(0)
		if len(writes()) != 1 {
			t.Fatalf("%d writes at start, want 1", len(writes()))
		}
		at(2 * time.Second)
		w.Set(Build("n1", Input{Snapshot: snap, Ready: true}))
		at(2*time.Second + 10*time.Millisecond)
		if len(writes()) != 2 || !apimeta.IsStatusConditionTrue(get(t, c, "n1").Status.Conditions, v1alpha1.ConditionReady) {
			t.Fatalf("readiness 2s after the first write: %d writes, Ready %v", len(writes()),
				apimeta.IsStatusConditionTrue(get(t, c, "n1").Status.Conditions, v1alpha1.ConditionReady))
		}
		// A change of counts only waits out MinInterval.
		st := Build("n1", Input{Snapshot: snap, Ready: true})
		st.Sessions = 5
		w.Set(st)
		at(5 * time.Second)
		if len(writes()) != 2 {
			t.Fatalf("a count change was written %s after an urgent one", writes()[2].Sub(writes()[1]))
		}
		at(12*time.Second + 10*time.Millisecond)
		if len(writes()) != 3 || get(t, c, "n1").Status.Sessions != 5 {
			t.Fatalf("the count change after MinInterval: %d writes", len(writes()))
		}
		// Nothing changes: the heartbeat comes Resync after the last write.
		at(12*time.Second + 3*Heartbeat + 10*time.Millisecond)
		w2 := writes()
		for i := 1; i < len(w2); i++ {
			if gap := w2[i].Sub(w2[i-1]); gap > Heartbeat {
				t.Errorf("writes %d and %d are %s apart, more than the heartbeat %s", i-1, i, gap, Heartbeat)
			}
		}
		if len(writes()) != 6 {
			t.Errorf("%d writes, want 3 and one per heartbeat (6)", len(writes()))
		}
		cancel()
		<-done
	})
}
