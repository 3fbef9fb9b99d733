package books

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// The bounds of one session's stream table at the defaults
// (server.DefaultLimits): streams, and request ID plus label bytes.
var (
	limStreams = server.DefaultLimits.MaxStreamsPerSession
	limNames   = server.DefaultLimits.MaxNameBytesPerSession
)

// atLimits journals sessions sessions into fresh books, each at both
// bounds of its stream table: limStreams streams of one page whose request
// ID and label take limNames bytes in all (the worst case the limits
// allow for names), with distinct request IDs (one map entry each). It
// returns the pool and the books.
func atLimits(tb testing.TB, sessions int, withBooks bool) (*pool.Pool, *Books, *memStore) {
	tb.Helper()
	p := pool.New()
	store := &memStore{}
	var b *Books
	if withBooks {
		var err error
		b, err = Start(NewState(), 0, store, func(err error) { tb.Errorf("fatal: %v", err) })
		must(tb, err)
		p.SetJournal(b)
	}
	perName := int(limNames) / limStreams // 128 bytes: rid and a 2-byte label
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
		for s := range limStreams {
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
		if u := ps.Usage(); u.Streams != limStreams || u.NameBytes != limNames {
			tb.Fatalf("session at %d streams and %d name bytes, want %d and %d", u.Streams, u.NameBytes, limStreams, limNames)
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

// BenchmarkRestoreAtLimits is what an agent restart costs per session at
// the bounds of its stream table: the books of two such sessions are
// replayed (Load), the pool rebuilt from them (pool.Restore) and the books
// compacted into a fresh memfd (Start), as the agent's keeper step does.
// It reports the time per session and the heap the restored pool and books
// keep per session, beside what the same sessions cost a live pool without
// books (the pool alone) and the size of the snapshot.
//
//	go test -run XXX -bench RestoreAtLimits -benchtime 3x ./internal/books/
func BenchmarkRestoreAtLimits(b *testing.B) {
	const sessions = 2
	base := heapInUse()
	p, _, _ := atLimits(b, sessions, false)
	live := heapInUse() - base
	runtime.KeepAlive(p)
	p = nil
	_, bk, store := atLimits(b, sessions, true)
	bk.Close()
	bk = nil
	var restored int64
	var snap float64
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		empty := heapInUse()
		b.StartTimer()
		t0 := time.Now()
		st, info, err := Load(store.f)
		must(b, err)
		p2 := pool.New()
		ss, err := p2.Restore(st.Image())
		must(b, err)
		b2, err := Start(st, info.Gen, store, nil)
		must(b, err)
		snap = float64(b2.Stats().Snapshot)
		p2.SetJournal(b2)
		rs := st.Restored(ss)
		took := time.Since(t0)
		b.StopTimer()
		restored = heapInUse() - empty
		runtime.KeepAlive(p2)
		runtime.KeepAlive(rs)
		b2.Close()
		b.ReportMetric(took.Seconds()*1000/sessions, "restore-ms/session")
		b.StartTimer()
	}
	b.StopTimer()
	mib := func(n int64) float64 { return float64(n) / (1 << 20) / sessions }
	b.ReportMetric(mib(restored), "restored-MiB/session")
	b.ReportMetric(mib(live), "live-pool-MiB/session")
	b.ReportMetric(snap/(1<<20)/sessions, "snapshot-MiB/session")
}
