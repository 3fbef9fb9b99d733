package agent

import (
	"fmt"
	"math"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestWarmSize(t *testing.T) {
	const mi = 1 << 20
	none := int64(math.MaxInt64)
	for _, c := range []struct {
		name            string
		snap, recs, lim int64
		chunks          int
		want            int64
	}{
		{"no books", 0, 0, none, 0, 0},
		{"books too small to be worth it", 0, warmFrom/warmPerRecordByte - 1, none, 0, 0},
		{"the smallest warmed", (warmFrom + warmPerSnapshotByte - 1) / warmPerSnapshotByte, 0, none, 0,
			(warmFrom + warmPerSnapshotByte - 1) / warmPerSnapshotByte * warmPerSnapshotByte},
		{"just below it", (warmFrom+warmPerSnapshotByte-1)/warmPerSnapshotByte - 1, 0, none, 0, 0},
		{"records only (7 MiB)", 0, 7 * mi, none, 0, 7 * mi * warmPerRecordByte},
		{"a snapshot only (7 MiB)", 7 * mi, 0, none, 0, 7 * mi * warmPerSnapshotByte},
		{"both: each at its rate", 14 * mi, 6 * mi, none, 0, 14*mi*warmPerSnapshotByte + 6*mi*warmPerRecordByte},
		{"bounded", 1 << 30, 0, none, 0, warmMost},
		{"a quarter of GOMEMLIMIT", 7 * mi, 7 * mi, 100 * mi, 0, 25 * mi},
		{"GOMEMLIMIT too small to warm anything", 7 * mi, 0, 8 * mi, 0, 0},
		{"chunks too few to be worth it", 0, 0, none, warmFrom/warmPerChunk - 1, 0},
		{"chunks alone", 0, 0, none, 4096, 4096 * warmPerChunk},
		{"chunks beside the books", 7 * mi, 0, none, 2048, 7*mi*warmPerSnapshotByte + 2048*warmPerChunk},
		{"chunks bounded", 0, 0, none, 1 << 20, warmMost},
	} {
		if got := warmSize(c.snap, c.recs, c.chunks, c.lim); got != c.want {
			t.Errorf("%s: warmSize(%d, %d, %d, %d) = %d, want %d", c.name, c.snap, c.recs, c.chunks, c.lim, got, c.want)
		}
	}
}

// TestWarmHeapIsWhatTheRestoreGets runs in a fresh process, as a
// restarted agent does: the pieces warmHeap makes are resident when it
// lets them go, and what is allocated next, small objects with the
// collector off as in a restore, lands in them. (The page faults that
// spares are not counted here: under the race detector its shadow memory
// takes faults of its own.)
func TestWarmHeapIsWhatTheRestoreGets(t *testing.T) {
	if os.Getenv("KVPOOL_WARMHEAP_CHILD") != "" {
		warmHeapChild(t)
		return
	}
	out := childOutput(t, "TestWarmHeapIsWhatTheRestoreGets", "KVPOOL_WARMHEAP_CHILD")
	var warmedBytes, resident, pages, objects, inside, hugeKiB int64
	var huge bool
	found := false
	for _, l := range strings.Split(out, "\n") {
		if i := strings.Index(l, "warmheap:"); i >= 0 {
			_, err := fmt.Sscan(l[i+len("warmheap:"):], &warmedBytes, &resident, &pages, &objects, &inside, &huge, &hugeKiB)
			found = err == nil
		}
	}
	if !found {
		t.Fatalf("the child said nothing:\n%s", out)
	}
	if warmedBytes == 0 {
		t.Skip("the kernel cannot populate a range (MADV_POPULATE_WRITE needs Linux 5.14): warmHeap does nothing here")
	}
	t.Logf("warmed %d MiB: %d of %d pages resident; %d of %d objects allocated next inside them; huge pages asked for: %t, %d MiB in them",
		warmedBytes>>20, resident, pages, inside, objects, huge, hugeKiB>>10)
	// Asked for where free huge blocks are plenty (hugeWarmOK: twice the
	// heap), they are what the kernel gives: all but the first piece, which
	// is warmed before the ask, and the pieces' rounding.
	if huge && hugeKiB<<10 < childAlloc/2 {
		t.Errorf("huge pages asked for, yet %d KiB of the %d MiB warm heap in them", hugeKiB, childAlloc>>20)
	}
	if warmedBytes < childAlloc {
		t.Fatalf("warmed %d bytes, asked for at least %d", warmedBytes, childAlloc)
	}
	if resident != pages {
		t.Fatalf("%d of the %d warmed pages resident", resident, pages)
	}
	if inside*4 < objects*3 {
		t.Fatalf("%d of %d objects allocated after warmHeap landed in the warmed pieces (want three quarters)", inside, objects)
	}
}

const childAlloc = 32 << 20

// childOutput runs test alone in a child process with env set, and returns
// what it printed (the heap's metrics are a process's).
func childOutput(t *testing.T, test, env string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.v")
	cmd.Env = append(os.Environ(), env+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	return string(out)
}

func warmHeapChild(t *testing.T) {
	debug.SetGCPercent(-1)
	type span struct{ lo, hi uintptr }
	var spans []span
	var resident, pages, hugeKiB int64
	onWarm = func(pieces [][]byte) {
		hugeKiB = anonHugeKiB(t)
		for _, b := range pieces {
			vec := make([]byte, (len(b)+4095)/4096)
			if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
				t.Fatalf("mincore: %v", e)
			}
			for _, v := range vec {
				resident += int64(v & 1)
			}
			pages += int64(len(vec))
			lo := uintptr(unsafe.Pointer(&b[0]))
			spans = append(spans, span{lo, lo + uintptr(len(b))})
		}
	}
	defer func() { onWarm = nil }()
	n, huge := warmHeap(childAlloc)
	keep := make([]*[256]byte, 0, childAlloc/256/2)
	for range cap(keep) {
		keep = append(keep, new([256]byte))
	}
	inside := 0
	for _, p := range keep {
		a := uintptr(unsafe.Pointer(p))
		for _, s := range spans {
			if a >= s.lo && a < s.hi {
				inside++
				break
			}
		}
	}
	t.Logf("warmheap: %d %d %d %d %d %t %d", n, resident, pages, len(keep), inside, huge, hugeKiB)
}

// anonHugeKiB is the process's anonymous memory in transparent huge pages.
func anonHugeKiB(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/smaps_rollup")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "AnonHugePages:"); ok {
			var kib int64
			if _, err := fmt.Sscan(v, &kib); err != nil {
				t.Fatalf("smaps_rollup: %q: %v", l, err)
			}
			return kib
		}
	}
	t.Fatal("smaps_rollup: no AnonHugePages line")
	return 0
}

func TestFreeHugeBlocks(t *testing.T) {
	for _, c := range []struct {
		name, in string
		want     int64
	}{
		{"empty", "", 0},
		{"a fresh VM's", "Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n" +
			"Node 0, zone    DMA32      3      7      6      5      4      6      2      6      8      4    748\n" +
			"Node 0, zone   Normal   7417   8458   5609   3191   1352    490    139     50    160     29   4738\n",
			(1 + 3*2) + (4 + 748*2) + (29 + 4738*2)},
		{"fragmented: nothing of order 9 or more", "Node 0, zone   Normal   7417   8458   5609   3191   1352    490    139     50    160     0      0\n", 0},
		{"two nodes", "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 2 1\nNode 1, zone Normal 0 0 0 0 0 0 0 0 0 3 0\n", 2 + 2 + 3},
		{"a count that is not a number ends its line", "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 2 x 5\n", 2},
		{"a negative count ends its line", "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 -2 1\n", 0},
		{"an absurd count ends its line", "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 2 99999999999999\n", 2},
		{"orders past the kernel's are not counted", "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 1\n", 0},
		{"not a buddyinfo line", "Some 0, other Normal 0 0 0 0 0 0 0 0 0 2 1\nNode 0\n", 0},
	} {
		if got := freeHugeBlocks(c.in); got != c.want {
			t.Errorf("%s: freeHugeBlocks = %d, want %d", c.name, got, c.want)
		}
	}
}

func FuzzFreeHugeBlocks(f *testing.F) {
	f.Add("Node 0, zone   Normal   7417   8458   5609   3191   1352    490    139     50    160     29   4738\n")
	f.Add("Node 0, zone Normal 0 0 0 0 0 0 0 0 0 -2 1 x\nNode")
	f.Fuzz(func(t *testing.T, in string) {
		if n := freeHugeBlocks(in); n < 0 {
			t.Fatalf("freeHugeBlocks(%q) = %d: negative", in, n)
		}
	})
}

// A warm the turn stops (a spare's top-up) ends at once: one piece made
// resident, nothing more allocated or populated.
func TestWarmPiecesStopped(t *testing.T) {
	stop := make(chan struct{})
	close(stop)
	held, huge := warmPieces(64<<20, 1, stop)
	if len(held) > 1 || huge {
		t.Fatalf("a stopped warm held %d pieces (huge %v), want at most the first", len(held), huge)
	}
	letGo(held)
}

// TestWarmHeapStaysResident: a warm heap made with the collector off (a
// spare's, the restore's) stays free and resident until the next
// collection, rather than going back to the system in the background
// (the runtime's scavenger handed half the spares' warm heaps back before
// their turn). In a child process: the heap's metrics are the process's.
func TestWarmHeapStaysResident(t *testing.T) {
	if os.Getenv("KVPOOL_WARMHEAP_KEEP_CHILD") != "" {
		warmHeapKeepChild(t)
		return
	}
	out := childOutput(t, "TestWarmHeapStaysResident", "KVPOOL_WARMHEAP_KEEP_CHILD")
	var warmed, free0, free1, released0, released1 int64
	found := false
	for _, l := range strings.Split(out, "\n") {
		if i := strings.Index(l, "warmkeep:"); i >= 0 {
			_, err := fmt.Sscan(l[i+len("warmkeep:"):], &warmed, &free0, &free1, &released0, &released1)
			found = err == nil
		}
	}
	if !found {
		t.Fatalf("the child said nothing:\n%s", out)
	}
	if warmed == 0 {
		t.Skip("the kernel cannot populate a range (MADV_POPULATE_WRITE needs Linux 5.14): warmHeap does nothing here")
	}
	t.Logf("warmed %d MiB: free %d MiB, then %d after %v; released %d MiB, then %d",
		warmed>>20, free0>>20, free1>>20, keepWatch, released0>>20, released1>>20)
	if free0 < warmed*3/4 {
		t.Fatalf("%d MiB of the %d MiB warmed free at once", free0>>20, warmed>>20)
	}
	if free1 < free0-warmPiece || released1 > released0+warmPiece {
		t.Fatalf("the warm heap went back to the system: free %d -> %d MiB, released %d -> %d MiB in %v",
			free0>>20, free1>>20, released0>>20, released1>>20, keepWatch)
	}
}

// keepWatch is how long the child watches its warm heap: the scavenger
// handed 60 MiB back within a second or two where it was let.
const keepWatch = 4 * time.Second

func warmHeapKeepChild(t *testing.T) {
	// As a spare: the collector off, collections where it says, some of
	// the heap live.
	debug.SetGCPercent(-1)
	live := make([][]byte, 16)
	for i := range live {
		live[i] = make([]byte, 1<<20)
	}
	runtime.GC()
	runtime.GC()
	warmed, _ := warmHeap(64 << 20)
	// The spare's reads collect their garbage now and then: the runtime
	// hands back only pages free for a collection or two.
	for range 3 {
		garbage := make([][]byte, 64)
		for i := range garbage {
			garbage[i] = make([]byte, 64<<10)
		}
		runtime.KeepAlive(garbage)
		collectKeeping(holdFree())
	}
	free0, released0 := heapFree(), heapMetric("/memory/classes/heap/released:bytes")
	free1, released1 := free0, released0
	for end := time.Now().Add(keepWatch); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		free1, released1 = min(free1, heapFree()), max(released1, heapMetric("/memory/classes/heap/released:bytes"))
	}
	runtime.KeepAlive(live)
	t.Logf("warmkeep: %d %d %d %d %d", warmed, free0, free1, released0, released1)
}
