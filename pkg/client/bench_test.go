package client_test

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/hostmem"
)

// Run side by side:
//
//	go test -run XXX -bench 'OffloadReloadSim|MemcpyFloor' ./pkg/client
//
// One op moves 64 scattered pages of 256 KiB (K and V regions of 128 KiB)
// to the host and back: 32 MiB. The floor is the same bytes moved by Go's
// copy between plain slices, in one goroutine, with no agent, no streams
// and no events.

const (
	copyPages = 64
	halfPage  = 128 << 10
	devPages  = 512
)

func scattered() []int32 {
	p := make([]int32, copyPages)
	for i := range p {
		p[i] = int32((i*37 + 11) % devPages)
	}
	return p
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU adds MB per CPU-second: on a shared machine where this process
// gets a varying share of the cores, bytes per wall second swing with the
// neighbours' load, and a benchmark with more threads gets a bigger share.
// Bytes per CPU-second compares the two fairly.
func reportCPU(b *testing.B, start time.Duration, bytesPerOp int64) {
	used := cpuTime(b) - start
	if used > 0 {
		b.ReportMetric(float64(bytesPerOp)*float64(b.N)/used.Seconds()/1e6, "MB/cpu-s")
	}
}

func BenchmarkOffloadReloadSim(b *testing.B) {
	a := startAgent(b, 32<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, MemoryBytes: 2*devPages*halfPage + 1<<20})
	dev, _ := sim.Open(0)
	c := newKV(b, dev, devPages, halfPage)
	p := openPool(b, a, dev, c, []byte("bench-copy-instance"), copyPages)
	pages := scattered()
	// Fill the device cache as the floor fills its buffers, so that neither
	// reads the kernel's shared zero page.
	fill := make([]byte, devPages*halfPage)
	for i := range fill {
		fill[i] = byte(i)
	}
	if err := dev.MemcpyHtoD(c.k, fill); err != nil {
		b.Fatal(err)
	}
	if err := dev.MemcpyHtoD(c.v, fill); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(2 * copyPages * 2 * halfPage)
	b.ResetTimer()
	cpu := cpuTime(b)
	defer func() { reportCPU(b, cpu, 2*copyPages*2*halfPage) }()
	for i := 0; i < b.N; i++ {
		ok, err := p.OffloadStream("r", "l", pages, 1, 1, 0)
		if !ok || err != nil {
			b.Fatal(ok, err)
		}
		if _, err := p.ReloadStream("r", "l", pages); err != nil {
			b.Fatal(err)
		}
		if err := p.Sync(0); err != nil {
			b.Fatal(err)
		}
		if err := dev.StreamSynchronize(0); err != nil {
			b.Fatal(err)
		}
	}
}

// floorMem is the floors' memory: device-sized K and V arrays in plain
// slices and a memfd chunk for the host pages, as the pool's pages are.
type floorMem struct {
	k, v, host []byte
	pages      []int32
}

func newFloorMem(b *testing.B) *floorMem {
	m := &floorMem{k: make([]byte, devPages*halfPage), v: make([]byte, devPages*halfPage), pages: scattered()}
	hc, err := hostmem.Alloc(hostmem.Options{Size: copyPages * 2 * halfPage})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { hc.Close() })
	m.host = hc.Mem
	for i := range m.k {
		m.k[i], m.v[i] = byte(i), byte(i>>8)
	}
	return m
}

func (m *floorMem) offload() {
	for h, d := range m.pages {
		off := int(d) * halfPage
		copy(m.host[h*2*halfPage:], m.k[off:off+halfPage])
		copy(m.host[h*2*halfPage+halfPage:], m.v[off:off+halfPage])
	}
}

func (m *floorMem) reload() {
	for h, d := range m.pages {
		off := int(d) * halfPage
		copy(m.k[off:off+halfPage], m.host[h*2*halfPage:])
		copy(m.v[off:off+halfPage], m.host[h*2*halfPage+halfPage:])
	}
}

// BenchmarkMemcpyFloor moves the bytes in the benchmark's own goroutine:
// the cheapest way, with every byte hot in the one core's caches.
func BenchmarkMemcpyFloor(b *testing.B) {
	m := newFloorMem(b)
	b.SetBytes(2 * copyPages * 2 * halfPage)
	b.ResetTimer()
	cpu := cpuTime(b)
	defer func() { reportCPU(b, cpu, 2*copyPages*2*halfPage) }()
	for i := 0; i < b.N; i++ {
		m.offload()
		m.reload()
	}
}

// BenchmarkMemcpyFloorAsync moves the same bytes the way the simulator
// must: off the caller's goroutine, the offload on one goroutine and the
// reload on another (the simulator's device-to-host and host-to-device
// streams), each started when the one before it finishes. The Go scheduler
// may run those goroutines on other CPUs than the one that last wrote the
// bytes; this floor pays that cost as the simulator does, with no agent,
// no mover, no events and no bookkeeping.
func BenchmarkMemcpyFloorAsync(b *testing.B) {
	m := newFloorMem(b)
	d2h, h2d, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		for range d2h {
			m.offload()
			h2d <- struct{}{}
		}
		close(h2d)
	}()
	go func() {
		for range h2d {
			m.reload()
			done <- struct{}{}
		}
	}()
	defer close(d2h)
	b.SetBytes(2 * copyPages * 2 * halfPage)
	b.ResetTimer()
	cpu := cpuTime(b)
	defer func() { reportCPU(b, cpu, 2*copyPages*2*halfPage) }()
	for i := 0; i < b.N; i++ {
		d2h <- struct{}{}
		<-done
	}
}
