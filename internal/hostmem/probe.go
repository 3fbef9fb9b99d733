package hostmem

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// PinRate is one measurement of pinning against its floor, taken back to
// back: a memset of fresh anonymous memory of the same size by the same
// number of threads (bound to the same CPUs and NUMA node), then Alloc of
// a chunk with the options asked for. Teardown (munmap, close) is in
// neither.
type PinRate struct {
	Bytes   int64
	Workers int
	// Wall time of the memset (mmap, then every byte set) and of Alloc.
	Memset, Pin time.Duration
	// CPU time (user and system, every thread of the process) of each:
	// on a loaded machine the steadier of the two figures.
	MemsetCPU, PinCPU time.Duration
	// Locked, PageSize and Warnings are the chunk's.
	Locked   bool
	PageSize int64
	Warnings []string
}

// PinBytesPerSecond is the pinning rate (wall time).
func (r PinRate) PinBytesPerSecond() float64 { return rate(r.Bytes, r.Pin) }

// MemsetBytesPerSecond is the floor's rate (wall time).
func (r PinRate) MemsetBytesPerSecond() float64 { return rate(r.Bytes, r.Memset) }

// Ratio is the pinning rate over the floor's, by wall time (1: as fast
// as a memset of fresh memory).
func (r PinRate) Ratio() float64 { return ratio(r.Memset, r.Pin) }

// CPURatio is Ratio by CPU time.
func (r PinRate) CPURatio() float64 { return ratio(r.MemsetCPU, r.PinCPU) }

func rate(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

func ratio(floor, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return floor.Seconds() / d.Seconds()
}

// MeasurePin measures one chunk of o (pre-faulted; Workers and CPUs as
// given) against a memset of fresh memory, and frees both. An Alloc error
// is returned as is.
func MeasurePin(o Options) (PinRate, error) {
	o.Prefault = true
	workers := max(o.Workers, 1)
	r := PinRate{Bytes: o.Size, Workers: workers}
	if o.Size <= 0 {
		return r, fmt.Errorf("hostmem: measure %d bytes", o.Size)
	}
	var err error
	r.Memset, r.MemsetCPU, err = memsetFresh(o.Size, workers, o.CPUs, o.Bind, o.Node)
	if err != nil {
		return r, err
	}
	c0, t0 := cpuTime(), time.Now()
	c, err := Alloc(o)
	r.Pin, r.PinCPU = time.Since(t0), cpuTime()-c0
	if err != nil {
		return r, err
	}
	r.Locked, r.PageSize, r.Warnings = c.Locked, c.PageSize, c.Warnings
	return r, c.Close()
}

// memsetFresh maps size bytes of fresh anonymous memory (ordinary pages,
// bound to node when bind is set) and sets every byte with workers
// goroutines on threads bound to cpus, as populate runs; it returns the
// wall and CPU time of the mapping and the setting.
func memsetFresh(size int64, workers int, cpus []int, bind bool, node int) (wall, cpu time.Duration, err error) {
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	c0, t0 := cpuTime(), time.Now()
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, 0, fmt.Errorf("hostmem: map %d bytes to measure against: %w", size, err)
	}
	defer unix.Munmap(mem)
	_ = unix.Madvise(mem, unix.MADV_NOHUGEPAGE) // like for like: ordinary pages
	if bind {
		_ = mbind(mem, node)
	}
	page := int64(os.Getpagesize())
	per := (size/page + int64(workers) - 1) / int64(workers) * page
	var wg sync.WaitGroup
	for lo := int64(0); lo < size; lo += per {
		part := mem[lo:min(lo+per, size)]
		wg.Go(func() {
			if len(cpus) > 0 {
				runtime.LockOSThread() // the thread ends with the goroutine
				_ = unix.SchedSetaffinity(0, &set)
			}
			fill(part, 0x5A)
		})
	}
	wg.Wait()
	return time.Since(t0), cpuTime() - c0, nil
}

// fill sets every byte of buf to v by doubling copies (memmove speed; v
// != 0 keeps the kernel's zero page out of the picture).
func fill(buf []byte, v byte) {
	if len(buf) == 0 {
		return
	}
	buf[0] = v
	for n := 1; n < len(buf); n *= 2 {
		copy(buf[n:], buf[:n])
	}
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
