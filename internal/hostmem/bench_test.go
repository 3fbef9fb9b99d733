package hostmem

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// benchBytes is the chunk size the benchmarks allocate and set.
const benchBytes = 256 * mib

// BenchmarkAlloc allocates, pre-faults and locks one chunk per iteration
// with 1 and 2 workers. BenchmarkMemset sets the same number of bytes of an
// already-faulted buffer: the floor to compare against in the same run
// (b.SetBytes makes both report MB/s).
func BenchmarkAlloc(b *testing.B) {
	for _, workers := range []int{1, 2} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			b.SetBytes(benchBytes)
			for b.Loop() {
				c, err := Alloc(Options{Size: benchBytes, Prefault: true, Workers: workers, Lock: true, LockFallback: true})
				if err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		})
	}
}

// BenchmarkMemset has two floors: "faulted" sets a buffer whose pages are
// already in place (memory bandwidth), "fresh" maps new anonymous memory
// and sets it (page faults and kernel zeroing included, as for a chunk).
func BenchmarkMemset(b *testing.B) {
	b.Run("faulted", func(b *testing.B) {
		buf := make([]byte, benchBytes)
		for i := range buf {
			buf[i] = 1
		}
		b.SetBytes(benchBytes)
		for b.Loop() {
			memset(buf, 2)
		}
	})
	b.Run("fresh", func(b *testing.B) {
		b.SetBytes(benchBytes)
		for b.Loop() {
			buf, err := unix.Mmap(-1, 0, benchBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err != nil {
				b.Fatal(err)
			}
			memset(buf, 2)
			unix.Munmap(buf)
		}
	})
}

// memset is fill (probe.go).
func memset(buf []byte, v byte) { fill(buf, v) }

// BenchmarkPin is the figure of issue 25 point 5: each iteration times a
// memset of fresh anonymous memory (ordinary pages) and then the pinning
// of a chunk of the same size (Alloc: pre-faulted, locked), with the same
// number of threads, back to back (MeasurePin), so that both see the same
// machine load. It reports both rates and their ratio (pin over memset;
// the goal is >= 0.8), by wall time and by CPU time (steadier where other
// work shares the CPUs). pages=4k is the default chunk; pages=thp the same
// with shared-memory transparent huge pages allowed ("advise", set for the
// run and put back; skipped where that is not permitted); pages=2M a
// hugetlb chunk (2 MiB pages reserved for the run).
func BenchmarkPin(b *testing.B) {
	for _, pages := range []string{"4k", "thp", "2M"} {
		for _, workers := range []int{1, 2} {
			b.Run(fmt.Sprintf("pages=%s/workers=%d", pages, workers), func(b *testing.B) {
				o := Options{Size: benchBytes, Workers: workers, Lock: true, LockFallback: true}
				switch pages {
				case "thp":
					allowShmemTHP(b)
				case "2M":
					reserveHugePages(b, benchBytes/hugePage2M)
					o.PageSize = hugePage2M
				}
				benchPin(b, o)
			})
		}
	}
}

func benchPin(b *testing.B, o Options) {
	var sum PinRate
	for b.Loop() {
		r, err := MeasurePin(o)
		if err != nil {
			b.Fatal(err)
		}
		if r.PageSize != max(o.PageSize, int64(os.Getpagesize())) {
			b.Fatalf("chunk of %d-byte pages, want %d", r.PageSize, o.PageSize)
		}
		sum.Bytes += r.Bytes
		sum.Memset += r.Memset
		sum.Pin += r.Pin
		sum.MemsetCPU += r.MemsetCPU
		sum.PinCPU += r.PinCPU
	}
	b.ReportMetric(sum.PinBytesPerSecond()/1e6, "pin-MB/s")
	b.ReportMetric(sum.MemsetBytesPerSecond()/1e6, "memset-MB/s")
	b.ReportMetric(sum.Ratio(), "ratio")
	b.ReportMetric(sum.CPURatio(), "cpu-ratio")
}

// allowShmemTHP sets shared-memory transparent huge pages to "advise" (the
// chunks ask with MADV_HUGEPAGE) for the benchmark and puts the setting
// back after; it skips where the setting cannot be read or written.
func allowShmemTHP(b *testing.B) {
	const p = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
	data, err := os.ReadFile(p)
	if err != nil {
		b.Skipf("no shared-memory THP setting: %v", err)
	}
	old := ""
	for _, f := range strings.Fields(string(data)) {
		if strings.HasPrefix(f, "[") {
			old = strings.Trim(f, "[]")
		}
	}
	if old == "advise" || old == "always" || old == "within_size" || old == "force" {
		return
	}
	if err := os.WriteFile(p, []byte("advise"), 0); err != nil {
		b.Skipf("cannot allow shared-memory THP (needs root): %v", err)
	}
	b.Cleanup(func() {
		if err := os.WriteFile(p, []byte(old), 0); err != nil {
			b.Errorf("put %s back to %q: %v", p, old, err)
		}
	})
}

// BenchmarkRenew is what a reclaim costs per chunk: Drop of a chunk that a
// tenant filled (its pages released), then Alloc of a fresh one (pre-faulted,
// locked, sealed), 2 workers. Compare with BenchmarkAlloc/workers=2 (the
// floor: the allocation alone) and BenchmarkMemset/fresh in the same run.
func BenchmarkRenew(b *testing.B) {
	o := Options{Size: benchBytes, Prefault: true, Workers: 2, Lock: true, LockFallback: true}
	c, err := Alloc(o)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(benchBytes)
	for b.Loop() {
		b.StopTimer()
		memset(c.Mem, 0xA5) // a tenant's KV
		b.StartTimer()
		if err := c.Drop(0); err != nil {
			b.Fatal(err)
		}
		if c, err = Alloc(o); err != nil {
			b.Fatal(err)
		}
	}
	c.Close()
}
