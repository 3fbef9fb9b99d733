package client_test

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
)

// Run side by side:
//
//	taskset -c 0 go test -run XXX -bench 'OffloadReloadSim|MemcpyFloor' ./pkg/client
//	go test -run XXX -bench 'OffloadReloadSim|MemcpyFloor' ./pkg/client
//
// One op moves 64 scattered pages of 256 KiB (K and V regions of 128 KiB)
// to the host and back: 32 MiB. The floor is the same bytes moved by Go's
// copy between plain slices, in one goroutine, with no agent, no streams
// and no events.
//
// The simulator copies on its streams' goroutines, as a copy engine works
// beside the caller. With one CPU (taskset -c 0) every copy runs on the
// core that last touched the bytes, as the floor's do, and the ratio is
// kvpool's own cost. With several, the Go scheduler may run the offload
// and the reload on different cores, and then each byte crosses between
// their caches: on 2-vCPU VMs that halves memcpy per CPU-second
// (BenchmarkMemcpyFloorCrossCPU), which is why the simulator has measured
// anywhere from 0.43x to 1.0x of the one-goroutine floor. Compare it with
// both floors.

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

// BenchmarkIsOffloaded is the smallest call with the agent in the same
// process (its allocations are the ones to watch: none); cmd/latbench
// times it between processes against a C echo.
func BenchmarkIsOffloaded(b *testing.B) {
	p, _, _ := benchPool(b, "bench-isoff-instance")
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if ok, err := p.IsOffloaded("request-000001"); ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}

// benchPool opens a pool of copyPages host pages on an in-process agent
// over a simulated device's K and V caches.
func benchPool(b *testing.B, instance string) (*client.CPUPagePool, cudart.Device, *kv) {
	a := startAgent(b, 32<<20)
	sim := cudart.NewSim(cudart.SimOptions{Devices: 1, MemoryBytes: 2*devPages*halfPage + 1<<20})
	dev, _ := sim.Open(0)
	c := newKV(b, dev, devPages, halfPage)
	return openPool(b, a, dev, c, []byte(instance), copyPages), dev, c
}

func BenchmarkOffloadReloadSim(b *testing.B) {
	p, dev, c := benchPool(b, "bench-copy-instance")
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

// BenchmarkMemcpyFloorCrossCPU moves the same bytes with the offload on
// one CPU and the reload on another (two goroutines locked to threads
// pinned to the first two CPUs this process may use), each started when the
// one before it finishes: what the simulator's copies cost when the Go
// scheduler runs its device-to-host and host-to-device stream goroutines on
// different CPUs. Every byte then crosses between the two cores' caches,
// which no DMA engine pays; the simulator's figure lies between this floor
// and BenchmarkMemcpyFloor depending on where its goroutines run.
func BenchmarkMemcpyFloorCrossCPU(b *testing.B) {
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		b.Fatal(err)
	}
	var cpus []int
	for c := 0; c < 1024 && len(cpus) < 2; c++ {
		if all.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) < 2 {
		b.Skip("needs two CPUs")
	}
	m := newFloorMem(b)
	d2h, h2d, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	worker := func(cpu int, in <-chan struct{}, work func(), out chan<- struct{}) {
		runtime.LockOSThread() // the thread exits with the goroutine: its mask dies with it
		var one unix.CPUSet
		one.Set(cpu)
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			panic(err)
		}
		for range in {
			work()
			out <- struct{}{}
		}
		if out != done {
			close(out)
		}
	}
	go worker(cpus[0], d2h, m.offload, h2d)
	go worker(cpus[1], h2d, m.reload, done)
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
