package agent

import (
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/hostmem"
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
	// warmPerSnapshotByte and warmPerRecordByte are the heap the restore
	// takes per byte of the kept books' snapshot and per byte of their
	// records after it, rounded up: a snapshot holds a stream in fewer
	// bytes than the records that made it. Measured with kvbench
	// restart's shapes (11-byte request IDs, four sessions at the agent's
	// bound): 121 MiB for 6.9 MB of snapshot and 16.1 MB of records, 133
	// MiB for 13.7 and 6.0 after a churn, so about 7.9 and 4.1; and 123
	// MiB for 14.0 MB of snapshot alone (the books compacted while
	// quiet), 9.2 a byte, which 8 left 16 MiB short (the rebuild faulted
	// them in: 64-83 ms where it took 37-41). Longer names take less.
	// Warming a page too many costs a fraction of the fault a page too
	// few costs, and the heartbeat step hands what the restore left
	// unused back to the system.
	warmPerSnapshotByte = 10
	warmPerRecordByte   = 5
	// warmPerChunk is the heap the start-up takes per kept chunk besides
	// the books' (the keeper's hand-over, the plan's specs, the adoption,
	// the pool's tables, the allocations' grants), rounded up: 14.5 MiB
	// for 4,096 chunks before their tables were sized ahead (kvbench
	// restart --chunks 4096 --chunk-mib 1), 9 MiB (2.2 KiB a chunk) after.
	// A chunk's record in the books is some tens of bytes, so the books'
	// rates alone left that heap to fresh pages: 3,650 page faults between
	// a spare's turn and its serving, some 40 ms of the gap on the dev VM
	// (200-300 with the chunks counted).
	warmPerChunk = 4 << 10
	// warmFrom is the least heap worth warming: below it the restore
	// takes fewer faults than the warming costs.
	warmFrom = 4 << 20
	// warmMost bounds the warm heap, with a quarter of GOMEMLIMIT.
	warmMost  = 256 << 20
	warmPiece = 4 << 20
)

// warmSize is the heap to warm for kept books of snapshot and records
// bytes (books.Sizes) naming chunks chunks, given the process's memory
// limit (math.MaxInt64: none).
func warmSize(snapshot, records int64, chunks int, limit int64) int64 {
	w := min(snapshot*warmPerSnapshotByte+records*warmPerRecordByte+int64(chunks)*warmPerChunk, warmMost, limit/4)
	if w < warmFrom {
		return 0
	}
	return w
}

// warmHeap makes about n bytes of heap resident and free for the
// allocations that follow, and returns how many it made so (none where
// the kernel cannot populate a range, before Linux 5.14: then the restore
// faults its pages in itself, as it did) and whether it asked for them in
// huge pages (hugeWarmOK).
func warmHeap(n int64) (warmed int64, huge bool) {
	held, huge := warmPieces(n, runtime.GOMAXPROCS(0), nil)
	return letGo(held), huge
}

// warmPieces allocates about n bytes of heap in pieces and makes them
// resident, on up to lanes CPUs, until stop is closed (nil: never); it
// returns the pieces made resident (the caller holds them until letGo)
// and whether it asked for huge pages.
func warmPieces(n int64, lanes int, stop <-chan struct{}) (held [][]byte, huge bool) {
	if n <= 0 {
		return nil, false
	}
	// The first piece tells whether the kernel populates at all, before
	// the rest of the heap is allocated for nothing.
	first := make([]byte, warmPiece)
	if unix.Madvise(first, unix.MADV_POPULATE_WRITE) != nil {
		return nil, false
	}
	held = make([][]byte, 1, n/warmPiece+1)
	held[0] = first
	for int64(len(held))*warmPiece < n {
		// An allocation may clear a piece of heap the runtime had
		// handed back, a fault a page: stopped between pieces too.
		select {
		case <-stop:
			return held[:1], false
		default:
		}
		held = append(held, make([]byte, warmPiece))
	}
	rest := held[1:]
	if huge = hugeWarmOK(n); huge {
		adviseHuge(rest, unix.MADV_HUGEPAGE)
	}
	lanes = max(1, min(lanes, len(rest)))
	ok := make([]bool, len(rest))
	var wg sync.WaitGroup
	for l := range lanes {
		wg.Go(func() {
			for i := l; i < len(rest); i += lanes {
				select {
				case <-stop:
					return
				default:
				}
				ok[i] = unix.Madvise(rest[i], unix.MADV_POPULATE_WRITE) == nil
			}
		})
	}
	wg.Wait()
	if huge {
		// The ask holds only while the pieces are populated: left on, it
		// would let khugepaged fill the heap the runtime hands back after
		// the restore with huge pages again. In "madvise" mode no ask and
		// MADV_NOHUGEPAGE are alike.
		adviseHuge(rest, unix.MADV_NOHUGEPAGE)
	}
	done := 1
	for done < len(held) && ok[done-1] {
		done++
	}
	return held[:done], huge
}

// letGo hands the warm pieces back to the heap, resident, and returns
// their bytes.
func letGo(held [][]byte) int64 {
	if len(held) == 0 {
		return 0
	}
	if onWarm != nil {
		onWarm(held)
	}
	// The collector is off during the restore; this collection frees
	// the pieces, and their pages go back to the heap, resident.
	n := int64(len(held)) * warmPiece
	collectKeeping(held)
	return n
}

// collectKeeping runs a collection, as runtime.GC, that frees held (the
// caller's last references to them) and hands none of the free heap back
// to the system until the next collection, where the collector is off.
//
// After each collection the runtime's scavenger hands back, in the
// background, the free heap above 110% of the heap then in use, scaled by
// how much the heap goal grew since the collection before. With the
// collector off both goals are unbounded and the scale is one: the
// scavenger handed a spare's warm heap back in the seconds before its
// turn (at 16,384 chunks, half the turns found 3-5 MiB of it free where
// the others found 61-70, and faulted 2,250-2,760 pages in: 27-33 ms on a
// VM where a fault costs 12 µs). So a first collection runs
// with a bounded goal while held is still referenced (none of it free to
// hand back: the caller holds the free heap, holdFree, or the warm pieces
// it made), and the one that frees it with the collector off again: the
// goal grew without bound since the one before, and so does what the
// scavenger keeps (held across the first, the pages are also in use
// during its cycle, which the scavenger passes over). The process's
// memory limit, where set, still holds.
func collectKeeping(held [][]byte) {
	prev := debug.SetGCPercent(100)
	runtime.GC()
	debug.SetGCPercent(prev)
	clear(held)
	runtime.GC()
}

// holdFree allocates the free heap in pieces, resident pages the
// allocator takes first, for collectKeeping to hold over its first
// collection.
func holdFree() [][]byte {
	held := make([][]byte, heapFree()/warmPiece)
	for i := range held {
		held[i] = make([]byte, warmPiece)
	}
	return held
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

// hugeBlock is a transparent huge page where base pages are 4 KiB.
const hugeBlock = 2 << 20

// hugeWarmOK reports whether the warm heap of n bytes should ask for
// transparent huge pages (MADV_HUGEPAGE): base pages of 4 KiB, the kernel
// giving huge pages to a range that asks for them (hostmem.AnonTHP
// "madvise";
// with "always" it gives them unasked, with "never" not at all), and at
// least twice n lying free in blocks of a huge page or more, so that each
// huge fault takes a free block instead of compacting memory first (an
// earlier try without this gate, on another VM, took 117-139 ms for a
// 136 MiB warm heap, put down to compaction then). A huge page is one
// fault and one page-table entry where 512 base pages are 512 of each, and
// then one first touch where there were 512: on a paravirtualised VM,
// where each of those exits to the host, the replay and the rebuild that
// run in the warm heap took about half the time (docs/benchmarks.md, "A
// second machine kind").
func hugeWarmOK(n int64) bool {
	if os.Getpagesize() != 4096 || n < hugeBlock {
		return false
	}
	if hostmem.AnonTHP() != "madvise" {
		return false
	}
	buddy, err := os.ReadFile("/proc/buddyinfo")
	if err != nil {
		return false
	}
	return freeHugeBlocks(string(buddy)) >= 2*(n+hugeBlock-1)/hugeBlock
}

// freeHugeBlocks counts the free 2 MiB blocks /proc/buddyinfo lists (4 KiB
// base pages): one per free block of order 9, two per order 10, and so on;
// a line it cannot read counts for none.
func freeHugeBlocks(buddyinfo string) int64 {
	var blocks int64
	for _, line := range strings.Split(buddyinfo, "\n") {
		// "Node 0, zone   Normal   7417 8458 ... 4738": counts by order after the zone's name.
		f := strings.Fields(line)
		if len(f) < 5 || f[0] != "Node" || f[2] != "zone" {
			continue
		}
		for order, c := range f[4:] {
			if order < 9 {
				continue
			}
			k, err := strconv.ParseInt(c, 10, 64)
			if err != nil || k < 0 || order > 20 || k > 1<<40 {
				break // not a count of free blocks the kernel would list
			}
			blocks = min(blocks+k<<(order-9), 1<<60) // no sum of lines overflows
		}
	}
	return blocks
}

// adviseHuge gives advice (MADV_HUGEPAGE or MADV_NOHUGEPAGE) over the
// pieces' span rounded out to whole huge blocks: the pieces are
// consecutive large objects of one heap arena as a rule, and advice over a
// neighbour's memory is harmless, it is heap too. Where the span is more
// than twice the pieces (they are scattered), each piece gets it alone.
// Errors are ignored: advice over an unmapped hole still applies to the
// mapped parts, and without it the warm heap is what it was.
func adviseHuge(pieces [][]byte, advice int) {
	lo, hi, total := ^uintptr(0), uintptr(0), uintptr(0)
	for _, b := range pieces {
		a := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		lo, hi, total = min(lo, a), max(hi, a+uintptr(len(b))), total+uintptr(len(b))
	}
	if total == 0 {
		return
	}
	if hi-lo <= 2*total {
		adviseRange(lo, hi, advice)
		return
	}
	for _, b := range pieces {
		a := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		adviseRange(a, a+uintptr(len(b)), advice)
	}
}

func adviseRange(lo, hi uintptr, advice int) {
	lo &^= hugeBlock - 1
	hi = (hi + hugeBlock - 1) &^ (hugeBlock - 1)
	_, _, _ = unix.Syscall(unix.SYS_MADVISE, lo, hi-lo, uintptr(advice))
}
