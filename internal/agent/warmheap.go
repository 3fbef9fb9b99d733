package agent

import (
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"sync"

	"golang.org/x/sys/unix"
)

// The restore allocates its heap with the collector off, most of it in
// pages the fresh process has never touched: one page fault for each 4 KiB,
// about 10,000 of them (39 MiB) for one session of 131,072 streams, whose
// books take 8 MiB. warmHeap makes that heap resident first, a few MiB a
// system call (MADV_POPULATE_WRITE) on every CPU the process has (the faults
// of one CPU made 48 MiB resident in 22-25 ms here, two in 17-19), and hands
// it back to the runtime, whose allocator then reuses those pages for the
// restore.
const (
	// warmPerBooksByte is the heap the restore takes per byte of kept
	// books, rounded up: 4.8 for short request IDs (11 bytes; 39 MiB
	// allocated for 8.1 MiB of books), less for longer ones. Warming a
	// page too many costs a fraction of the fault a page too few costs,
	// and the heartbeat step hands what the restore left unused back to
	// the system.
	warmPerBooksByte = 6
	// warmFrom is the least heap worth warming: below it the restore
	// takes fewer faults than the warming costs.
	warmFrom = 4 << 20
	// warmMost bounds the warm heap, with a quarter of GOMEMLIMIT.
	warmMost  = 256 << 20
	warmPiece = 4 << 20
)

// booksBytes is the bytes the kept books memfd holds (its written pages).
func booksBytes(f *os.File) int64 {
	var st unix.Stat_t
	if f == nil || unix.Fstat(int(f.Fd()), &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

// warmSize is the heap to warm for books of n bytes, given the process's
// memory limit (math.MaxInt64: none).
func warmSize(n, limit int64) int64 {
	w := min(n*warmPerBooksByte, warmMost, limit/4)
	if w < warmFrom {
		return 0
	}
	return w
}

// warmHeap makes about n bytes of heap resident and free for the
// allocations that follow, and returns how many it made so: none where
// the kernel cannot populate a range (before Linux 5.14), and then the
// restore faults its pages in itself, as it did.
func warmHeap(n int64) int64 {
	if n <= 0 {
		return 0
	}
	// The first piece tells whether the kernel populates at all, before
	// the rest of the heap is allocated for nothing.
	first := make([]byte, warmPiece)
	if unix.Madvise(first, unix.MADV_POPULATE_WRITE) != nil {
		return 0
	}
	held := make([][]byte, 1, n/warmPiece+1)
	held[0] = first
	for int64(len(held))*warmPiece < n {
		held = append(held, make([]byte, warmPiece))
	}
	rest := held[1:]
	lanes := min(runtime.GOMAXPROCS(0), len(rest))
	ok := make([]bool, len(rest))
	var wg sync.WaitGroup
	for l := range lanes {
		wg.Go(func() {
			for i := l; i < len(rest); i += lanes {
				ok[i] = unix.Madvise(rest[i], unix.MADV_POPULATE_WRITE) == nil
			}
		})
	}
	wg.Wait()
	done := int64(warmPiece)
	for i, b := range rest {
		if !ok[i] {
			break
		}
		done += int64(len(b))
	}
	if onWarm != nil {
		onWarm(held[:done/warmPiece])
	}
	// The collector is off during the restore; this one collection frees
	// the pieces, and their pages go back to the heap, resident.
	runtime.GC()
	return done
}

// onWarm, set by tests, sees the pieces warmHeap made resident before it
// lets them go.
var onWarm func(pieces [][]byte)

// memoryLimit is the process's GOMEMLIMIT (math.MaxInt64: none).
func memoryLimit() int64 {
	if l := debug.SetMemoryLimit(-1); l > 0 {
		return l
	}
	return math.MaxInt64
}
