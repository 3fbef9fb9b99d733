package plugin

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin/kubelettest"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

func TestRegistrationAndFirstList(t *testing.T) {
	root := shortDir(t)
	kdir := filepath.Join(root, "device-plugins")
	os.MkdirAll(kdir, 0o755)
	k := kubelettest.NewKubelet(t, kdir)
	feed := NewFeed()
	feed.Set([]Device{{ID: "gpu0-numa1-0", NUMA: 1, Healthy: true}, {ID: "gpu1-numaX-0", NUMA: -1, Healthy: true}})
	p, err := New(Options{
		ResourceName: "example.com/kv", KubeletDir: root, SocketDir: "/run/kvp", StateDir: filepath.Join(root, "state"),
		Pool: pool.New(), Devices: feed, Renew: func(string) error { return nil },
		Holders: staticHolders{}, Watch: 20 * time.Millisecond, Interval: time.Hour, Logger: quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- p.Run(ctx) }()
	reg := k.WaitRegister(5 * time.Second)
	if reg.Version != pluginapi.Version || reg.ResourceName != "example.com/kv" || reg.Endpoint != p.Endpoint() ||
		!reg.GetOptions().GetGetPreferredAllocationAvailable() {
		t.Errorf("register request = %+v", reg)
	}
	list := k.WaitList(func([]*pluginapi.Device) bool { return true })
	if len(list) != 2 {
		t.Fatalf("first list has %d devices, want 2: %v", len(list), list)
	}
	if list[0].ID != "gpu0-numa1-0" || list[0].Health != pluginapi.Healthy || len(list[0].GetTopology().GetNodes()) != 1 || list[0].Topology.Nodes[0].ID != 1 {
		t.Errorf("device 0 = %v, want healthy with NUMA node 1", list[0])
	}
	if list[1].Topology != nil {
		t.Errorf("device with unknown NUMA node has topology %v", list[1].Topology)
	}
	// A new ready chunk reaches kubelet as a new full list.
	feed.Set([]Device{{ID: "gpu0-numa1-0", NUMA: 1, Healthy: true}, {ID: "gpu0-numa1-1", NUMA: 1, Healthy: true}, {ID: "gpu1-numaX-0", NUMA: -1, Healthy: true}})
	k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 3 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(kdir, p.Endpoint())); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("plugin socket left behind after Run returned: %v", err)
	}
}

type staticHolders map[string]string

func (h staticHolders) Held(context.Context, string) (map[string]string, error) { return h, nil }

func TestHealthFlipsBothWays(t *testing.T) {
	e := newEnv(t)
	id := "gpu1-numa1-2"
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, id) == pluginapi.Healthy })
	if err := e.feed.SetHealth(id, false); err != nil {
		t.Fatal(err)
	}
	l := e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, id) == pluginapi.Unhealthy })
	if len(l) != 8 {
		t.Errorf("update is not a full list: %d devices", len(l))
	}
	if err := e.feed.SetHealth(id, true); err != nil {
		t.Fatal(err)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, id) == pluginapi.Healthy })
	if err := e.feed.SetHealth("gpu9-numa0-0", false); err == nil {
		t.Error("SetHealth of an unknown device succeeded")
	}
}

func TestReregisterAfterKubeletRestart(t *testing.T) {
	e := newEnv(t)
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 8 })
	// reregistered waits until the plugin has counted a registration after
	// before: the test kubelet sees Register before the plugin sees the
	// reply, and a kubelet stopped in between fails that attempt.
	reregistered := func(before int64, start time.Time) {
		t.Helper()
		for deadline := start.Add(5 * time.Second); e.p.Registrations() <= before || !e.p.Registered(); {
			if time.Now().After(deadline) {
				t.Fatalf("not registered again within 5s (registrations %d, before %d)", e.p.Registrations(), before)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	for round := range 2 {
		before, start := e.p.Registrations(), time.Now()
		e.kubelet.Restart() // removes our socket and recreates kubelet.sock
		e.kubelet.WaitRegister(5 * time.Second)
		reregistered(before, start)
		t.Logf("round %d: re-registered %v after the restart", round, time.Since(start))
		e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 8 })
		if _, err := e.allocate([]string{"gpu0-numa0-0"}); err != nil {
			t.Fatalf("allocate on the new connection: %v", err)
		}
	}
	// kubelet.sock recreated while our socket stays: register again too.
	before, start := e.p.Registrations(), time.Now()
	e.kubelet.Stop()
	os.Remove(filepath.Join(e.kubelet.Dir, "kubelet.sock"))
	e.kubelet.Start()
	e.kubelet.WaitRegister(5 * time.Second)
	reregistered(before, start)
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 8 })
}

// With the fallback poll an hour apart, kubelet's start, the removal of the
// plugin's socket and kubelet's restart are each seen through inotify.
func TestRestartSeenWithoutPolling(t *testing.T) {
	root := shortDir(t)
	kdir := filepath.Join(root, "device-plugins")
	if err := os.MkdirAll(kdir, 0o755); err != nil {
		t.Fatal(err)
	}
	feed := NewFeed()
	feed.Set([]Device{{ID: "gpu0-numa0-0", NUMA: 0, Healthy: true}})
	p, err := New(Options{
		ResourceName: "example.com/kv", KubeletDir: root, SocketDir: "/run/kvp", StateDir: filepath.Join(root, "state"),
		Pool: pool.New(), Devices: feed, Renew: func(string) error { return nil },
		Holders: staticHolders{}, Watch: time.Hour, Interval: time.Hour, Logger: quietLogger(),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	sock := filepath.Join(kdir, p.Endpoint())
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the plugin's socket did not appear within 5s")
		}
	}
	registered := func(what string, after int64) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); p.Registrations() <= after || !p.Registered(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not registered within 5s (registrations %d, before %d)", what, p.Registrations(), after)
			}
		}
	}
	// kubelet starts after the plugin: kubelet.sock's creation is seen.
	k := kubelettest.NewKubelet(t, kdir)
	k.WaitRegister(5 * time.Second)
	registered("kubelet started", 0)
	// Only the plugin's socket goes (kubelet keeps the stream open).
	before := p.Registrations()
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	k.WaitRegister(5 * time.Second)
	registered("socket removed", before)
	// A full restart, as kubelet does it.
	before = p.Registrations()
	k.Restart()
	k.WaitRegister(5 * time.Second)
	registered("kubelet restarted", before)
	k.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 1 })
}

func TestAllocate(t *testing.T) {
	e := newEnv(t)
	e.feed.SetHealth("gpu1-numa1-3", false)
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, "gpu1-numa1-3") == pluginapi.Unhealthy })

	good := []string{"gpu0-numa0-1", "gpu0-numa0-0"}
	resp, err := e.allocate(good)
	if err != nil {
		t.Fatal(err)
	}
	cr := resp.ContainerResponses[0]
	token := cr.Envs[contract.EnvToken]
	if cr.Envs[contract.EnvSocket] != "/var/run/kvpool/kvpool.sock" || !contract.IsToken(token) || len(token) < 22 {
		t.Errorf("envs = %v", cr.Envs)
	}
	if len(cr.Mounts) != 1 || cr.Mounts[0].ContainerPath != "/var/run/kvpool" || cr.Mounts[0].HostPath != filepath.Join(e.root, "sock") || !cr.Mounts[0].ReadOnly {
		t.Errorf("mounts = %v", cr.Mounts)
	} else {
		// The socket the pod is told of is the one the agent listens on,
		// by construction: the mount's host side is the socket directory,
		// and the plugin and config.SocketPath both name the file
		// contract.SocketFile.
		cfg := config.Default()
		cfg.SocketDir = cr.Mounts[0].HostPath
		rel, ok := strings.CutPrefix(cr.Envs[contract.EnvSocket], cr.Mounts[0].ContainerPath+"/")
		if host := filepath.Join(cr.Mounts[0].HostPath, rel); !ok || host != cfg.SocketPath() {
			t.Errorf("the pod's socket %s is %s on the host; the agent listens on %s", cr.Envs[contract.EnvSocket], host, cfg.SocketPath())
		}
	}
	if ids, err := e.pool.Allocation(AllocationID(token)); err != nil || !slices.Equal(slices.Sorted(slices.Values(ids)), []string{"gpu0-numa0-0", "gpu0-numa0-1"}) {
		t.Errorf("pool allocation of the token = %v, %v", ids, err)
	}
	// The token opens sessions on exactly its chunks.
	s, err := e.open(token, pool.Spec{GPU: 0, PageSize: 4096, DevicePages: 8})
	if err != nil {
		t.Fatal(err)
	}
	var bound []string
	for _, c := range s.Chunks() {
		bound = append(bound, c.ID)
	}
	if slices.Sort(bound); !slices.Equal(bound, []string{"gpu0-numa0-0", "gpu0-numa0-1"}) {
		t.Errorf("session bound %v", bound)
	}

	before := chunkStates(e.pool)
	beforeRecs := e.p.Allocations()
	cases := []struct {
		name string
		sets [][]string
		code codes.Code
		want string
	}{
		{"unknown", [][]string{{"gpu0-numa0-2", "gpu7-numa0-0"}}, codes.InvalidArgument, "unknown device gpu7-numa0-0"},
		{"unhealthy", [][]string{{"gpu1-numa1-3"}}, codes.FailedPrecondition, "gpu1-numa1-3 is unhealthy"},
		{"duplicate in a container", [][]string{{"gpu0-numa0-2", "gpu0-numa0-2"}}, codes.InvalidArgument, "requested twice"},
		{"duplicate across containers", [][]string{{"gpu0-numa0-2"}, {"gpu0-numa0-2"}}, codes.InvalidArgument, "requested twice"},
		{"empty container", [][]string{{}}, codes.InvalidArgument, "names no devices"},
		{"no containers", nil, codes.InvalidArgument, "no container requests"},
		{"second container bad", [][]string{{"gpu0-numa0-2"}, {"nope"}}, codes.InvalidArgument, "unknown device nope"},
		{"overlaps a live allocation", [][]string{{"gpu0-numa0-1", "gpu0-numa0-2"}}, codes.FailedPrecondition, ""},
	}
	// A pod holds the first allocation, so overlapping it is a conflict.
	e.prs.SetPods(map[string]map[string][]string{"a": {contract.DefaultResourceName: good}})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := e.allocate(c.sets...)
			if status.Code(err) != c.code || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %v containing %q", err, c.code, c.want)
			}
			if got := chunkStates(e.pool); !maps.Equal(got, before) {
				t.Errorf("pool changed: %v, was %v", got, before)
			}
			if got := e.p.Allocations(); !slices.EqualFunc(got, beforeRecs, func(a, b Record) bool { return a.Token == b.Token }) {
				t.Errorf("allocations changed: %v", got)
			}
		})
	}

	// Repeated: the same set (any order) gets the same token, before and
	// after its pod is listed.
	for range 2 {
		if got := e.mustAllocate("gpu0-numa0-0", "gpu0-numa0-1"); got != token {
			t.Errorf("repeated Allocate returned another token")
		}
		e.reconcile()
	}
	// Two containers in one request: two tokens, each bound to its own set.
	resp, err = e.allocate([]string{"gpu1-numa1-0"}, []string{"gpu1-numa1-1", "gpu1-numa1-2"})
	if err != nil {
		t.Fatal(err)
	}
	t1, t2 := resp.ContainerResponses[0].Envs[contract.EnvToken], resp.ContainerResponses[1].Envs[contract.EnvToken]
	if t1 == t2 || t1 == token {
		t.Errorf("tokens not distinct: %s %s %s", token, t1, t2)
	}
	if ids, _ := e.pool.Allocation(AllocationID(t1)); !slices.Equal(ids, []string{"gpu1-numa1-0"}) {
		t.Errorf("first container's token holds %v", ids)
	}
	// A token opens nothing of another allocation: a session asking for more
	// pages than its own chunks hold is refused.
	if _, err := e.open(t1, pool.Spec{GPU: 1, PageSize: 1 << 20, DevicePages: 8, MaxPages: 2}); !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Errorf("open beyond the token's chunks: %v", err)
	}
	if _, err := e.open(contract.NewToken(), pool.Spec{GPU: 1, PageSize: 4096, DevicePages: 8}); !errors.Is(err, contract.ErrUnknownToken) {
		t.Errorf("open with a made-up token: %v", err)
	}
	// Listings of the pool (status, metrics) never show a token.
	for _, c := range e.pool.Chunks() {
		if c.Allocation != "" && (strings.Contains(token+t1+t2, c.Allocation) || strings.Contains(c.Allocation, token[:8])) {
			t.Errorf("chunk %s lists allocation %q, which gives a token away", c.ID, c.Allocation)
		}
	}
}

func TestAllocateRollsBackWhenCheckpointFails(t *testing.T) {
	e := newEnv(t)
	before := chunkStates(e.pool)
	state := filepath.Join(e.root, "state")
	os.RemoveAll(state)
	os.WriteFile(state, []byte("a file where a directory should be"), 0o600)
	_, err := e.allocate([]string{"gpu0-numa0-0"}, []string{"gpu0-numa0-1"})
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "checkpoint") {
		t.Fatalf("err = %v", err)
	}
	if got := chunkStates(e.pool); !maps.Equal(got, before) {
		t.Errorf("pool changed: %v", got)
	}
	if n := len(e.p.Allocations()); n != 0 {
		t.Errorf("%d allocations recorded", n)
	}
}

func TestGetPreferredAllocation(t *testing.T) {
	e := newEnv(t)
	all := make([]string, 0, 8)
	for _, c := range testChunks() {
		all = append(all, c.ID)
	}
	ctx := context.Background()
	ask := func(avail, must []string, size int32) ([]string, error) {
		resp, err := e.kubelet.Client().GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
			ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{AvailableDeviceIDs: avail, MustIncludeDeviceIDs: must, AllocationSize: size}}})
		if err != nil {
			return nil, err
		}
		return resp.ContainerResponses[0].DeviceIDs, nil
	}
	cases := []struct {
		name  string
		avail []string
		must  []string
		size  int32
		want  []string
	}{
		// Kubelet's hint names one node: only its devices are offered.
		{"one node, contiguous", all[:4], nil, 3, []string{"gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-2"}},
		{"the hint's node", all[4:], nil, 2, []string{"gpu1-numa1-0", "gpu1-numa1-1"}},
		// Every node offered (a pod spanning nodes, or no hint): spread.
		{"spread over the nodes", all, nil, 3, []string{"gpu0-numa0-0", "gpu0-numa0-1", "gpu1-numa1-0"}},
		{"the fuller node takes the remainder", []string{"gpu0-numa0-0", "gpu0-numa0-2", "gpu1-numa1-0", "gpu1-numa1-1", "gpu1-numa1-2"}, nil, 3,
			[]string{"gpu0-numa0-0", "gpu1-numa1-0", "gpu1-numa1-1"}},
		{"a short node's part comes from the other", []string{"gpu0-numa0-3", "gpu1-numa1-0", "gpu1-numa1-1", "gpu1-numa1-2", "gpu1-numa1-3"}, nil, 4,
			[]string{"gpu0-numa0-3", "gpu1-numa1-0", "gpu1-numa1-1", "gpu1-numa1-2"}},
		{"contiguous beats first", []string{"gpu0-numa0-0", "gpu0-numa0-2", "gpu0-numa0-3"}, nil, 2, []string{"gpu0-numa0-2", "gpu0-numa0-3"}},
		{"must include pulls its node", all, []string{"gpu1-numa1-2"}, 2, []string{"gpu1-numa1-2", "gpu1-numa1-1"}},
		{"must include, next to it", all, []string{"gpu1-numa1-3"}, 3, []string{"gpu1-numa1-3", "gpu1-numa1-1", "gpu1-numa1-2"}},
		{"must include is everything", all, []string{"gpu0-numa0-3", "gpu1-numa1-0"}, 2, []string{"gpu0-numa0-3", "gpu1-numa1-0"}},
		{"an even spread", all, nil, 6, []string{"gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-2", "gpu1-numa1-0", "gpu1-numa1-1", "gpu1-numa1-2"}},
		{"must include spills to a second node", all, []string{"gpu0-numa0-0"}, 6, []string{"gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-2", "gpu0-numa0-3", "gpu1-numa1-0", "gpu1-numa1-1"}},
		{"devices of no known node only when the known ones lack", []string{"gpu0-numa0-0", "odd-device", "gpu1-numa1-0"}, nil, 3,
			[]string{"gpu0-numa0-0", "gpu1-numa1-0", "odd-device"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ask(c.avail, c.must, c.size)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("got %v, want %v", got, c.want)
			}
		})
	}
	bad := []struct {
		name  string
		avail []string
		must  []string
		size  int32
	}{
		{"zero size", all, nil, 0},
		{"more than available", all[:2], nil, 3},
		{"must not available", all[:2], []string{"gpu1-numa1-0"}, 2},
		{"must exceeds size", all, all[:3], 2},
		{"must repeated", all, []string{all[0], all[0]}, 3},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			if got, err := ask(c.avail, c.must, c.size); status.Code(err) != codes.InvalidArgument {
				t.Errorf("got %v, %v; want InvalidArgument", got, err)
			}
		})
	}
}

func TestReclaimAfterPodGone(t *testing.T) {
	e := newEnv(t)
	ids := []string{"gpu1-numa1-0", "gpu1-numa1-1"}
	token := e.mustAllocate(ids...)
	s, err := e.open(token, pool.Spec{GPU: 1, PageSize: 4096, DevicePages: 4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Offload("r1", "k", []int32{0, 1}, pool.Meta{StoredLen: 2}, nil); err != nil {
		t.Fatal(err)
	}
	// Allocate precedes the pod being listed: nothing happens within the
	// grace period.
	e.clock.Advance(testGrace - time.Second)
	e.reconcile()
	e.prs.SetPods(map[string]map[string][]string{"web-0": {contract.DefaultResourceName: ids, "other.io/x": {"gpu0-numa0-0"}}})
	e.clock.Advance(time.Hour)
	e.reconcile()
	if recs := e.p.Allocations(); len(recs) != 1 || recs[0].Pod != "default/web-0" {
		t.Fatalf("allocations = %+v", recs)
	}
	// The pod goes. During the grace period the chunks stay granted, and
	// stay advertised healthy: kubelet has freed them, and a pod it gives
	// them to is admitted (Allocate reclaims first; see
	// TestAllocateReassignedByKubelet).
	e.prs.SetPods(nil)
	e.reconcile()
	e.clock.Advance(testGrace - time.Second)
	e.reconcile()
	if l, _, _ := e.p.snapshot(); healthOf(l, ids[0]) != pluginapi.Healthy || healthOf(l, ids[1]) != pluginapi.Healthy {
		t.Fatalf("a gone pod's chunks are advertised %s/%s during the grace period, want Healthy", healthOf(l, ids[0]), healthOf(l, ids[1]))
	}
	if _, err := e.pool.Allocation(AllocationID(token)); err != nil || s.Closed() || e.zeroCount(ids[0]) != 0 {
		t.Fatalf("reclaimed during the grace period: %v closed=%v zeroed=%d", err, s.Closed(), e.zeroCount(ids[0]))
	}
	// Grace period over: revoked, sessions closed, zeroed, free again.
	e.clock.Advance(time.Second)
	e.reconcile()
	if _, err := e.pool.Allocation(AllocationID(token)); !errors.Is(err, poolerr.ErrUnknownAllocation) {
		t.Errorf("allocation still in the pool: %v", err)
	}
	if !s.Closed() || s.IsOffloaded("r1") {
		t.Error("session not closed or streams not dropped")
	}
	if _, err := e.p.Authorize(token); !errors.Is(err, contract.ErrUnknownToken) {
		t.Errorf("Authorize of a reclaimed token: %v", err)
	}
	for _, id := range ids {
		if e.zeroCount(id) != 1 {
			t.Errorf("%s zeroed %d times", id, e.zeroCount(id))
		}
		if st := chunkStates(e.pool)[id]; st != "free/" {
			t.Errorf("%s is %s", id, st)
		}
	}
	if n := len(e.p.Allocations()); n != 0 {
		t.Errorf("%d allocations left", n)
	}
	if got, want := e.hookLog(), []string{`reclaimed "default/web-0" [gpu1-numa1-0 gpu1-numa1-1]`}; !slices.Equal(got, want) {
		t.Errorf("hooks told %q, want %q", got, want)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, ids[0]) == pluginapi.Healthy })
	// Another pod can now get the chunks, with a new token.
	if t2 := e.mustAllocate(ids...); t2 == token {
		t.Error("token reused for a new pod")
	}
}

// When the agent stops, kubelet gets an empty device list before the stream
// ends, so the node's capacity drops to zero at once (not after kubelet's
// 5-minute endpoint grace period).
func TestStopWithdrawsDevices(t *testing.T) {
	root := shortDir(t)
	for _, d := range []string{"kubelet/device-plugins", "kubelet/pod-resources", "sock", "state"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e := &env{t: t, root: root, pool: newPool(t), feed: NewFeed(), clock: &fakeClock{now: time.Now()}, zeroed: map[string]int{}}
	if err := e.feed.Set(PoolDevices(e.pool.Chunks())); err != nil {
		t.Fatal(err)
	}
	e.prs = kubelettest.NewPodResources(t, filepath.Join(root, "kubelet/pod-resources/kubelet.sock"))
	e.kubelet = kubelettest.NewKubelet(t, filepath.Join(root, "kubelet/device-plugins"))
	e.p = e.newPlugin(e.pool)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.p.Run(ctx) }()
	e.kubelet.WaitRegister(5 * time.Second)
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return len(l) == len(testChunks()) })
	cancel()
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return len(l) == 0 })
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}

func TestReclaimNeverListedAllocation(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-3")
	e.clock.Advance(testGrace - time.Nanosecond)
	e.reconcile()
	if _, err := e.pool.Allocation(AllocationID(token)); err != nil {
		t.Fatalf("reclaimed within the grace period: %v", err)
	}
	// A failing PodResources reclaims nothing, however late.
	e.prs.SetFail(errBoom)
	e.clock.Advance(time.Hour)
	if err := e.p.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("reconcile with a failing PodResources: %v", err)
	}
	if _, err := e.pool.Allocation(AllocationID(token)); err != nil {
		t.Fatalf("reclaimed on a failed listing: %v", err)
	}
	e.prs.SetFail(nil)
	e.reconcile()
	if _, err := e.pool.Allocation(AllocationID(token)); !errors.Is(err, poolerr.ErrUnknownAllocation) {
		t.Errorf("not reclaimed after the grace period: %v", err)
	}
}

func TestRenewFailureKeepsChunkOut(t *testing.T) {
	e := newEnv(t)
	e.mustAllocate("gpu0-numa0-0")
	tries := 0
	e.zeroFn = func(string) error { tries++; return errBoom }
	e.clock.Advance(testGrace)
	e.reconcile()
	// Retried with backoff: not before RenewRetryFirst, then after it.
	e.reconcile()
	if tries != 1 {
		t.Errorf("renewed %d times before the backoff ended, want 1", tries)
	}
	e.clock.Advance(RenewRetryFirst)
	e.reconcile()
	if tries != 2 {
		t.Errorf("renewed %d times after the first backoff, want 2", tries)
	}
	e.clock.Advance(RenewRetryFirst)
	e.reconcile()
	if tries != 2 {
		t.Errorf("renewed %d times before the doubled backoff ended, want 2", tries)
	}
	if st := chunkStates(e.pool)["gpu0-numa0-0"]; st != "dirty/" {
		t.Fatalf("chunk is %s, want dirty", st)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, "gpu0-numa0-0") == pluginapi.Unhealthy })
	if _, err := e.allocate([]string{"gpu0-numa0-0"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("allocate of a dirty chunk: %v", err)
	}
	e.mu.Lock()
	e.zeroFn = nil
	e.mu.Unlock()
	e.clock.Advance(RenewRetryFirst)
	e.reconcile()
	if st := chunkStates(e.pool)["gpu0-numa0-0"]; st != "free/" {
		t.Fatalf("chunk is %s after a successful retry", st)
	}
	// One report per change: reclaimed, unhealthy once (however many
	// retries fail), healthy again.
	want := []string{`reclaimed "" [gpu0-numa0-0]`, "gpu0-numa0-0 healthy=false renewing failed: boom", "gpu0-numa0-0 healthy=true "}
	if got := e.hookLog(); !slices.Equal(got, want) {
		t.Errorf("hooks told %q, want %q", got, want)
	}
	e.kubelet.WaitList(func(l []*pluginapi.Device) bool { return healthOf(l, "gpu0-numa0-0") == pluginapi.Healthy })
}

// Kubelet gives a gone pod's chunks to a new pod before the grace period
// ends: kubelet is authoritative, the old allocation is reclaimed at once.
func TestAllocateReassignedByKubelet(t *testing.T) {
	e := newEnv(t)
	old := e.mustAllocate("gpu0-numa0-0", "gpu0-numa0-1")
	e.prs.SetPods(map[string]map[string][]string{"a": {contract.DefaultResourceName: {"gpu0-numa0-0", "gpu0-numa0-1"}}})
	e.reconcile()
	e.prs.SetPods(nil) // pod a is gone
	// The same set to a new pod: a new token, the old one dead, chunks zeroed.
	same := e.mustAllocate("gpu0-numa0-1", "gpu0-numa0-0")
	if same == old {
		t.Fatal("a new pod got the gone pod's token")
	}
	if _, err := e.pool.Allocation(AllocationID(old)); !errors.Is(err, poolerr.ErrUnknownAllocation) || e.zeroCount("gpu0-numa0-0") != 1 {
		t.Errorf("old allocation: %v, zeroed %d", err, e.zeroCount("gpu0-numa0-0"))
	}
	// An overlapping set while the holder is unlisted: reclaimed likewise.
	over := e.mustAllocate("gpu0-numa0-1", "gpu0-numa0-2")
	if _, err := e.pool.Allocation(AllocationID(same)); !errors.Is(err, poolerr.ErrUnknownAllocation) {
		t.Errorf("overlapped allocation still present: %v", err)
	}
	if ids, _ := e.pool.Allocation(AllocationID(over)); len(ids) != 2 {
		t.Errorf("new allocation holds %v", ids)
	}
}

func TestRestartRecoversFromCheckpoint(t *testing.T) {
	e := newEnv(t)
	t1 := e.mustAllocate("gpu0-numa0-0", "gpu0-numa0-1")
	t2 := e.mustAllocate("gpu1-numa1-3")
	e.prs.SetPods(map[string]map[string][]string{"a": {contract.DefaultResourceName: {"gpu0-numa0-0", "gpu0-numa0-1"}}})
	e.reconcile()

	// The agent restarts: a fresh pool whose chunks become ready later.
	fresh := pool.New()
	p2 := e.newPlugin(fresh)
	recs := p2.Allocations()
	if len(recs) != 2 || recs[0].Token != t1 || recs[0].Pod != "default/a" || recs[1].Token != t2 || recs[1].Pod != "" {
		t.Fatalf("restored %+v", recs)
	}
	for _, c := range testChunks() {
		fresh.AddChunk(c)
	}
	p2.o.Holders = dialTestPodResources(t, e.root)
	if err := p2.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ids, err := fresh.Allocation(AllocationID(t1)); err != nil || len(ids) != 2 {
		t.Errorf("restored grant: %v, %v", ids, err)
	}
	if id, err := p2.Authorize(t1); err != nil || id != AllocationID(t1) {
		t.Errorf("Authorize of a restored token: %q, %v", id, err)
	}
	// Allocate of a restored set returns its token.
	resp, err := p2.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"gpu1-numa1-3"}}}})
	if err != nil || resp.ContainerResponses[0].Envs[contract.EnvToken] != t2 {
		t.Errorf("allocate of a restored set: %v", err)
	}
	// The grace period restarts with the agent: t2 was never listed, and is
	// reclaimed only a full grace period after the restart.
	e.clock.Advance(testGrace)
	if err := p2.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := fresh.Allocation(AllocationID(t2)); !errors.Is(err, poolerr.ErrUnknownAllocation) {
		t.Errorf("t2 not reclaimed: %v", err)
	}
	if _, err := fresh.Allocation(AllocationID(t1)); err != nil {
		t.Errorf("t1 reclaimed while its pod is listed: %v", err)
	}
}

// A restored allocation whose chunks never become ready (the pool shrank)
// is dropped after the grace period without zeroing chunks that do not
// exist.
func TestRestoredAllocationWithoutChunks(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu1-numa1-3")
	p2 := e.newPlugin(pool.New()) // the new pool never gets gpu1-numa1-3
	p2.o.Holders = dialTestPodResources(t, e.root)
	e.clock.Advance(testGrace)
	if err := p2.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if recs := p2.Allocations(); len(recs) != 0 {
		t.Errorf("allocation %s kept: %+v", token, recs)
	}
	if e.zeroCount("gpu1-numa1-3") != 0 || len(p2.Dirty()) != 0 {
		t.Errorf("zeroed %d times, dirty %v", e.zeroCount("gpu1-numa1-3"), p2.Dirty())
	}
}

func dialTestPodResources(t *testing.T, root string) Holders {
	c, err := DialPodResources(filepath.Join(root, "kubelet/pod-resources/kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestCorruptCheckpointStartsEmpty(t *testing.T) {
	e := newEnv(t)
	e.mustAllocate("gpu0-numa0-0")
	path := filepath.Join(e.root, "state", CheckpointFile)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Flip one byte inside the records: the checksum catches it.
	i := strings.Index(string(data), "gpu0-numa0-0")
	data[i+3] = '1'
	os.WriteFile(path, data, 0o600)
	if _, err := LoadCheckpoint(filepath.Join(e.root, "state")); !errors.Is(err, ErrCorruptCheckpoint) {
		t.Fatalf("load: %v", err)
	}
	fresh := newPool(t)
	p2 := e.newPlugin(fresh)
	if n := len(p2.Allocations()); n != 0 {
		t.Errorf("%d allocations from a corrupt checkpoint", n)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("corrupt checkpoint still in place: %v", err)
	}
	moved, _ := filepath.Glob(path + ".corrupt-*")
	if len(moved) != 1 {
		t.Errorf("quarantined copies: %v", moved)
	}
	for id, st := range chunkStates(fresh) {
		if st != "free/" {
			t.Errorf("%s is %s", id, st)
		}
	}
}

func TestOptionsErrors(t *testing.T) {
	dir := t.TempDir()
	ok := Options{Pool: pool.New(), Devices: NewFeed(), Renew: func(string) error { return nil },
		KubeletDir: dir, SocketDir: "/run/kvp", StateDir: dir, Interval: time.Hour}
	cases := []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"no pool", func(o *Options) { o.Pool = nil }, "need Pool"},
		{"no renew", func(o *Options) { o.Renew = nil }, "need Pool"},
		// The resource name is checked by contract.CheckResourceName, as
		// the configuration checks it.
		{"no domain", func(o *Options) { o.ResourceName = "host-kv" }, `resource name "host-kv" is not of the form domain/name`},
		{"kubernetes domain", func(o *Options) { o.ResourceName = "kubernetes.io/kv" }, "reserved for Kubernetes"},
		{"bad char", func(o *Options) { o.ResourceName = "kvpool.io/host kv" }, `name "host kv" must be`},
		{"unqualified domain", func(o *Options) { o.ResourceName = "kvpool/kv" }, "not fully qualified"},
		{"relative socket dir", func(o *Options) { o.SocketDir = "sock" }, "not absolute"},
		// The directories and periods come from the configuration, the one
		// place their defaults are written.
		{"no kubelet dir", func(o *Options) { o.KubeletDir = "" }, "need KubeletDir, SocketDir and StateDir"},
		{"no socket dir", func(o *Options) { o.SocketDir = "" }, "need KubeletDir, SocketDir and StateDir"},
		{"no state dir", func(o *Options) { o.StateDir = "" }, "need KubeletDir, SocketDir and StateDir"},
		{"pod binding without pod logs", func(o *Options) { o.BindPods = true }, "BindPods needs PodLogsDir"},
		{"negative grace", func(o *Options) { o.GracePeriod = -time.Second }, "grace period -1s is negative"},
		{"no interval", func(o *Options) { o.Interval = 0 }, "reconcile interval 0s is not positive"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := ok
			c.edit(&o)
			if _, err := New(o); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("err = %v, want %q", err, c.want)
			}
		})
	}
	if _, err := New(ok); err != nil {
		t.Errorf("valid options: %v", err)
	}
}

// Concurrent Allocates of one set agree on one token; disjoint sets get
// their own; reconciles run alongside (go test -race).
func TestConcurrentAllocate(t *testing.T) {
	e := newEnv(t)
	const n = 8
	tokens := make(chan string, 2*n)
	errs := make(chan error, 3*n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(3)
		go func() {
			defer wg.Done()
			resp, err := e.allocate([]string{"gpu0-numa0-0", "gpu0-numa0-1"})
			if err != nil {
				errs <- err
				return
			}
			tokens <- resp.ContainerResponses[0].Envs[contract.EnvToken]
		}()
		go func() {
			defer wg.Done()
			if _, err := e.allocate([]string{contract.ChunkID(1, 1, i%4)}); err != nil {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			errs <- e.p.Reconcile(context.Background())
		}()
	}
	wg.Wait()
	close(tokens)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	first := <-tokens
	for tok := range tokens {
		if tok != first {
			t.Fatal("concurrent Allocates of one set returned different tokens")
		}
	}
	if recs := e.p.Allocations(); len(recs) != 5 {
		t.Errorf("%d allocations, want 5", len(recs))
	}
}

// A repeated Allocate (kubelet still admitting the pod) restarts the grace
// period of an allocation no pod has held yet.
func TestRepeatedAllocateRefreshesGrace(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-2")
	e.clock.Advance(testGrace - time.Second)
	if again := e.mustAllocate("gpu0-numa0-2"); again != token {
		t.Fatal("repeated Allocate returned another token")
	}
	e.clock.Advance(2 * time.Second)
	e.reconcile()
	if _, err := e.p.Authorize(token); err != nil {
		t.Fatalf("reclaimed although Allocate was repeated within the grace period: %v", err)
	}
	e.clock.Advance(testGrace)
	e.reconcile()
	if _, err := e.p.Authorize(token); !errors.Is(err, contract.ErrUnknownToken) {
		t.Errorf("not reclaimed a grace period after the last Allocate: %v", err)
	}
}

// A restored allocation is usable the moment its chunks are, not at the
// next reconcile; before that its token gets "not ready, retry", never
// "unknown".
func TestRestoredAllocationUsableWhenChunksJoin(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-0", "gpu0-numa0-1")
	fresh := pool.New()
	p2 := e.newPlugin(fresh)
	if _, err := p2.Authorize(token); !errors.Is(err, poolerr.ErrNotReady) {
		t.Fatalf("Authorize before the chunks are ready: %v, want ErrNotReady", err)
	}
	if _, err := p2.Authorize("not-a-token"); !errors.Is(err, contract.ErrUnknownToken) || errors.Is(err, poolerr.ErrNotReady) {
		t.Fatalf("Authorize of an unknown token: %v", err)
	}
	for _, c := range testChunks() {
		if err := fresh.AddChunk(c); err != nil {
			t.Fatal(err)
		}
		p2.GrantPending()
	}
	if id, err := p2.Authorize(token); err != nil || id != AllocationID(token) {
		t.Fatalf("Authorize once the chunks joined: %q, %v", id, err)
	}
	if ids, err := fresh.Allocation(AllocationID(token)); err != nil || len(ids) != 2 {
		t.Fatalf("grant: %v, %v", ids, err)
	}
}
