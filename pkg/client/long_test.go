package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	stdsync "sync"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/standalone"
	"github.com/kvpool/kvpool/pkg/wire"
)

func serveAgent(t testing.TB, c standalone.Config) *standalone.Agent {
	t.Helper()
	if c.Socket == "" {
		c.Socket = filepath.Join(t.TempDir(), "kv.sock")
	}
	if c.Logger == nil {
		c.Logger = quiet
	}
	a, err := standalone.Start(c)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		a.Close()
	})
	return a
}

// page is a small device KV cache of one region, bytes per page each.
type page struct {
	dev  cudart.Device
	base cudart.DevicePtr
	n    int
	size uint64
}

func newPages(t testing.TB, dev cudart.Device, n int, size uint64) *page {
	t.Helper()
	base, err := dev.MemAlloc(uint64(n) * size)
	if err != nil {
		t.Fatal(err)
	}
	return &page{dev: dev, base: base, n: n, size: size}
}

func (p *page) regions() []cudart.Region {
	return []cudart.Region{{Base: p.base, Stride: p.size, PageBytes: p.size, Pages: p.n}}
}

// stamp fills device page i with bytes derived from i and salt.
func stampOf(i int32, salt byte, size uint64) []byte {
	b := make([]byte, size)
	for j := range b {
		b[j] = byte(uint32(i)>>(8*(j%4))) ^ byte(j) ^ salt
	}
	return b
}

func (p *page) writeAll(t testing.TB, salt byte) {
	t.Helper()
	all := make([]byte, 0, uint64(p.n)*p.size)
	for i := range p.n {
		all = append(all, stampOf(int32(i), salt, p.size)...)
	}
	if err := p.dev.MemcpyHtoD(p.base, all); err != nil {
		t.Fatal(err)
	}
}

func (p *page) readAll(t testing.TB) []byte {
	t.Helper()
	all := make([]byte, uint64(p.n)*p.size)
	if err := p.dev.MemcpyDtoH(all, p.base); err != nil {
		t.Fatal(err)
	}
	return all
}

// TestLongStream offloads and reloads a stream of 1,000,000 pages in a
// session of more than 2^21 host pages (256-byte pages in 64 MiB memfd
// chunks): every page list crosses many packets, host page numbers pass
// 2^14 and 2^21 (3 and 4 bytes on the wire), and the bytes come back
// exact. Before protocol version 2 an offload of ~43,700 pages failed after
// the pool had recorded it.
func TestLongStream(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 1,000,000 pages; skipped in -short")
	}
	const (
		psize  = 256
		filler = 1_200_000
		n      = 1_000_000
	)
	a := serveAgent(t, standalone.Config{GPUs: 1, ChunksPerGPU: 9, ChunkBytes: 64 << 20, Tokens: []string{"tok"}})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, MemoryBytes: filler*psize + 1<<20})
	dev, _ := sim.Open(0)
	kv := newPages(t, dev, filler, psize)
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-long"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, capacity, _ := p.Session(); capacity < 1<<21+n/10 {
		t.Fatalf("capacity %d", capacity)
	}
	kv.writeAll(t, 0x5a)
	all := make([]int32, filler)
	for i := range all {
		all[i] = int32(i)
	}
	// The filler takes host pages [0, 1.2M): the long stream then spans
	// 2^21.
	if ok, err := p.OffloadStream("filler", "kv", all, 1, 1, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	src := slices.Clone(all[:n])
	rng.Shuffle(len(src), func(i, j int) { src[i], src[j] = src[j], src[i] })
	if ok, err := p.OffloadStream("long", "kv", src, n*16, n*16+3, 7); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if np, err := p.NumPages("long", "kv"); np != n || err != nil {
		t.Fatalf("num_pages %d, %v", np, err)
	}
	sync(t, p, dev)
	if err := dev.MemcpyHtoD(kv.base, make([]byte, filler*psize)); err != nil { // poison
		t.Fatal(err)
	}
	dst := slices.Clone(all[filler-n:])
	rng.Shuffle(len(dst), func(i, j int) { dst[i], dst[j] = dst[j], dst[i] })
	got, err := p.ReloadStream("long", "kv", dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.CPUPageIndices) != n || got.StoredLen != n*16 || got.Position != n*16+3 || got.Released != 7 {
		t.Fatalf("reload: %d pages, %+v", len(got.CPUPageIndices), got.StoredLen)
	}
	maxHost := slices.Max(got.CPUPageIndices)
	if maxHost < 1<<21 {
		t.Fatalf("highest host page %d: the stream did not cross 2^21", maxHost)
	}
	sync(t, p, dev)
	mem := kv.readAll(t)
	for i, d := range dst {
		if want := stampOf(src[i], 0x5a, psize); !bytes.Equal(mem[uint64(d)*psize:uint64(d+1)*psize], want) {
			t.Fatalf("device page %d (offloaded from %d) has the wrong bytes", d, src[i])
		}
	}
	if ok, _ := p.IsOffloaded("long"); ok {
		t.Fatal("the reloaded stream is still there")
	}
	if err := p.Synchronize(); err != nil {
		t.Fatal(err)
	}
	u, err := p.Usage()
	if err != nil || u.Used != filler || u.Pending != 0 {
		t.Fatalf("usage %+v, %v", u, err)
	}
}

// TestPacketEdges offloads and reloads streams of every length around the
// packet limit, with host page numbers around 2^14, through the real
// server, and checks bytes and page lists.
func TestPacketEdges(t *testing.T) {
	const psize = 256
	m := wire.MaxPagesPerPacket
	counts := []int{m - 1, m, m + 1, 2*m - 1, 2 * m, 2*m + 1}
	if testing.Short() {
		counts = []int{m, m + 1}
	}
	a := serveAgent(t, standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 32 << 20, Tokens: []string{"tok"}})
	dp := 2*m + 1 + 1<<14
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, MemoryBytes: uint64(dp)*psize + 1<<20})
	dev, _ := sim.Open(0)
	kv := newPages(t, dev, dp, psize)
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-edges"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// Hold host pages [0, 2^14 - 3) so that the streams start just below
	// the 3-byte boundary.
	hold := make([]int32, 1<<14-3)
	for i := range hold {
		hold[i] = int32(dp - 1 - i)
	}
	if ok, err := p.OffloadStream("hold", "", hold, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	for _, n := range counts {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			kv.writeAll(t, byte(n))
			src := make([]int32, n)
			for i := range src {
				src[i] = int32(i)
			}
			if ok, err := p.OffloadStream("edge", "kv", src, int64(n), 0, 0); !ok || err != nil {
				t.Fatal(ok, err)
			}
			dst := make([]int32, n)
			for i := range dst {
				dst[i] = int32(n - 1 - i)
			}
			sync(t, p, dev)
			got, err := p.ReloadStream("edge", "kv", dst)
			if err != nil {
				t.Fatal(err)
			}
			if len(got.CPUPageIndices) != n || got.CPUPageIndices[0] != 1<<14-3 || got.StoredLen != int64(n) {
				t.Fatalf("reload: %d pages from %d", len(got.CPUPageIndices), got.CPUPageIndices[0])
			}
			if err := p.Synchronize(); err != nil {
				t.Fatal(err)
			}
			mem := kv.readAll(t)
			for i, d := range dst {
				if !bytes.Equal(mem[uint64(d)*psize:uint64(d+1)*psize], stampOf(src[i], byte(n), psize)) {
					t.Fatalf("device page %d has the wrong bytes", d)
				}
			}
		})
	}
}

// TestLongLabels: labels() of 140 labels of about 1 KB (some 140 KB, more
// than a packet) arrives whole and in offload order.
func TestLongLabels(t *testing.T) {
	a := serveAgent(t, standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 1 << 20, Tokens: []string{"tok"}})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	kv := newPages(t, dev, 8, 4096)
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-labels"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var want []string
	for i := range 140 {
		l := fmt.Sprintf("%04d-%s", 139-i, strings.Repeat("x", 1000))
		if ok, err := p.OffloadStream("r", l, []int32{int32(i % 8)}, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
		want = append(want, l)
		if i%50 == 0 {
			sync(t, p, dev)
		}
	}
	got, err := p.Labels("r")
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("labels: %d of %d, %v", len(got), len(want), err)
	}
	// The long reply's rest is gone once another request comes: asking
	// again starts afresh and still arrives whole.
	if _, err := p.IsOffloaded("r"); err != nil {
		t.Fatal(err)
	}
	if got, err := p.Labels("r"); err != nil || !slices.Equal(got, want) {
		t.Fatalf("labels again: %d, %v", len(got), err)
	}
}

// TestSeedSemantics: discard of an unknown stream is a no-op, num_pages of
// one is 0, an offload of zero pages returns false and records nothing, and
// a second offload of an existing (rid, label) stays an error.
func TestSeedSemantics(t *testing.T) {
	a := serveAgent(t, standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 1 << 20, Tokens: []string{"tok"}})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev, _ := sim.Open(0)
	kv := newPages(t, dev, 8, 4096)
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-seed"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if ok, err := p.OffloadStream("r", "a", []int32{1, 2}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	before, _ := p.Usage()
	if err := p.Discard("r", "zz"); err != nil {
		t.Fatalf("discard of an unknown label: %v", err)
	}
	if err := p.Discard("nobody", "a"); err != nil {
		t.Fatalf("discard of an unknown request: %v", err)
	}
	if n, err := p.NumPages("nobody", "a"); n != 0 || err != nil {
		t.Fatalf("num_pages of an unknown stream = %d, %v", n, err)
	}
	if ok, err := p.OffloadStream("q", "a", nil, 5, 5, 0); ok || err != nil {
		t.Fatalf("offload of zero pages = %v, %v; want false, nil", ok, err)
	}
	if on, _ := p.IsOffloaded("q"); on {
		t.Fatal("an offload of zero pages recorded a stream")
	}
	if ok, err := p.OffloadStream("r", "a", []int32{3}, 0, 0, 0); ok || !errors.Is(err, poolerr.ErrDuplicateStream) {
		t.Fatalf("second offload of r/a = %v, %v; want a duplicate stream error", ok, err)
	}
	if after, _ := p.Usage(); after != before {
		t.Fatalf("usage changed: %+v -> %+v", before, after)
	}
	if n, _ := p.NumPages("r", "a"); n != 2 {
		t.Fatalf("r/a holds %d pages", n)
	}
}

// TestMultiGPUPod is a pod holding the chunks of host GPUs 4 and 5 of 6,
// with one rank per GPU: inside the container they are CUDA ordinals 0
// and 1, named by their host UUIDs. Each rank, with MaxPages 0, binds its
// fair share, its own GPU's chunks first; the agent counts each session
// and each request under the host GPU; a third rank finds every chunk
// bound, and a rank on a GPU the node does not have gets a clear error.
func TestMultiGPUPod(t *testing.T) {
	var mu stdsync.Mutex
	reqGPU := map[int]int{}
	a := serveAgent(t, standalone.Config{GPUs: 6, ChunksPerGPU: 2, ChunkBytes: 1 << 20, Tokens: []string{"tok"},
		Hooks: server.Hooks{Request: func(r server.Request) {
			if r.Op == wire.OpOffload {
				mu.Lock()
				reqGPU[r.GPU] += r.Pages
				mu.Unlock()
			}
		}}})
	// The pod was given GPU 4's and GPU 5's chunks only.
	chunks, err := a.Pool.Revoke(standalone.AllocationName("tok"))
	if err != nil {
		t.Fatal(err)
	}
	var mine []string
	for _, c := range chunks {
		if err := a.Pool.Scrubbed(c.ID); err != nil {
			t.Fatal(err)
		}
		if c.GPU >= 4 {
			mine = append(mine, c.ID)
		}
	}
	if err := a.Pool.Grant(standalone.AllocationName("tok"), mine); err != nil {
		t.Fatal(err)
	}
	hostUUID := func(i int) string { return cudart.SimulatedUUID(i) }
	sim := cudart.NewSim(cudart.SimOptions{Devices: 3, UUIDs: []string{hostUUID(4), hostUUID(5), hostUUID(0)}})
	ranks := make([]*client.CPUPagePool, 2)
	kvs := make([]*page, 2)
	for r := range ranks {
		dev, _ := sim.Open(r)
		kvs[r] = newPages(t, dev, 64, 4096)
		p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
			Regions: kvs[r].regions(), InstanceID: []byte("instance-tp-pod"), Logger: quiet})
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		defer p.Close()
		ranks[r] = p
		if _, capacity, _ := p.Session(); capacity != 2*(1<<20)/4096 {
			t.Fatalf("rank %d: capacity %d, want its GPU's two chunks", r, capacity)
		}
	}
	// Each rank offloads and reloads its own bytes.
	for r, p := range ranks {
		kvs[r].writeAll(t, byte(r+1))
		if ok, err := p.OffloadStream("req", "kv", []int32{1, 2, 3}, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	for r, p := range ranks {
		sync(t, p, kvs[r].dev)
		if _, err := p.ReloadStream("req", "kv", []int32{10, 11, 12}); err != nil {
			t.Fatal(err)
		}
		sync(t, p, kvs[r].dev)
		mem := kvs[r].readAll(t)
		for i, d := range []int32{10, 11, 12} {
			if !bytes.Equal(mem[d*4096:(d+1)*4096], stampOf(int32(i+1), byte(r+1), 4096)) {
				t.Fatalf("rank %d: page %d has the wrong bytes", r, d)
			}
		}
	}
	byGPU := map[int]string{}
	for _, s := range a.Server.Sessions() {
		byGPU[s.GPU] = s.GPUUUID
	}
	if len(byGPU) != 2 || byGPU[4] != hostUUID(4) || byGPU[5] != hostUUID(5) {
		t.Fatalf("sessions by GPU: %v", byGPU)
	}
	mu.Lock()
	if len(reqGPU) != 2 || reqGPU[4] != 3 || reqGPU[5] != 3 {
		t.Fatalf("offloaded pages by GPU in the request hook: %v", reqGPU)
	}
	mu.Unlock()
	for _, s := range a.Pool.Chunks() {
		if s.Bound && s.GPU < 4 {
			t.Fatalf("chunk %s of GPU %d bound", s.ID, s.GPU)
		}
	}
	// A third rank, on host GPU 0: the two ranks hold every chunk.
	dev2, _ := sim.Open(2)
	k2 := newPages(t, dev2, 8, 4096)
	_, err = client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev2,
		Regions: k2.regions(), InstanceID: []byte("instance-tp-pod"), Logger: quiet})
	if !errors.Is(err, poolerr.ErrNoCapacity) {
		t.Fatalf("open with every chunk bound: %v", err)
	}
	// A GPU this node does not have.
	other := cudart.NewSim(cudart.SimOptions{Devices: 1, UUIDs: []string{"GPU-19999"}})
	dev3, _ := other.Open(0)
	k3 := newPages(t, dev3, 8, 4096)
	_, err = client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev3,
		Regions: k3.regions(), InstanceID: []byte("instance-tp-pod"), Logger: quiet})
	if !errors.Is(err, poolerr.ErrUnknownGPU) {
		t.Fatalf("open on a GPU of no node: %v", err)
	}
}

// TestOffloadWaitDoesNotBlockOthers: an offload that must wait for a
// reload's copy to finish (the only pages that would make room are still
// being read) lets the pool's other calls through while it waits.
func TestOffloadWaitDoesNotBlockOthers(t *testing.T) {
	const delay = 800 * time.Millisecond
	a := serveAgent(t, standalone.Config{GPUs: 1, ChunksPerGPU: 1, ChunkBytes: 64 << 10, Tokens: []string{"tok"}})
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, CopyDelay: delay})
	dev, _ := sim.Open(0)
	kv := newPages(t, dev, 32, 4096)
	pending := make(chan struct{}, 1)
	var p *client.CPUPagePool
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-wait"), Logger: quiet, MaxPages: 4,
		Trace: func(op wire.Op, _ time.Duration) {
			if op == wire.OpOffload {
				select {
				case pending <- struct{}{}:
				default:
				}
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	kv.writeAll(t, 1)
	if ok, err := p.OffloadStream("a", "", []int32{0, 1, 2, 3}, 0, 0, 0); !ok || err != nil {
		t.Fatal(ok, err)
	}
	<-pending
	if _, err := p.ReloadStream("a", "", []int32{4, 5, 6, 7}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		ok, err := p.OffloadStream("b", "", []int32{8, 9}, 0, 0, 0)
		if err == nil && !ok {
			err = errors.New("offload returned false")
		}
		done <- err
	}()
	<-pending // the offload got its "pending" reply and waits for the copy
	if on, err := p.IsOffloaded("a"); on || err != nil {
		t.Fatalf("is_offloaded during the wait: %v, %v", on, err)
	}
	// The reload's copy (which the offload waits for) has not landed: the
	// call did not wait for it either (not in the pool's lock, nor in the
	// Mover's).
	if got := kv.readAll(t)[4*4096 : 5*4096]; !bytes.Equal(got, stampOf(4, 1, 4096)) {
		t.Fatal("is_offloaded returned only after the reload's copy had completed: it waited for the offload's wait")
	}
	select {
	case err := <-done:
		t.Fatalf("the offload finished (%v) before the call made during its wait returned: that call waited for it", err)
	default:
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestEngineGivenGPU: the engine's GPU, not the chunks, decides the
// session's GPU. A pod given GPU 3 (its CUDA ordinal 0) whose chunks were
// all sized under GPU 0's name binds them; the open reply's locality says
// where they lie; declared ranks split the allocation.
func TestEngineGivenGPU(t *testing.T) {
	a := serveAgent(t, standalone.Config{GPUs: 4, ChunksPerGPU: 4, ChunkBytes: 1 << 20, Tokens: []string{"tok"}})
	// The one token's allocation (standalone allocations are named by
	// their token's digest).
	var alloc string
	for _, c := range a.Pool.Chunks() {
		alloc = c.Allocation
	}
	chunks, err := a.Pool.Revoke(alloc)
	if err != nil {
		t.Fatal(err)
	}
	var gpu0 []string
	for _, c := range chunks {
		if err := a.Pool.Scrubbed(c.ID); err != nil {
			t.Fatal(err)
		}
		if c.GPU == 0 {
			gpu0 = append(gpu0, c.ID)
		}
	}
	if err := a.Pool.Grant(alloc, gpu0); err != nil {
		t.Fatal(err)
	}
	// The container was given host GPUs 3 and 1; the engine runs two ranks.
	sim := cudart.NewSim(cudart.SimOptions{Devices: 2, UUIDs: []string{cudart.SimulatedUUID(3), cudart.SimulatedUUID(1)}})
	for r := range 2 {
		dev, _ := sim.Open(r)
		kv := newPages(t, dev, 64, 4096)
		p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
			Regions: kv.regions(), Ranks: 2, InstanceID: []byte(fmt.Sprint("instance-engine-", r)), Logger: quiet})
		if err != nil {
			t.Fatalf("rank %d on %s: %v", r, dev.UUID(), err)
		}
		defer p.Close()
		l := p.Locality()
		if len(l.Chunks) != 2 || l.Ranks != 2 || l.Local+l.Remote+l.Unknown != 2 {
			t.Fatalf("rank %d: locality %+v", r, l)
		}
		for _, c := range l.Chunks {
			if !slices.Contains(gpu0, c.ID) {
				t.Fatalf("rank %d bound %s", r, c.ID)
			}
		}
		kv.writeAll(t, byte(r+7))
		if ok, err := p.OffloadStream("req", "kv", []int32{4, 5}, 0, 0, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
		sync(t, p, kv.dev)
		if _, err := p.ReloadStream("req", "kv", []int32{20, 21}); err != nil {
			t.Fatal(err)
		}
		sync(t, p, kv.dev)
		mem := kv.readAll(t)
		for i, d := range []int32{20, 21} {
			if !bytes.Equal(mem[d*4096:(d+1)*4096], stampOf(int32(i+4), byte(r+7), 4096)) {
				t.Fatalf("rank %d: page %d has the wrong bytes", r, d)
			}
		}
	}
	byGPU := map[int]int{}
	for _, s := range a.Server.Sessions() {
		byGPU[s.GPU] = len(s.ChunkNUMA)
	}
	if !maps.Equal(byGPU, map[int]int{3: 2, 1: 2}) {
		t.Fatalf("sessions by host GPU: %v", byGPU)
	}
	if _, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: nil}); err == nil {
		t.Fatal("open without a device")
	}
	dev, _ := sim.Open(0)
	if _, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev, Ranks: -1,
		Regions: newPages(t, dev, 8, 4096).regions()}); err == nil {
		t.Fatal("negative ranks accepted")
	}
}

// A standalone agent whose GPUs are named by the caller (as hack/gpu/check.sh
// names them after the machine's real devices) serves a session on a device
// of that name, and refuses one on the simulator's default name, which its
// plan no longer holds.
func TestStandaloneGPUsNamedByTheCaller(t *testing.T) {
	const uuid = "GPU-ee106278-7bb3-e4bc-2679-e4908e7dbf68"
	a := serveAgent(t, standalone.Config{GPUs: 1, GPUUUIDs: []string{uuid}, ChunksPerGPU: 1, ChunkBytes: 64 << 10, Tokens: []string{"tok"}})
	named := cudart.NewSim(cudart.SimOptions{Devices: 1, UUIDs: []string{uuid}})
	dev, _ := named.Open(0)
	kv := newPages(t, dev, 8, 4096)
	p, err := client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev,
		Regions: kv.regions(), InstanceID: []byte("instance-named"), Logger: quiet})
	if err != nil {
		t.Fatalf("open on the GPU the agent was given: %v", err)
	}
	p.Close()
	plain := cudart.NewSim(cudart.SimOptions{Devices: 1})
	dev2, _ := plain.Open(0)
	k2 := newPages(t, dev2, 8, 4096)
	_, err = client.Open(context.Background(), client.Options{Socket: a.Socket, Token: "tok", Device: dev2,
		Regions: k2.regions(), InstanceID: []byte("instance-plain"), Logger: quiet})
	if !errors.Is(err, poolerr.ErrUnknownGPU) {
		t.Fatalf("open on %s, which the plan does not hold: %v", cudart.SimulatedUUID(0), err)
	}
}
