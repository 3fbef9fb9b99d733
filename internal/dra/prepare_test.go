package dra

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/utils/ptr"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

const (
	node    = "node-a"
	uid1    = "11111111-2222-4333-8444-555555555555"
	uid2    = "22222222-3333-4444-8555-666666666666"
	podUID  = "3f2b1c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
	chunkSz = 8 << 20
)

// chunkSource is a Source over a fixed list, which tests change.
type chunkSource struct {
	mu      sync.Mutex
	chunks  []Chunk
	changed chan struct{}
}

func newChunkSource(chunks []Chunk) *chunkSource {
	return &chunkSource{chunks: chunks, changed: make(chan struct{})}
}

func (s *chunkSource) Chunks() ([]Chunk, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.chunks), s.changed
}

func (s *chunkSource) set(chunks []Chunk) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.chunks = chunks
	close(s.changed)
	s.changed = make(chan struct{})
}

// testChunks: 2 GPUs, 4 chunks of 8 MiB each.
func testChunks() []Chunk {
	var out []Chunk
	for g := range 2 {
		for i := range 4 {
			out = append(out, Chunk{ID: contract.ChunkID(g, 0, i), GPU: g, NUMA: 0, Size: chunkSz, PageSize: 4096})
		}
	}
	return out
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// env is a Driver over a real ledger (plugin.Plugin, its checkpoint in a
// state directory) and a real pool, without kubelet.
type env struct {
	t        *testing.T
	root     string
	pool     *pool.Pool
	feed     *plugin.Feed
	chunks   *chunkSource
	p        *plugin.Plugin
	d        *Driver
	obs      observe.Recorder
	renewed  map[string]int
	renewMu  sync.Mutex
	cancelBG context.CancelFunc
}

func newEnv(t *testing.T) *env {
	e := &env{t: t, root: t.TempDir(), renewed: map[string]int{}}
	e.pool = pool.New()
	e.chunks = newChunkSource(testChunks())
	for _, c := range testChunks() {
		if err := e.pool.AddChunk(pool.Chunk{ID: c.ID, GPU: c.GPU, NUMA: c.NUMA, Size: c.Size}); err != nil {
			t.Fatal(err)
		}
	}
	e.feed = plugin.NewFeed()
	if err := e.feed.Set(plugin.PoolDevices(e.pool.Chunks())); err != nil {
		t.Fatal(err)
	}
	e.restart()
	return e
}

// restart builds the ledger and the driver again on the same state and CDI
// directories, as a restarted agent does.
func (e *env) restart() {
	e.t.Helper()
	if e.cancelBG != nil {
		e.cancelBG()
	}
	p, err := plugin.New(plugin.Options{
		KubeletDir: filepath.Join(e.root, "kubelet"), SocketDir: "/run/kvpool-test", StateDir: filepath.Join(e.root, "state"),
		Pool: e.pool, Devices: e.feed, Renew: e.renew, Holders: noHolders{},
		Interval: time.Hour, Logger: quiet(),
	})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Maintain(ctx) }()
	e.cancelBG = func() { cancel(); <-done }
	e.t.Cleanup(e.cancelBG)
	e.p = p
	d, err := New(Options{DriverName: DefaultDriverName, NodeName: node, KubeletDir: filepath.Join(e.root, "kubelet"),
		CDIDir: filepath.Join(e.root, "cdi"), SocketDir: "/run/kvpool-test", GPUs: testGPUs(),
		Ledger: p, Chunks: e.chunks, Observer: &e.obs, Logger: quiet()})
	if err != nil {
		e.t.Fatal(err)
	}
	e.d = d
}

func (e *env) renew(id string) error {
	e.renewMu.Lock()
	defer e.renewMu.Unlock()
	e.renewed[id]++
	return nil
}

type noHolders struct{}

func (noHolders) Held(context.Context, string) (map[string]string, error) { return nil, nil }

func testGPUs() []GPU {
	return []GPU{{Index: 0, UUID: "GPU-sim-00000000", PCIeRoot: "pci0000:10"}, {Index: 1, UUID: "GPU-sim-00000001", PCIeRoot: "pci0000:10"}}
}

// result is an allocation result of this driver.
func result(request, device string) resourceapi.DeviceRequestAllocationResult {
	return resourceapi.DeviceRequestAllocationResult{Request: request, Driver: DefaultDriverName, Pool: node, Device: device}
}

func shareResult(request string, gpu int, bytes int64) resourceapi.DeviceRequestAllocationResult {
	r := result(request, ShareDevice(gpu))
	r.ShareID = ptr.To(types.UID("aaaaaaaa-0000-4000-8000-000000000001"))
	r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{CapMemory: *resource.NewQuantity(bytes, resource.BinarySI)}
	return r
}

func claimWith(uid string, results ...resourceapi.DeviceRequestAllocationResult) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "claim-" + uid[:4], UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{
			Allocation:  &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: results}},
			ReservedFor: []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p", UID: types.UID(podUID)}},
		},
	}
}

func (e *env) prepare(claims ...*resourceapi.ResourceClaim) map[types.UID]kubeletplugin.PrepareResult {
	e.t.Helper()
	out, err := e.d.PrepareResourceClaims(context.Background(), claims)
	if err != nil {
		e.t.Fatal(err)
	}
	if len(out) != len(claims) {
		e.t.Fatalf("%d results for %d claims", len(out), len(claims))
	}
	return out
}

func (e *env) spec(uid string) *cdispec.Spec {
	e.t.Helper()
	data, err := os.ReadFile(filepath.Join(e.root, "cdi", DefaultDriverName+"_"+uid+".json"))
	if err != nil {
		e.t.Fatal(err)
	}
	var s cdispec.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		e.t.Fatal(err)
	}
	return &s
}

func (e *env) specExists(uid string) bool {
	_, err := os.Stat(filepath.Join(e.root, "cdi", DefaultDriverName+"_"+uid+".json"))
	return err == nil
}

// tokenOf is the KVPOOL_TOKEN the spec's device gives.
func tokenOf(t *testing.T, s *cdispec.Spec, device string) string {
	t.Helper()
	for _, d := range s.Devices {
		if d.Name != device {
			continue
		}
		for _, kv := range d.ContainerEdits.Env {
			if v, ok := strings.CutPrefix(kv, contract.EnvToken+"="); ok {
				return v
			}
		}
	}
	t.Fatalf("spec has no device %s with a token: %+v", device, s.Devices)
	return ""
}

// A claim's chunk devices and share are granted; the CDI spec names the
// claim's UID and gives each request's containers the socket directory,
// KVPOOL_SOCKET and that request's token; a repeated Prepare answers the
// same; Unprepare revokes, removes the spec, and the chunks renew.
func TestPrepareUnprepare(t *testing.T) {
	e := newEnv(t)
	c := claimWith(uid1, result("chunks", "gpu0-numa0-0"), result("chunks", "gpu0-numa0-1"), shareResult("bytes", 1, 3*chunkSz))
	res := e.prepare(c)[c.UID]
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if len(res.Devices) != 3 {
		t.Fatalf("devices %+v", res.Devices)
	}
	chunkCDI := DefaultDriverName + "/" + CDIClass + "=" + uid1 + "-chunks"
	bytesCDI := DefaultDriverName + "/" + CDIClass + "=" + uid1 + "-bytes"
	for i, want := range []kubeletplugin.Device{
		{Requests: []string{"chunks"}, PoolName: node, DeviceName: "gpu0-numa0-0", CDIDeviceIDs: []string{chunkCDI}},
		{Requests: []string{"chunks"}, PoolName: node, DeviceName: "gpu0-numa0-1", CDIDeviceIDs: []string{chunkCDI}},
		{Requests: []string{"bytes"}, PoolName: node, DeviceName: "gpu1-share", CDIDeviceIDs: []string{bytesCDI}},
	} {
		got := res.Devices[i]
		if !slices.Equal(got.Requests, want.Requests) || got.PoolName != want.PoolName || got.DeviceName != want.DeviceName ||
			!slices.Equal(got.CDIDeviceIDs, want.CDIDeviceIDs) {
			t.Errorf("device %d = %+v, want %+v", i, got, want)
		}
	}
	if res.Devices[2].ShareID == nil || *res.Devices[2].ShareID != "aaaaaaaa-0000-4000-8000-000000000001" {
		t.Errorf("share device's share ID %v", res.Devices[2].ShareID)
	}
	s := e.spec(uid1)
	if s.Kind != "kvpool.io/host-kv" || len(s.Devices) != 2 {
		t.Fatalf("spec %+v", s)
	}
	for _, d := range s.Devices {
		m := d.ContainerEdits.Mounts
		if len(m) != 1 || m[0].HostPath != "/run/kvpool-test" || m[0].ContainerPath != contract.ContainerSocketDir || !slices.Contains(m[0].Options, "ro") {
			t.Errorf("device %s mounts %+v", d.Name, m)
		}
		if !slices.Contains(d.ContainerEdits.Env, contract.EnvSocket+"="+contract.ContainerSocket) {
			t.Errorf("device %s env %v", d.Name, d.ContainerEdits.Env)
		}
	}
	if fi, err := os.Stat(filepath.Join(e.root, "cdi", DefaultDriverName+"_"+uid1+".json")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("spec file mode: %v, %v", fi.Mode(), err)
	}
	chunkTok, bytesTok := tokenOf(t, s, uid1+"-chunks"), tokenOf(t, s, uid1+"-bytes")
	for tok, want := range map[string][]string{
		chunkTok: {"gpu0-numa0-0", "gpu0-numa0-1"},
		bytesTok: {"gpu1-numa0-0", "gpu1-numa0-1", "gpu1-numa0-2"},
	} {
		alloc, err := e.p.Authorize(tok)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, ch := range e.pool.Chunks() {
			if ch.Allocation == alloc {
				got = append(got, ch.ID)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("token's chunks %v, want %v", got, want)
		}
	}

	// kubelet retries: the same answer, the same tokens.
	again := e.prepare(c)[c.UID]
	if again.Err != nil || tokenOf(t, e.spec(uid1), uid1+"-bytes") != bytesTok || len(again.Devices) != 3 {
		t.Fatalf("repeated Prepare: %+v", again)
	}

	// Unprepare by UID only.
	out, err := e.d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: types.UID(uid1)}})
	if err != nil || out[types.UID(uid1)] != nil {
		t.Fatalf("Unprepare: %v, %v", out, err)
	}
	if e.specExists(uid1) {
		t.Error("CDI spec left after Unprepare")
	}
	if _, err := e.p.Authorize(chunkTok); !errors.Is(err, contract.ErrUnknownToken) {
		t.Errorf("token after Unprepare: %v", err)
	}
	waitFor(t, "the chunks renewed", func() bool {
		held, _ := e.p.ChunkHolders()
		e.renewMu.Lock()
		defer e.renewMu.Unlock()
		return len(held) == 0 && e.renewed["gpu1-numa0-2"] == 1 && e.renewed["gpu0-numa0-0"] == 1
	})
	// Repeated, and for a claim never prepared: no error.
	out, err = e.d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: types.UID(uid1)}, {UID: types.UID(uid2)}})
	if err != nil || out[types.UID(uid1)] != nil || out[types.UID(uid2)] != nil {
		t.Errorf("repeated Unprepare: %v, %v", out, err)
	}
	ops := map[string]int{}
	for _, op := range e.obs.Ops() {
		if op.Component == observe.ComponentDRA {
			ops[op.Name+"/"+map[bool]string{true: "ok", false: "error"}[op.Err == nil]]++
		}
	}
	if ops["prepare/ok"] != 2 || ops["unprepare/ok"] != 3 {
		t.Errorf("reported %v", ops)
	}
}

// Every claim that cannot be prepared gets its own error with a reason,
// and nothing changes; the other claims of the call are prepared.
func TestPrepareRefusals(t *testing.T) {
	e := newEnv(t)
	// GPU 1's chunks: 3 of 4 to a first claim.
	first := claimWith(uid2, shareResult("kv", 1, 3*chunkSz))
	if r := e.prepare(first)[first.UID]; r.Err != nil {
		t.Fatal(r.Err)
	}
	unallocated := claimWith(uid1)
	unallocated.Status.Allocation = nil
	other := claimWith(uid1, resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: "gpu.nvidia.com", Pool: node, Device: "gpu-0"})
	admin := claimWith(uid1, result("kv", "gpu0-numa0-0"))
	admin.Status.Allocation.Devices.Results[0].AdminAccess = ptr.To(true)
	for _, c := range []struct {
		name  string
		claim *resourceapi.ResourceClaim
		msg   string
	}{
		{"not allocated", unallocated, "not allocated"},
		{"another driver's devices only", other, "no device of driver kvpool.io"},
		{"another node's pool", claimWith(uid1, resourceapi.DeviceRequestAllocationResult{Request: "kv", Driver: DefaultDriverName, Pool: "node-b", Device: "gpu0-numa0-0"}), `pool "node-b", not this node's`},
		{"admin access", admin, "admin access"},
		{"unknown chunk", claimWith(uid1, result("kv", "gpu9-numa0-0")), "not a ready chunk"},
		{"share without share ID", claimWith(uid1, func() resourceapi.DeviceRequestAllocationResult {
			r := shareResult("kv", 0, chunkSz)
			r.ShareID = nil
			return r
		}()), "without a share ID"},
		{"share of part of a chunk", claimWith(uid1, shareResult("kv", 0, chunkSz+1)), "not a positive multiple of the chunk size"},
		{"share of a GPU without chunks", claimWith(uid1, shareResult("kv", 7, chunkSz)), "its GPU has no ready chunk"},
		{"capacity exhausted", claimWith(uid1, shareResult("kv", 1, 2*chunkSz)), "GPU 1 has 1 free chunks, the share needs 2"},
		{"chunk of another claim", claimWith(uid1, result("kv", "gpu1-numa0-0")), "held by ResourceClaim ns/claim-2222"},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := e.p.Allocations()
			r := e.prepare(c.claim)[c.claim.UID]
			if r.Err == nil || !strings.Contains(r.Err.Error(), c.msg) {
				t.Fatalf("Prepare = %+v; want an error mentioning %q", r, c.msg)
			}
			if e.specExists(uid1) {
				t.Error("a CDI spec was written for a refused claim")
			}
			if got := e.p.Allocations(); len(got) != len(before) {
				t.Errorf("allocations changed: %d, were %d", len(got), len(before))
			}
		})
	}
	// A refused claim in the same call as a good one: only it fails.
	good := claimWith(uid1, result("kv", "gpu0-numa0-3"))
	bad := claimWith("33333333-4444-4555-8666-777777777777", result("kv", "gpu9-numa0-0"))
	out := e.prepare(good, bad)
	if out[good.UID].Err != nil || out[bad.UID].Err == nil {
		t.Errorf("mixed call: good %v, bad %v", out[good.UID].Err, out[bad.UID].Err)
	}
	// Unprepare of a malformed UID touches no file.
	res, err := e.d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "../../etc/passwd"}})
	if err != nil || res["../../etc/passwd"] == nil {
		t.Errorf("Unprepare of a malformed UID: %v, %v", res, err)
	}
}

// A restarted agent (a new ledger and driver on the same checkpoint and
// CDI directory) answers a repeated Prepare with the same token, removes
// the specs of claims no longer prepared, and unprepares a claim prepared
// before the restart.
func TestPrepareAcrossRestart(t *testing.T) {
	e := newEnv(t)
	c := claimWith(uid1, shareResult("kv", 0, 2*chunkSz))
	if r := e.prepare(c)[c.UID]; r.Err != nil {
		t.Fatal(r.Err)
	}
	tok := tokenOf(t, e.spec(uid1), uid1+"-kv")
	// A spec the last agent left for a claim it no longer holds.
	stale := filepath.Join(e.root, "cdi", DefaultDriverName+"_"+uid2+".json")
	if err := os.WriteFile(stale, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	foreign := filepath.Join(e.root, "cdi", "vendor.com_"+uid2+".json")
	if err := os.WriteFile(foreign, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	e.restart()
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale spec kept: %v", err)
	}
	if _, err := os.Stat(foreign); err != nil {
		t.Errorf("another driver's spec touched: %v", err)
	}
	if r := e.prepare(c)[c.UID]; r.Err != nil || tokenOf(t, e.spec(uid1), uid1+"-kv") != tok {
		t.Fatalf("Prepare after the restart: %+v", r)
	}
	if _, err := e.d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: types.UID(uid1)}}); err != nil {
		t.Fatal(err)
	}
	if e.specExists(uid1) || len(e.p.Claims()) != 0 {
		t.Errorf("after Unprepare: spec %v, claims %v", e.specExists(uid1), e.p.Claims())
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
