package cudart

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/kvpool/kvpool/internal/hostmem"
)

// The scenarios in this file run against any Device: the simulator here,
// the real driver in gpu_test.go.

// pinned is registered host memory as a client holds it: a memfd chunk
// (internal/hostmem, as the agent allocates it) mapped a second time, shared,
// as the client maps the fd it receives, and registered.
type pinned struct {
	b []byte
}

func newPinned(t testing.TB, dev Device, n int) pinned {
	t.Helper()
	page := os.Getpagesize()
	size := (n + page - 1) / page * page
	chunk, err := hostmem.Alloc(hostmem.Options{Size: int64(size), Name: "cudart-test"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := hostmem.Map(chunk.File, int64(size))
	if err != nil {
		chunk.Close()
		t.Fatal(err)
	}
	b = b[:n]
	if err := dev.HostRegister(b); err != nil {
		hostmem.Unmap(b[:size])
		chunk.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.HostUnregister(b); err != nil {
			t.Error(err)
		}
		hostmem.Unmap(b[:size])
		chunk.Close()
	})
	return pinned{b}
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// must1 is must for calls that also return a ticket.
func must1(t testing.TB) func(Ticket, error) Ticket {
	return func(tk Ticket, err error) Ticket {
		t.Helper()
		must(t, err)
		return tk
	}
}

// pick returns k distinct values in [0, n) in random order.
func pick(r *rand.Rand, n, k int) []int {
	return r.Perm(n)[:k]
}

// layoutCase is a device layout to run the scenarios over.
type layoutCase struct {
	name      string
	pageBytes uint64 // per region
	regions   int
	gap       uint64 // stride - pageBytes
}

func (c layoutCase) String() string {
	return fmt.Sprintf("%s/%dKiB", c.name, c.pageBytes>>10)
}

// scenarioRoundTrip offloads scattered device pages of random bytes to
// scattered host pages, poisons the device pages, reloads the host pages
// onto other device pages, and checks with a copy enqueued on the caller's
// stream right after Sync that it sees the reloaded bytes, that every
// other device page is untouched, and that the host pages hold the bytes.
func scenarioRoundTrip(t *testing.T, dev Device, lc layoutCase, devPages, hostPagesN, k int, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 2))
	stride := lc.pageBytes + lc.gap
	regionBytes := stride * uint64(devPages)
	var layout Layout
	var bases []DevicePtr
	for i := 0; i < lc.regions; i++ {
		p, err := dev.MemAlloc(regionBytes)
		must(t, err)
		t.Cleanup(func() { dev.MemFree(p) })
		bases = append(bases, p)
		layout.Regions = append(layout.Regions, Region{Base: p, Stride: stride, PageBytes: lc.pageBytes, Pages: devPages})
	}
	hpb := int(layout.HostPageBytes())
	// Device contents: random everywhere, remembered per region.
	want := make([][]byte, lc.regions)
	for i, p := range bases {
		want[i] = randBytes(int(regionBytes), seed+uint64(i)+10)
		must(t, dev.MemcpyHtoD(p, want[i]))
	}
	host := newPinned(t, dev, hostPagesN*hpb)
	check := newPinned(t, dev, k*hpb)
	fill(host.b, 0xA5)
	fill(check.b, 0x5A)

	engine, err := dev.StreamCreate()
	must(t, err)
	t.Cleanup(func() { dev.StreamDestroy(engine) })
	m, err := NewMover(dev)
	must(t, err)
	t.Cleanup(func() { m.Close() })

	all := pick(r, devPages, 2*k)
	src, dst := all[:k], all[k:]
	hp := pick(r, hostPagesN, k)
	hostAddr := make([]uintptr, k)
	for i, h := range hp {
		hostAddr[i] = addr(host.b[h*hpb:])
	}

	// The engine writes the source pages on its own stream just before the
	// offload (as attention kernels write KV); the offload must wait for it.
	stage := newPinned(t, dev, k*hpb)
	copy(stage.b, randBytes(len(stage.b), seed+77))
	stageAddr := make([]uintptr, k)
	for i := range stageAddr {
		stageAddr[i] = addr(stage.b[i*hpb:])
	}
	write, err := layout.Copies(HostToDevice, src, stageAddr)
	must(t, err)
	must(t, dev.MemcpyBatchAsync(write, HostToDevice, engine))
	for i, s := range src {
		for reg := range bases {
			copy(want[reg][uint64(s)*stride:][:lc.pageBytes], stage.b[i*hpb+reg*int(lc.pageBytes):][:lc.pageBytes])
		}
	}

	out, err := layout.Copies(DeviceToHost, src, hostAddr)
	must(t, err)
	ticket, err := m.Offload(engine, out)
	must(t, err)
	must(t, m.Sync(engine))
	must(t, dev.StreamSynchronize(engine))
	// The host pages hold each region's page back to back.
	for i, h := range hp {
		for reg := 0; reg < lc.regions; reg++ {
			got := host.b[h*hpb+reg*int(lc.pageBytes):][:lc.pageBytes]
			exp := want[reg][uint64(src[i])*stride:][:lc.pageBytes]
			if !bytes.Equal(got, exp) {
				t.Fatalf("%v: host page %d region %d does not hold device page %d", lc, h, reg, src[i])
			}
		}
	}
	// Poison the source pages: the engine reuses them after Sync.
	for reg, p := range bases {
		for _, s := range src {
			poison := bytes.Repeat([]byte{0xEE}, int(lc.pageBytes))
			must(t, dev.MemcpyHtoD(p+DevicePtr(uint64(s)*stride), poison))
			copy(want[reg][uint64(s)*stride:], poison)
		}
	}

	// The engine still reads the destination pages on its stream (two
	// copies: the second starts late); the reload must not overwrite them
	// before that.
	before := newPinned(t, dev, k*hpb)
	fill(before.b, 0x11)
	beforeAddr := make([]uintptr, k)
	for i := range beforeAddr {
		beforeAddr[i] = addr(before.b[i*hpb:])
	}
	read, err := layout.Copies(DeviceToHost, dst, beforeAddr)
	must(t, err)
	must(t, dev.MemcpyBatchAsync(read, DeviceToHost, engine))
	must(t, dev.MemcpyBatchAsync(read, DeviceToHost, engine))

	in, err := layout.Copies(HostToDevice, dst, hostAddr)
	must(t, err)
	must1(t)(m.Reload(engine, in, ticket))
	must(t, m.Sync(engine))
	// Right after Sync, a copy on the engine's stream must see the new
	// bytes.
	checkAddr := make([]uintptr, k)
	for i := range checkAddr {
		checkAddr[i] = addr(check.b[i*hpb:])
	}
	probe, err := layout.Copies(DeviceToHost, dst, checkAddr)
	must(t, err)
	must(t, dev.MemcpyBatchAsync(probe, DeviceToHost, engine))
	must(t, dev.StreamSynchronize(engine))
	for i := range dst {
		if !bytes.Equal(check.b[i*hpb:][:hpb], host.b[hp[i]*hpb:][:hpb]) {
			t.Fatalf("%v: the engine stream read device page %d before its reload finished (or it is wrong)", lc, dst[i])
		}
	}
	for i, d := range dst {
		for reg := range bases {
			got := before.b[i*hpb+reg*int(lc.pageBytes):][:lc.pageBytes]
			if !bytes.Equal(got, want[reg][uint64(d)*stride:][:lc.pageBytes]) {
				t.Fatalf("%v: the reload overwrote device page %d before the engine's earlier read of it", lc, d)
			}
		}
	}
	// Whole-device check: reloaded pages hold the offloaded bytes, all
	// others what they held (poison included).
	for i, d := range dst {
		for reg := range bases {
			copy(want[reg][uint64(d)*stride:][:lc.pageBytes], host.b[hp[i]*hpb+reg*int(lc.pageBytes):][:lc.pageBytes])
		}
	}
	for reg, p := range bases {
		got := make([]byte, regionBytes)
		must(t, dev.MemcpyDtoH(got, p))
		if !bytes.Equal(got, want[reg]) {
			for j := range got {
				if got[j] != want[reg][j] {
					t.Fatalf("%v: region %d byte %d (page %d) is %#x, want %#x", lc, reg, j, uint64(j)/stride, got[j], want[reg][j])
				}
			}
		}
	}
}

// scenarioBackToBack offloads and immediately reloads the same host pages
// onto other device pages with the offload's ticket and no host wait in
// between: the reload must read what the offload wrote.
func scenarioBackToBack(t *testing.T, dev Device, pageBytes uint64, k int, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 3))
	n := 4 * k
	dp, err := dev.MemAlloc(uint64(n) * pageBytes)
	must(t, err)
	t.Cleanup(func() { dev.MemFree(dp) })
	data := randBytes(n*int(pageBytes), seed)
	must(t, dev.MemcpyHtoD(dp, data))
	layout := Layout{Regions: []Region{{Base: dp, Stride: pageBytes, PageBytes: pageBytes, Pages: n}}}
	host := newPinned(t, dev, 2*k*int(pageBytes))
	fill(host.b, 0xA5)
	engine, err := dev.StreamCreate()
	must(t, err)
	t.Cleanup(func() { dev.StreamDestroy(engine) })
	m, err := NewMover(dev)
	must(t, err)
	t.Cleanup(func() { m.Close() })

	all := pick(r, n, 2*k)
	src, dst := all[:k], all[k:]
	hostAddr := make([]uintptr, k)
	for i, h := range pick(r, 2*k, k) {
		hostAddr[i] = addr(host.b[h*int(pageBytes):])
	}
	out, err := layout.Copies(DeviceToHost, src, hostAddr)
	must(t, err)
	in, err := layout.Copies(HostToDevice, dst, hostAddr)
	must(t, err)
	ticket, err := m.Offload(engine, out)
	must(t, err)
	must1(t)(m.Reload(engine, in, ticket))
	must(t, m.Sync(engine))
	must(t, dev.StreamSynchronize(engine))
	got := make([]byte, len(data))
	must(t, dev.MemcpyDtoH(got, dp))
	for i := range src {
		s, d := src[i]*int(pageBytes), dst[i]*int(pageBytes)
		if !bytes.Equal(got[d:d+int(pageBytes)], data[s:s+int(pageBytes)]) {
			t.Fatalf("device page %d does not hold page %d after offload+reload", dst[i], src[i])
		}
	}
}

// scenarioDone checks that Mover.Done runs only after the copies before it.
func scenarioDone(t *testing.T, dev Device, pageBytes uint64) {
	const k = 8
	dp, err := dev.MemAlloc(k * pageBytes)
	must(t, err)
	t.Cleanup(func() { dev.MemFree(dp) })
	data := randBytes(k*int(pageBytes), 99)
	must(t, dev.MemcpyHtoD(dp, data))
	host := newPinned(t, dev, k*int(pageBytes))
	fill(host.b, 0)
	m, err := NewMover(dev)
	must(t, err)
	t.Cleanup(func() { m.Close() })
	engine, err := dev.StreamCreate()
	must(t, err)
	t.Cleanup(func() { dev.StreamDestroy(engine) })
	_, err = m.Offload(engine, []Copy{{Dst: addr(host.b), Src: uintptr(dp), Bytes: k * pageBytes}})
	must(t, err)
	seen := make(chan bool, 1)
	must(t, m.Done(func() { seen <- bytes.Equal(host.b, data) }))
	if !<-seen {
		t.Fatal("Done's function ran before the offload it follows completed")
	}
}
