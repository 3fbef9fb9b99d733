package books

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// The bounds of the stream tables at the defaults (server.DefaultLimits):
// one session's streams and request ID plus label bytes, and every
// session's together.
var (
	limStreams   = server.DefaultLimits.MaxStreamsPerSession
	limNames     = server.DefaultLimits.MaxNameBytesPerSession
	limAllStream = server.DefaultLimits.MaxStreams
	limAllNames  = server.DefaultLimits.MaxNameBytes
)

// atLimits journals sessions sessions into fresh books (none when
// withBooks is false), each of streams streams of one page whose request
// IDs and labels take names bytes in all, with distinct request IDs (one
// map entry each). It returns the pool and the books.
func atLimits(tb testing.TB, sessions, streams int, names int64, withBooks bool) (*pool.Pool, *Books, *memStore) {
	tb.Helper()
	p := pool.New()
	store := &memStore{}
	var b *Books
	if withBooks {
		// The log compacts in line as it fills, so that the books hold
		// the same snapshot and records whatever the machine's timing
		// (compacted aside, a faster fill left fewer streams in the
		// snapshot and more in records, and its restore looked slower).
		inLine = true
		defer func() { inLine = false }()
		var err error
		b, err = Start(NewState(), 0, store, func(err error) { tb.Errorf("fatal: %v", err) })
		must(tb, err)
		p.SetJournal(b)
	}
	perName := int(names) / streams // a rid and a 2-byte label
	seq := uint32(0)
	for i := range sessions {
		id := fmt.Sprintf("chunk-%d", i)
		must(tb, p.AddChunk(pool.Chunk{ID: id, Size: 1 << 30}))
		if b != nil {
			must(tb, b.ChunkGen(id, 1, 0))
		}
		alloc := fmt.Sprintf("alloc-%d", i)
		must(tb, p.Grant(alloc, []string{id}))
		ps, err := p.Open(alloc, pool.Spec{PageSize: 4096, DevicePages: 1024})
		must(tb, err)
		if b != nil {
			info := &server.OpenInfo{Allocation: alloc, Instance: fmt.Sprintf("%032x", i), UUID: "GPU-sim-00000000", Regions: 1,
				Image: pool.SessionImage{ID: ps.ID(), Allocation: alloc, Spec: ps.Spec(), Chunks: []string{id}, PPC: ps.PagesPerChunk(), Capacity: ps.Capacity()}}
			must(tb, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOpen, Open: info}))
		}
		pad := strings.Repeat("r", perName-2-8)
		for s := range streams {
			rid := fmt.Sprintf("%s%08x", pad, s)
			m := pool.Meta{StoredLen: int64(s), Position: int64(s)}
			pages, err := ps.Offload(rid, "kv", []int32{int32(s % 1024)}, m, nil)
			must(tb, err)
			if b != nil {
				seq++
				must(tb, b.Session(server.SessionOp{Session: ps.ID(), Op: wire.OpOffload, Seq: seq, Rid: rid, Label: "kv", Meta: m, Pages: pages,
					Reply: []byte{8, 1}}))
			}
		}
		if u := ps.Usage(); u.Streams != streams || u.NameBytes != int64(streams*perName) {
			tb.Fatalf("session at %d streams and %d name bytes, want %d and %d", u.Streams, u.NameBytes, streams, streams*perName)
		}
	}
	return p, b, store
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// BenchmarkRestoreAtLimits is what an agent restart costs at the bounds
// of the stream tables: the books are replayed (Load), the pool rebuilt
// from them (pool.Restore) and the books compacted into a fresh memfd
// (Start), as the agent's keeper step does. "session" is two sessions at
// one session's bounds (2^17 streams and 16 MiB of names each, 128 bytes
// a stream), "agent" the agent's bounds for every session together (2^19
// streams and 32 MiB of names, in four sessions). It reports the time, the
// heap the restored pool and books keep, what the same sessions cost a
// live pool (the books keep nothing in the heap), the snapshot and the
// books memfd, per session and in all.
//
//	go test -run XXX -bench RestoreAtLimits -benchtime 2x ./internal/books/
func BenchmarkRestoreAtLimits(b *testing.B) {
	b.Run("session", func(b *testing.B) { benchRestore(b, 2, limStreams, limNames) })
	b.Run("agent", func(b *testing.B) { benchRestore(b, 4, limAllStream/4, limAllNames/4) })
	// kvbench restart's shape: one session at the stream bound, with short
	// request IDs (11 bytes and a 2-byte label a stream).
	b.Run("probe", func(b *testing.B) { benchRestore(b, 1, limStreams, int64(limStreams)*13) })
	// And four such sessions: kvbench restart at the agent's bound
	// (--streams 4,524288 --sessions 4).
	b.Run("probe-agent", func(b *testing.B) { benchRestore(b, 4, limStreams, int64(limStreams)*13) })
	// The same after the books were compacted while quiet (a snapshot
	// alone): what a restart replays once the agent had a second with
	// nothing to record.
	b.Run("agent-compacted", func(b *testing.B) { benchRestoreOf(b, 4, limAllStream/4, limAllNames/4, true) })
	b.Run("probe-compacted", func(b *testing.B) { benchRestoreOf(b, 1, limStreams, int64(limStreams)*13, true) })
}

func benchRestore(b *testing.B, sessions, streams int, names int64) {
	benchRestoreOf(b, sessions, streams, names, false)
}

func benchRestoreOf(b *testing.B, sessions, streams int, names int64, compacted bool) {
	base := heapInUse()
	p, _, _ := atLimits(b, sessions, streams, names, false)
	live := heapInUse() - base
	runtime.KeepAlive(p)
	_, bk, store := atLimits(b, sessions, streams, names, true)
	if compacted {
		must(b, bk.Rehand(store))
		if s := bk.Stats(); s.LogBytes != headerSize+s.Snapshot {
			b.Fatalf("%d bytes of log after a snapshot of %d", s.LogBytes, s.Snapshot)
		}
	}
	bk.Close()
	bk = nil
	var restored int64
	var snap, memfd float64
	var took, cpu time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		empty := heapInUse()
		// The restore's figures depend on the free heap the setup left
		// resident (its garbage, collected above but not handed back), as
		// an agent's restore on its warm heap: a build whose fill leaves
		// less garbage faults more pages in here. Builds whose fills
		// differ are compared with a debug.FreeOSMemory() here, which
		// makes every page fresh (docs/benchmarks.md, "The request IDs in
		// blocks").
		b.StartTimer()
		t0, c0 := time.Now(), cpuTime()
		st, info, err := Load(store.f)
		must(b, err)
		p2 := pool.New()
		ss, err := p2.Restore(st.Image())
		must(b, err)
		b2, err := Start(st, info.Gen, store, nil)
		must(b, err)
		p2.SetJournal(b2)
		rs := st.Restored(ss)
		took, cpu = time.Since(t0), cpuTime()-c0
		b.StopTimer()
		st = nil
		restored = heapInUse() - empty
		runtime.KeepAlive(p2)
		runtime.KeepAlive(rs)
		s := b2.Stats()
		snap, memfd = float64(s.Snapshot), float64(s.Capacity)
		b2.Close()
		b.StartTimer()
	}
	b.StopTimer()
	mib := func(n float64) float64 { return n / (1 << 20) }
	per := float64(sessions)
	b.ReportMetric(took.Seconds(), "restore-s")
	b.ReportMetric(took.Seconds()*1000/per, "restore-ms/session")
	// The process's CPU time (the collector's included): what the
	// restore costs, less moved by other load on the machine than its
	// wall time.
	b.ReportMetric(cpu.Seconds()*1000/per, "restore-cpu-ms/session")
	b.ReportMetric(mib(float64(restored))/per, "restored-MiB/session")
	b.ReportMetric(mib(float64(live))/per, "live-pool-MiB/session")
	b.ReportMetric(mib(snap)/per, "snapshot-MiB/session")
	b.ReportMetric(mib(memfd), "books-memfd-MiB")
	b.ReportMetric(float64(restored)/float64(sessions*streams), "restored-B/stream")
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkDecodeQueued decodes the session ops of kvbench restart's
// books (one session at the stream bound), as a replay's lanes do: the
// decoding took about 60 % of the CPU the agent spent on a large session's
// queued records (perf, docs/benchmarks.md).
func BenchmarkDecodeQueued(b *testing.B) {
	_, bk, store := atLimits(b, 1, limStreams, int64(limStreams)*13, true)
	bk.Close()
	mem := snapshotMem(b, store.f)
	var payloads [][]byte
	for off := uint64(headerSize); off+8 <= uint64(len(mem)); {
		n := uint64(binary.LittleEndian.Uint32(mem[off:]))
		if n == 0 {
			break
		}
		if p := mem[off+8 : off+8+n]; p[0] == recSession {
			payloads = append(payloads, p)
		}
		off += 8 + (n+3)&^3 + 4
	}
	labels := map[string]string{}
	ar := &arena{}
	b.ResetTimer()
	for b.Loop() {
		for _, p := range payloads {
			if _, err := decodeQueued(p, labels, ar); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(payloads)), "ns/record")
}

// BenchmarkLoadProbe replays kvbench restart's books as the agent keeps
// them: one session at the stream bound, and four (the agent's bound, each
// decoded and applied on its own goroutine, GOMAXPROCS at a time); records
// after an empty snapshot (the probe's), and the same state compacted into a
// snapshot (what a restart finds after enough churn).
func BenchmarkLoadProbe(b *testing.B) {
	for _, sessions := range []int{1, 4} {
		for _, compacted := range []bool{false, true} {
			name := map[bool]string{false: "records", true: "snapshot"}[compacted]
			b.Run(fmt.Sprintf("sessions=%d/%s", sessions, name), func(b *testing.B) {
				_, bk, store := atLimits(b, sessions, limStreams, int64(limStreams)*13, true)
				if compacted {
					bk.mu.Lock()
					st, err := bk.stateLocked()
					must(b, err)
					must(b, bk.compactLocked(st, 0))
					bk.mu.Unlock()
				}
				bk.Close()
				for b.Loop() {
					st, _, err := Load(store.f)
					must(b, err)
					if st.Streams() != sessions*limStreams {
						b.Fatalf("%d streams", st.Streams())
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*sessions*limStreams), "ns/stream")
			})
		}
	}
}

// BenchmarkAppendWhileCompacting appends changes (a one-page offload of a
// new request, then its removal, in turn) to books holding the agent's
// bound of streams (four sessions at one session's bound) until the log has
// compacted a few times, and reports how long the slowest appends took:
// with the compaction in line (as before it ran aside) a change that fills
// the log waits for the whole replay and snapshot, and every other
// session's change waits behind it; aside, only the copy of the records
// appended meanwhile and the hand-over hold them up.
//
//	go test -run XXX -bench AppendWhileCompacting -benchtime 2000000x ./internal/books/
func BenchmarkAppendWhileCompacting(b *testing.B) {
	for _, mode := range []string{"inline", "aside"} {
		b.Run(mode, func(b *testing.B) {
			defer func(old bool) { inLine = old }(inLine)
			inLine = mode == "inline"
			_, bk, _ := atLimits(b, 4, limAllStream/4, int64(limAllStream/4)*13, true)
			bk.settle()
			c0 := bk.Stats().Compactions
			took := make([]time.Duration, b.N)
			seq := uint32(1 << 30)
			b.ResetTimer()
			for i := range b.N {
				seq++
				op := server.SessionOp{Session: uint64(1 + i%4), Seq: seq, Rid: fmt.Sprintf("churn-%07x", i/2), Reply: []byte{8, 1}}
				if i%2 == 0 {
					op.Op, op.Label, op.Pages = wire.OpOffload, "kv", []int32{int32(i % 1024)}
				} else {
					op.Op = wire.OpRemoveRequest
				}
				t0 := time.Now()
				if err := bk.Session(op); err != nil {
					b.Fatal(err)
				}
				took[i] = time.Since(t0)
			}
			b.StopTimer()
			bk.Close()
			slices.Sort(took)
			at := func(q float64) float64 { return float64(took[int(q*float64(len(took)-1))].Nanoseconds()) / 1e3 }
			b.ReportMetric(at(0.5), "p50-µs")
			b.ReportMetric(at(0.99), "p99-µs")
			b.ReportMetric(at(0.999), "p99.9-µs")
			b.ReportMetric(at(1), "max-µs")
			b.ReportMetric(float64(bk.Stats().Compactions-c0), "compactions")
		})
	}
}
