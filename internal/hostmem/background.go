package hostmem

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/kvpool/kvpool/internal/bytesize"
)

// Spec is one chunk to allocate in the background.
type Spec struct {
	ID  string
	GPU int // whose share of the pool the chunk is (the caller's; hostmem does not use it)
	Options
}

// Result reports one chunk: ready (Chunk set) or failed (Err set).
type Result struct {
	ID    string
	Chunk *Chunk
	Err   error
	Done  int // chunks finished so far, this one included
	Total int // chunks asked for
	// Lane is the NUMA node the chunk was allocated for (-1: unbound);
	// Took is how long its Alloc took (on its lane, alongside the others).
	Lane int
	Took time.Duration
}

// lane is the NUMA node a spec's chunk goes to, -1 for an unbound chunk.
func lane(s Spec) int {
	if s.Bind {
		return s.Node
	}
	return -1
}

// AllocateAll allocates specs on background goroutines and sends each
// chunk on the returned channel as soon as it is ready, so callers can use
// chunks one by one. The chunks of each NUMA node (one lane per node the
// specs bind to, and one for unbound specs) are allocated in their order in
// specs, one at a time, each pre-faulted by its own Workers; the lanes run
// side by side, so a node with several NUMA nodes pins them all at once.
// The first failure (sent as a Result with Err) stops every lane: chunks
// still being allocated then are freed, not sent. Cancelling ctx stops
// each lane before its next chunk. The channel is closed when every lane
// has stopped. It is buffered for every spec: a slow reader never stalls
// allocation, and chunks it never reads stay open (the reader owns every
// Chunk it is sent). Progress is logged to log (nil: slog.Default()) about
// every tenth of the work.
func AllocateAll(ctx context.Context, specs []Spec, log *slog.Logger) <-chan Result {
	if log == nil {
		log = slog.Default()
	}
	out := make(chan Result, len(specs))
	lanes := map[int][]Spec{}
	var order []int
	var total int64
	for _, s := range specs {
		l := lane(s)
		if _, ok := lanes[l]; !ok {
			order = append(order, l)
		}
		lanes[l] = append(lanes[l], s)
		total += s.Size
	}
	r := &run{out: out, log: log, total: len(specs), start: time.Now(), step: max(len(specs)/10, 1)}
	log.Info("allocating pool chunks", "chunks", len(specs), bytesize.Attr("bytes", total), "lanes", len(order))
	var wg sync.WaitGroup
	for _, l := range order {
		wg.Go(func() { r.lane(ctx, l, lanes[l]) })
	}
	go func() {
		wg.Wait()
		close(out)
	}()
	return out
}

// run is one AllocateAll: what its lanes share.
type run struct {
	out   chan<- Result
	log   *slog.Logger
	total int
	start time.Time
	step  int

	mu      sync.Mutex
	done    int   // results sent
	bytes   int64 // bytes of the chunks sent
	stopped bool  // a lane failed
}

// lane allocates one NUMA node's specs in order.
func (r *run) lane(ctx context.Context, l int, specs []Spec) {
	for _, s := range specs {
		if ctx.Err() != nil {
			r.log.Warn("chunk allocation stopped", "lane", l, "err", ctx.Err())
			return
		}
		if r.isStopped() {
			return
		}
		t := time.Now()
		c, err := Alloc(s.Options)
		if !r.send(Result{ID: s.ID, Chunk: c, Err: err, Lane: l, Took: time.Since(t)}) {
			return
		}
	}
}

func (r *run) isStopped() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopped
}

// send hands one result to the reader, or frees its chunk when another
// lane failed meanwhile; false: the lane stops.
func (r *run) send(res Result) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		if res.Chunk != nil {
			res.Chunk.Close()
		}
		return false
	}
	r.done++
	res.Done, res.Total = r.done, r.total
	if res.Err != nil {
		r.stopped = true
		r.log.Error("chunk allocation failed", "chunk", res.ID, "lane", res.Lane, "ready", r.done-1, "of", r.total, "err", res.Err)
		r.out <- res
		return false
	}
	c := res.Chunk
	for _, w := range c.Warnings {
		r.log.Warn("chunk allocated with a fallback", "chunk", res.ID, "warning", w)
	}
	r.bytes += c.Size
	r.out <- res
	r.log.Debug("chunk ready", "chunk", res.ID, bytesize.Attr("bytes", c.Size), bytesize.Attr("pageSize", c.PageSize),
		"node", c.Node, "locked", c.Locked, "took", res.Took.Round(time.Microsecond))
	if r.done%r.step == 0 || r.done == r.total {
		secs := time.Since(r.start).Seconds()
		r.log.Info("pool allocation progress", "ready", r.done, "of", r.total,
			bytesize.Attr("bytes", r.bytes), bytesize.Attr("perSecond", int64(float64(r.bytes)/max(secs, 1e-9))))
	}
	return true
}
