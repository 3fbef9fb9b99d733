package pool

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// benchSession opens a session of pages host pages of 4 KiB over 4,096
// device pages, fills it with `others` streams of 8 pages each, and returns it
// with the bytes its bookkeeping uses per host page (its heap, and the
// touched pages of its mapped links).
func benchSession(b testing.TB, pages, others int) (*Session, float64) {
	b.Helper()
	const pageSize = 4 << 10
	p := benchPool(b, pages, pageSize)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s, err := p.Open("bench", Spec{GPU: 0, PageSize: pageSize, DevicePages: 4096, MaxPages: pages})
	if err != nil {
		b.Fatal(err)
	}
	dev := []int32{0, 1, 2, 3, 4, 5, 6, 7}
	dst := make([]int32, 0, 8)
	// Names are made as a server decodes them, a fresh string per call,
	// so that what the stream table keeps of them counts.
	for i := range others {
		if _, err := s.Offload(fmt.Sprintf("req-%07d", i), strings.Clone("kv"), dev, Meta{StoredLen: 100, Position: 100}, dst[:0]); err != nil {
			b.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	// The page links of a large session are mapped outside the heap.
	return s, float64(int64(after.HeapAlloc-before.HeapAlloc)+s.linkBytes()) / float64(pages)
}

// benchPool is a pool whose allocation "bench" holds chunks of 64 MiB,
// enough of them for pages host pages of pageSize bytes.
func benchPool(b testing.TB, pages, pageSize int) *Pool {
	b.Helper()
	const chunkSize = 64 << 20
	p := New()
	var ids []string
	for i := range (pages*pageSize + chunkSize - 1) / chunkSize {
		id := fmt.Sprintf("gpu0-numa0-%d", i)
		if err := p.AddChunk(Chunk{ID: id, Size: chunkSize}); err != nil {
			b.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := p.Grant("bench", ids); err != nil {
		b.Fatal(err)
	}
	return p
}

func benchOffloadReload64(b *testing.B, pages, others int) {
	s, perPage := benchSession(b, pages, others)
	dev := make([]int32, 64)
	for i := range dev {
		dev[i] = int32(4095 - i*3)
	}
	dst := make([]int32, 0, 64)
	meta := Meta{StoredLen: 1000, Position: 1000}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		var err error
		dst, err = s.Offload("bench-rid", "kv", dev, meta, dst[:0])
		if err != nil {
			b.Fatal(err)
		}
		r, err := s.Reload("bench-rid", "kv", dev, dst[:0])
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Fence(r.Ticket); err != nil {
			b.Fatal(err)
		}
		dst = r.Pages
	}
	b.StopTimer()
	b.ReportMetric(perPage, "bytes/page")
	if err := s.Check(); err != nil {
		b.Fatal(err)
	}
}

// maxBytesPerPage is the bar for the pool's bookkeeping at scale: the
// heap a session's books take per host page, with 1,000,000 pages holding
// 100,000 streams of 8 pages (the names counted).
const maxBytesPerPage = 16

// TestBytesPerPage fails when the bookkeeping of a session of 1,000,000
// host pages holding 100,000 streams (8 pages each, request IDs of 11
// bytes made fresh per call as a server decodes them, one label) takes
// more than maxBytesPerPage of heap per page. It measures bytes (the
// heap's growth across the session, after a collection), not time, so it
// is deterministic up to the runtime's map layout.
func TestBytesPerPage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a session of 1,000,000 pages")
	}
	s, perPage := benchSession(t, 1_000_000, 100_000)
	t.Logf("%.2f bytes per page (bar %d)", perPage, maxBytesPerPage)
	if perPage > maxBytesPerPage {
		t.Fatalf("the pool's books take %.2f bytes per host page at 1,000,000 pages and 100,000 streams, over the bar of %d",
			perPage, maxBytesPerPage)
	}
	if u := s.Usage(); u.Streams != 100_000 || u.Used != 800_000 {
		t.Fatalf("usage %+v, want 100000 streams holding 800000 pages", u)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkOffloadReload64 is one offload and one reload (with its fence) of
// a 64-page stream, bookkeeping only, in a pool of 16,384 pages.
func BenchmarkOffloadReload64(b *testing.B) { benchOffloadReload64(b, 16384, 0) }

// BenchmarkOffloadReload64LargePool is the same in a pool of 1,000,000 pages
// that holds 100,000 other streams of 8 pages.
func BenchmarkOffloadReload64LargePool(b *testing.B) { benchOffloadReload64(b, 1_000_000, 100_000) }

// BenchmarkOffloadManyLabels is an offload and a reload of a one-page stream
// of a request that already holds `labels` other streams: with the stream
// index the cost does not grow with the request's stream count (it walked
// every stream of the request before).
func BenchmarkOffloadManyLabels(b *testing.B) {
	for _, labels := range []int{1, 60000} {
		b.Run(fmt.Sprint("labels=", labels), func(b *testing.B) {
			s, _ := benchSession(b, 1<<17, 0)
			for i := range labels {
				if _, err := s.Offload("rid", fmt.Sprint("l", i), []int32{0}, Meta{}, nil); err != nil {
					b.Fatal(err)
				}
			}
			dev, dst := []int32{1}, make([]int32, 0, 1)
			b.ReportAllocs()
			for b.Loop() {
				var err error
				if dst, err = s.Offload("rid", "new", dev, Meta{}, dst[:0]); err != nil {
					b.Fatal(err)
				}
				r, err := s.Reload("rid", "new", dev, dst[:0])
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Fence(r.Ticket); err != nil {
					b.Fatal(err)
				}
				dst = r.Pages
			}
		})
	}
}

// BenchmarkRestore rebuilds sessions of 131,072 streams (one session's
// bound; one page a stream) from their image, as a restarted agent does
// after replaying its books: the "rebuild" phase of its keeper step,
// without the page faults of a fresh process (the heap is the
// benchmark's, warm). A request holds one stream (kvbench restart's
// shape) or `labels` of them, and its ID takes 11 bytes, or 64 (the
// agent's bound on name bytes over as many streams).
//
//	go test -run XXX -bench Restore -count 6 ./pkg/pool/
func BenchmarkRestore(b *testing.B) {
	for _, c := range []struct{ sessions, rid, labels int }{{1, 11, 1}, {4, 11, 1}, {4, 64, 1}, {1, 11, 9}, {1, 11, 80}} {
		sessions, labels := c.sessions, c.labels
		name := fmt.Sprintf("sessions=%d,rid=%d", sessions, c.rid)
		if labels > 1 {
			name += fmt.Sprintf(",labels=%d", labels)
		}
		b.Run(name, func(b *testing.B) {
			const streams = 1 << 17
			p := fullSessions(b, sessions, streams, c.rid, labels)
			img := p.Export()
			for b.Loop() {
				if _, err := New().Restore(img); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*sessions*streams), "ns/stream")
		})
	}
}

// fullSessions is a pool of sessions sessions of streams one-page streams
// each, labels streams a request, the request IDs rid bytes long.
func fullSessions(b *testing.B, sessions, streams, rid, labels int) *Pool {
	pad := strings.Repeat("r", rid-11)
	p := New()
	if streams == 0 {
		return p
	}
	for i := range sessions {
		id := fmt.Sprintf("c%d", i)
		must(b, p.AddChunk(Chunk{ID: id, Size: int64(streams) * 64}))
		must(b, p.Grant(id, []string{id}))
		s, err := p.Open(id, Spec{PageSize: 64, DevicePages: 64})
		must(b, err)
		for j := range streams {
			label := "k"
			if labels > 1 {
				label = fmt.Sprintf("layer.%d", j%labels)
			}
			_, err := s.Offload(fmt.Sprintf("%sreq-%07d", pad, j/labels), label, []int32{int32(j % 64)}, Meta{StoredLen: int64(j)}, nil)
			must(b, err)
		}
	}
	return p
}

// BenchmarkOffloadRemove offloads a one-page stream of a new request and
// removes the request again, in a session holding 20,000 others, the new
// request one of 8,192 in turn, its ID a fresh string as a server decodes
// it: the request index's insertion and deletion (with its backward
// shift), with the table and the IDs past the caches' first level.
func BenchmarkOffloadRemove(b *testing.B) {
	s, _ := benchSession(b, 200_000, 20_000)
	rids := make([]string, 8192)
	for i := range rids {
		rids[i] = fmt.Sprintf("bench-rid-%04d", i)
	}
	dev, dst := []int32{7}, make([]int32, 0, 1)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		rid := strings.Clone(rids[i%len(rids)])
		i++
		if _, err := s.Offload(rid, "kv", dev, Meta{StoredLen: 16, Position: 16}, dst[:0]); err != nil {
			b.Fatal(err)
		}
		if n, err := s.RemoveRequest(rid); n != 1 || err != nil {
			b.Fatal(n, err)
		}
	}
	b.StopTimer()
	if err := s.Check(); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkCollect is one collection of the heap while the pool holds four
// sessions of 131,072 streams each (one page a stream, request IDs of 11
// bytes made fresh per call, as a server decodes them), a request holding
// one stream or 9: what the pool's tables add to each collection an agent
// at its bound makes, against the same collection with the pool empty
// ("empty").
//
//	go test -run XXX -bench Collect -count 6 ./pkg/pool/
func BenchmarkCollect(b *testing.B) {
	for _, c := range []struct{ streams, labels int }{{0, 1}, {1 << 17, 1}, {1 << 17, 9}} {
		name := "empty"
		if c.streams > 0 {
			name = fmt.Sprintf("sessions=4,streams=%d,labels=%d", c.streams, c.labels)
		}
		b.Run(name, func(b *testing.B) {
			p := fullSessions(b, 4, c.streams, 11, c.labels)
			runtime.GC()
			for b.Loop() {
				runtime.GC()
			}
			runtime.KeepAlive(p)
		})
		if c.streams == 0 {
			continue
		}
		// The same sessions restored (as after an agent's restart).
		b.Run(name+",restored", func(b *testing.B) {
			q := New()
			if _, err := q.Restore(fullSessions(b, 4, c.streams, 11, c.labels).Export()); err != nil {
				b.Fatal(err)
			}
			runtime.GC()
			for b.Loop() {
				runtime.GC()
			}
			runtime.KeepAlive(q)
		})
	}
}

// BenchmarkFillToTheBound fills a fresh session with 131,072 streams of 2
// pages each (one session's bound of streams), one offload at a time as a
// server makes them: in requests of one stream with 128-byte IDs (the
// longest IDs the benchmarks use: the request index at its largest), and
// in requests of 80 streams (a stream a layer: the label index at its
// largest). An op is one offload; slowest-ms is the slowest single
// offload, over-1ms/fill how many took a millisecond or more in a fill:
// what a caller (and every caller of that session, behind its lock) waits
// when a table grows. Later fills reuse the heap the first one faulted in;
// -benchtime 131072x is one fill, on a fresh heap.
func BenchmarkFillToTheBound(b *testing.B) {
	for _, per := range []int{1, 80} {
		b.Run(fmt.Sprint("labels=", per), func(b *testing.B) { benchFill(b, per) })
	}
}

func benchFill(b *testing.B, per int) {
	labels := make([]string, per)
	for i := range labels {
		labels[i] = fmt.Sprint("layer-", i)
	}
	dev, dst := []int32{0, 1}, make([]int32, 0, 2)
	benchEachCall(b, per, "over-1ms/fill", nil, func(s *Session, rid string, i int) error {
		_, err := s.Offload(rid, labels[i%per], dev, Meta{StoredLen: 1}, dst[:0])
		return err
	})
}

// BenchmarkDrainFromTheBound fills a session with 131,072 requests of one
// 2-page stream and 128-byte IDs (untimed), then removes them one at a
// time (remove_request), as an engine's finished requests go: an op is one
// removal; slowest-ms and over-1ms/drain as in BenchmarkFillToTheBound.
func BenchmarkDrainFromTheBound(b *testing.B) {
	fill := func(s *Session, rids []string) {
		for _, rid := range rids {
			if _, err := s.Offload(rid, "kv", []int32{0, 1}, Meta{StoredLen: 1}, nil); err != nil {
				b.Fatal(err)
			}
		}
	}
	benchEachCall(b, 1, "over-1ms/drain", fill, func(s *Session, rid string, _ int) error {
		_, err := s.RemoveRequest(rid)
		return err
	})
}

// benchEachCall times call once for each of one session's bound of
// streams (131,072, in requests of per streams with 128-byte IDs: call i
// is given the i-th stream's request ID), on a fresh session each round
// that prepare, when given, readies untimed. It reports the slowest call
// (slowest-ms) and how many a round took a millisecond or more (unit).
func benchEachCall(b *testing.B, per int, unit string, prepare func(s *Session, rids []string), call func(s *Session, rid string, i int) error) {
	const streams, pageSize = 131072, 4 << 10
	pages := 2 * streams
	p := benchPool(b, pages, pageSize)
	rids := make([]string, streams)
	for i := range rids {
		rids[i] = fmt.Sprintf("%0128d", i/per)
	}
	var slowest time.Duration
	over := 0
	b.ResetTimer()
	for done := 0; done < b.N; {
		b.StopTimer()
		s, err := p.Open("bench", Spec{PageSize: pageSize, DevicePages: 64, MaxPages: pages})
		if err != nil {
			b.Fatal(err)
		}
		if prepare != nil {
			prepare(s, rids)
		}
		runtime.GC()
		b.StartTimer()
		for i := 0; i < streams && done < b.N; i, done = i+1, done+1 {
			t0 := time.Now()
			if err := call(s, rids[i], i); err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			slowest = max(slowest, d)
			if d >= time.Millisecond {
				over++
			}
		}
		b.StopTimer()
		p.Close(s)
		b.StartTimer()
	}
	b.ReportMetric(float64(slowest.Microseconds())/1000, "slowest-ms")
	b.ReportMetric(float64(over)*streams/float64(b.N), unit)
}
