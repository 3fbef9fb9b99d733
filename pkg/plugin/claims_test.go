package plugin

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/pool"
)

const (
	claimA = "0b5a3b0e-5d5c-4cf4-9f43-2f0b9f6d0a11"
	claimB = "6f0c9d5a-1e2b-4c3d-8e9f-0a1b2c3d4e5f"
)

func claimOf(uid string, reqs ...ClaimRequest) Claim {
	return Claim{UID: uid, Namespace: "ns", Name: "c-" + uid[:4], PodUIDs: []string{uidA}, Requests: reqs}
}

func named(name string, ids ...string) ClaimRequest { return ClaimRequest{Name: name, Devices: ids} }

func shares(name string, s ...Share) ClaimRequest { return ClaimRequest{Name: name, Shares: s} }

func resultOf(err error) string {
	var ae *AllocateError
	if errors.As(err, &ae) {
		return ae.Result
	}
	if err == nil {
		return ResultOK
	}
	return "other: " + err.Error()
}

// Every misuse of PrepareClaim is refused with its result and a message,
// and changes nothing: no grant in the pool, no record, no checkpoint.
func TestPrepareClaimRefusals(t *testing.T) {
	e := newEnv(t)
	e.mustAllocate("gpu1-numa1-0") // a device plugin allocation
	if _, err := e.p.PrepareClaim(context.Background(), claimOf(claimB, named("kv", "gpu1-numa1-3"))); err != nil {
		t.Fatal(err)
	}
	if err := e.feed.SetHealth("gpu0-numa0-3", false); err != nil {
		t.Fatal(err)
	}
	before := chunkStates(e.pool)
	beforeRecs := e.p.Allocations()
	for _, c := range []struct {
		name   string
		claim  Claim
		result string
		msg    string
	}{
		{"uid not a UID", Claim{UID: "../x", Namespace: "ns", Name: "c", Requests: []ClaimRequest{named("kv", "gpu0-numa0-0")}}, ResultInvalid, "not a UID"},
		{"no name", Claim{UID: claimA, Namespace: "ns", Requests: []ClaimRequest{named("kv", "gpu0-numa0-0")}}, ResultInvalid, "no namespace or name"},
		{"no request", claimOf(claimA), ResultInvalid, "no request"},
		{"empty request", claimOf(claimA, ClaimRequest{Name: "kv"}), ResultInvalid, "asks for no chunk"},
		{"request twice", claimOf(claimA, named("kv", "gpu0-numa0-0"), named("kv", "gpu0-numa0-1")), ResultInvalid, "empty or repeated"},
		{"chunk in two requests", claimOf(claimA, named("a", "gpu0-numa0-0"), named("b", "gpu0-numa0-0")), ResultInvalid, "named by requests a and b"},
		{"unknown chunk", claimOf(claimA, named("kv", "gpu7-numa0-0")), ResultInvalid, "unknown chunk gpu7-numa0-0"},
		{"unhealthy chunk", claimOf(claimA, named("kv", "gpu0-numa0-3")), ResultRefused, "unhealthy"},
		{"share of nothing", claimOf(claimA, shares("kv", Share{GPU: 0, Chunks: 0})), ResultInvalid, "share of 0 chunks"},
		{"bad pod UID", Claim{UID: claimA, Namespace: "ns", Name: "c", PodUIDs: []string{"pod"}, Requests: []ClaimRequest{named("kv", "gpu0-numa0-0")}}, ResultInvalid, "pod UID"},
		{"chunk of a device plugin allocation", claimOf(claimA, named("kv", "gpu1-numa1-0")), ResultRefused, "held by a device plugin allocation"},
		{"chunk of another claim", claimOf(claimA, named("kv", "gpu1-numa1-3")), ResultRefused, "held by ResourceClaim ns/c-6f0c"},
		// GPU 1 has 4 chunks: 1 to the device plugin, 1 to claim B.
		{"capacity exhausted", claimOf(claimA, shares("kv", Share{GPU: 1, Chunks: 3})), ResultUnavailable, "GPU 1 has 2 free chunks, the share needs 3"},
		{"share beyond the GPU's unhealthy chunk", claimOf(claimA, shares("kv", Share{GPU: 0, Chunks: 4})), ResultUnavailable, "GPU 0 has 3 free chunks"},
		{"no such GPU", claimOf(claimA, shares("kv", Share{GPU: 5, Chunks: 1})), ResultUnavailable, "GPU 5 has 0 free chunks"},
		{"prepared with other requests", claimOf(claimB, named("kv", "gpu1-numa1-2")), ResultRefused, "prepared already, with other devices"},
		{"prepared with more requests", claimOf(claimB, named("kv", "gpu1-numa1-3"), named("more", "gpu0-numa0-0")), ResultRefused, "2 asked"},
	} {
		t.Run(c.name, func(t *testing.T) {
			grants, err := e.p.PrepareClaim(context.Background(), c.claim)
			if resultOf(err) != c.result || err == nil || !strings.Contains(err.Error(), c.msg) || grants != nil {
				t.Fatalf("PrepareClaim = %v, %v; want %s mentioning %q", grants, err, c.result, c.msg)
			}
			if got := chunkStates(e.pool); !maps.Equal(got, before) {
				t.Errorf("pool changed: %v, was %v", got, before)
			}
			if !sameRecords(e.p.Allocations(), beforeRecs) {
				t.Errorf("records changed: %v", e.p.Allocations())
			}
		})
	}
}

// A claim's named chunks and shares are granted under one fresh token per
// request; a repeated Prepare returns the same grants (and takes the new
// pods); the checkpoint keeps the claim, so a restarted agent answers the
// same; Unprepare (by UID only) ends the allocations, the chunks renew,
// and a second Unprepare is a no-op.
func TestPrepareUnprepareClaim(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c := claimOf(claimA, named("chunks", "gpu0-numa0-2", "gpu0-numa0-0"), shares("bytes", Share{GPU: 1, Chunks: 2}))
	grants, err := e.p.PrepareClaim(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(grants) != 2 || grants[0].Request != "chunks" || grants[1].Request != "bytes" ||
		!slices.Equal(grants[0].Devices, []string{"gpu0-numa0-0", "gpu0-numa0-2"}) ||
		!slices.Equal(grants[1].Devices, []string{"gpu1-numa1-0", "gpu1-numa1-1"}) ||
		!contract.IsToken(grants[0].Token) || !contract.IsToken(grants[1].Token) || grants[0].Token == grants[1].Token {
		t.Fatalf("grants = %+v", grants)
	}
	for _, g := range grants {
		alloc, err := e.p.Authorize(g.Token)
		if err != nil || alloc != AllocationID(g.Token) {
			t.Fatalf("Authorize(%s) = %q, %v", g.Request, alloc, err)
		}
		for _, id := range g.Devices {
			if st := chunkStates(e.pool)[id]; st != "granted/"+alloc {
				t.Errorf("chunk %s is %s, want granted to %s", id, st, alloc)
			}
		}
	}
	// The same claim again, now reserved for a second pod: the same grants.
	c.PodUIDs = []string{uidB, uidA}
	again, err := e.p.PrepareClaim(ctx, c)
	if err != nil || !slices.EqualFunc(again, grants, func(a, b ClaimGrant) bool {
		return a.Token == b.Token && slices.Equal(a.Devices, b.Devices) && a.Request == b.Request
	}) {
		t.Fatalf("repeated Prepare = %+v, %v; want %+v", again, err, grants)
	}
	recs, err := LoadCheckpoint(e.p.o.StateDir)
	if err != nil || len(recs) != 2 {
		t.Fatalf("checkpoint: %v, %v", recs, err)
	}
	for _, r := range recs {
		if r.Claim == nil || r.Claim.UID != claimA || !slices.Equal(r.Claim.PodUIDs, []string{uidA, uidB}) {
			t.Errorf("checkpoint record %+v: claim %+v", r, r.Claim)
		}
	}
	// Holders: the claim's chunks, nothing else.
	held, _ := e.p.ChunkHolders()
	if len(held) != 4 || held["gpu1-numa1-1"] != HeldClaim || held["gpu0-numa0-2"] != HeldClaim {
		t.Errorf("holders = %v", held)
	}

	// A restarted agent (a new plugin on the same state directory, a pool
	// rebuilt without grants) answers the repeated Prepare the same.
	fresh := newPool(t)
	p2 := e.newPlugin(fresh)
	again, err = p2.PrepareClaim(ctx, c)
	if err != nil || again[0].Token != grants[0].Token || again[1].Token != grants[1].Token {
		t.Fatalf("Prepare after a restart = %+v, %v", again, err)
	}

	// Unprepare by UID ends both allocations; the chunks renew.
	n, err := e.p.UnprepareClaim(claimA)
	if err != nil || n != 2 {
		t.Fatalf("UnprepareClaim = %d, %v", n, err)
	}
	for _, g := range grants {
		if _, err := e.p.Authorize(g.Token); !errors.Is(err, contract.ErrUnknownToken) {
			t.Errorf("token of request %s after Unprepare: %v", g.Request, err)
		}
	}
	waitFor(t, "the claim's chunks renewed", func() bool {
		held, _ := e.p.ChunkHolders()
		return len(held) == 0 && e.zeroCount("gpu0-numa0-0") == 1 && e.zeroCount("gpu1-numa1-1") == 1
	})
	if n, err := e.p.UnprepareClaim(claimA); err != nil || n != 0 {
		t.Errorf("second Unprepare = %d, %v; want a no-op", n, err)
	}
	if recs, err := LoadCheckpoint(e.p.o.StateDir); err != nil || len(recs) != 0 {
		t.Errorf("checkpoint after Unprepare: %v, %v", recs, err)
	}
	if !slices.Contains(e.ops(), "reclaim/unprepared ok "+AllocationID(grants[0].Token)) {
		t.Errorf("ops %v: no unprepared reclaim", e.ops())
	}
	if _, err := e.p.UnprepareClaim("x"); resultOf(err) != ResultInvalid {
		t.Errorf("Unprepare of a malformed UID: %v", err)
	}
}

// A share takes clean chunks first; when only chunks released a moment
// ago are left, Prepare renews them itself before granting them.
func TestPrepareClaimRenewsReleasedChunks(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	first, err := e.p.PrepareClaim(ctx, claimOf(claimA, shares("kv", Share{GPU: 0, Chunks: 4})))
	if err != nil {
		t.Fatal(err)
	}
	// Hold the renew loop off: Unprepare leaves the chunks dirty.
	e.p.renewMu.Lock()
	if _, err := e.p.UnprepareClaim(claimA); err != nil {
		e.p.renewMu.Unlock()
		t.Fatal(err)
	}
	if len(e.p.Dirty()) != 4 {
		e.p.renewMu.Unlock()
		t.Fatalf("dirty after Unprepare: %v", e.p.Dirty())
	}
	e.p.renewMu.Unlock()
	second, err := e.p.PrepareClaim(ctx, claimOf(claimB, shares("kv", Share{GPU: 0, Chunks: 4})))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(second[0].Devices, first[0].Devices) || second[0].Token == first[0].Token {
		t.Fatalf("second claim got %+v, first %+v", second, first)
	}
	for _, id := range second[0].Devices {
		if e.zeroCount(id) != 1 {
			t.Errorf("chunk %s renewed %d times before its second grant, want 1", id, e.zeroCount(id))
		}
	}
}

// The two doors never share a chunk: PodResources never reclaims a
// claim's allocation, kubelet is told a claim's chunks are unhealthy, and
// an Allocate of one is refused.
func TestClaimAndDevicePluginDoors(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	grants, err := e.p.PrepareClaim(ctx, claimOf(claimA, named("kv", "gpu0-numa0-1")))
	if err != nil {
		t.Fatal(err)
	}
	e.clock.Advance(10 * testGrace)
	e.reconcile()
	if _, err := e.p.Authorize(grants[0].Token); err != nil {
		t.Fatalf("reconcile reclaimed the claim's allocation: %v", err)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, "gpu0-numa0-1") == pluginapi.Unhealthy })
	if _, err := e.allocate([]string{"gpu0-numa0-1"}); err == nil || !strings.Contains(err.Error(), "held by ResourceClaim ns/c-0b5a") {
		t.Fatalf("Allocate of a claim's chunk: %v", err)
	}
	if _, err := e.allocate([]string{"gpu0-numa0-0", "gpu0-numa0-1"}); err == nil {
		t.Fatal("Allocate overlapping a claim's chunk succeeded")
	}
	if _, err := e.p.UnprepareClaim(claimA); err != nil {
		t.Fatal(err)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, "gpu0-numa0-1") == pluginapi.Healthy })
	e.mustAllocate("gpu0-numa0-1")
}

// With BindPods a claim's token works only from the pods the claim is
// reserved for, by pod UID from the client's cgroup: no pod name lookup.
func TestAuthorizePeerClaimPods(t *testing.T) {
	e := newEnv(t)
	o := e.options(e.pool)
	o.BindPods, o.PodLogsDir = true, t.TempDir()
	o.ProcRoot = fakeProc(t, map[int]string{
		100: "0::/kubepods/besteffort/pod" + uidA + "/c1\n",
		200: "0::/kubepods/besteffort/pod" + uidB + "/c2\n",
		300: "0::/system.slice/x.scope\n",
	})
	o.Holders = staticHolders{}
	p, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	grants, err := p.PrepareClaim(context.Background(), claimOf(claimA, named("kv", "gpu0-numa0-0")))
	if err != nil {
		t.Fatal(err)
	}
	tok := grants[0].Token
	if id, err := p.AuthorizePeer(context.Background(), tok, 100); err != nil || id != AllocationID(tok) {
		t.Errorf("from the claim's pod: %q, %v", id, err)
	}
	for pid, msg := range map[int32]string{200: "runs in pod UID " + uidB, 300: "not in a Kubernetes pod"} {
		if _, err := p.AuthorizePeer(context.Background(), tok, pid); !errors.Is(err, ErrWrongPod) || !strings.Contains(err.Error(), msg) {
			t.Errorf("pid %d: %v; want ErrWrongPod mentioning %q", pid, err, msg)
		}
	}
	// The claim is now shared with pod B (a second Prepare): B may use it.
	c := claimOf(claimA, named("kv", "gpu0-numa0-0"))
	c.PodUIDs = []string{uidA, uidB}
	if _, err := p.PrepareClaim(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	if _, err := p.AuthorizePeer(context.Background(), tok, 200); err != nil {
		t.Errorf("pod B after the claim was shared with it: %v", err)
	}
}

// A claim's record survives a restart in which its chunks are not ready
// yet: Prepare then answers "unavailable" (kubelet retries) and succeeds
// once the chunks are back.
func TestPrepareClaimRestoredBeforeChunks(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	c := claimOf(claimA, named("kv", "gpu1-numa1-2"))
	grants, err := e.p.PrepareClaim(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	empty := pool.New()
	p2 := e.newPlugin(empty)
	if _, err := p2.PrepareClaim(ctx, c); resultOf(err) != ResultUnavailable {
		t.Fatalf("Prepare before the chunks are ready: %v", err)
	}
	for _, ch := range testChunks() {
		if err := empty.AddChunk(ch); err != nil {
			t.Fatal(err)
		}
	}
	again, err := p2.PrepareClaim(ctx, c)
	if err != nil || again[0].Token != grants[0].Token {
		t.Fatalf("Prepare once the chunks are back: %+v, %v", again, err)
	}
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within 5s: %s", what)
		}
	}
}
