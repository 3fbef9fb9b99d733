package hostmem

import (
	"context"
	"log/slog"
	"time"

	"github.com/kvpool/kvpool/internal/bytesize"
)

// Spec is one chunk to allocate in the background.
type Spec struct {
	ID string
	Options
}

// Result reports one chunk: ready (Chunk set) or failed (Err set).
type Result struct {
	ID    string
	Chunk *Chunk
	Err   error
	Done  int // chunks finished so far, this one included
	Total int // chunks asked for
}

// AllocateAll allocates specs in order on a background goroutine, one chunk
// at a time (each pre-faulted by its own Workers), and sends each chunk on
// the returned channel as soon as it is ready, so callers can use chunks
// one by one. It stops at the first failure (sent as a Result with Err) or
// when ctx is done; the channel is then closed. The channel is buffered
// for every spec: a slow reader never stalls allocation, and chunks it
// never reads stay open (the reader owns every Chunk it is sent). Progress
// is logged to log (nil: slog.Default()) about every tenth of the work.
func AllocateAll(ctx context.Context, specs []Spec, log *slog.Logger) <-chan Result {
	if log == nil {
		log = slog.Default()
	}
	out := make(chan Result, len(specs))
	go func() {
		defer close(out)
		var total, done int64
		for _, s := range specs {
			total += s.Size
		}
		start := time.Now()
		step := max(len(specs)/10, 1)
		log.Info("allocating pool chunks", "chunks", len(specs), bytesize.Attr("bytes", total))
		for i, s := range specs {
			if ctx.Err() != nil {
				log.Warn("chunk allocation stopped", "ready", i, "of", len(specs), "err", ctx.Err())
				return
			}
			c, err := Alloc(s.Options)
			if err != nil {
				log.Error("chunk allocation failed", "chunk", s.ID, "ready", i, "of", len(specs), "err", err)
				out <- Result{ID: s.ID, Err: err, Done: i + 1, Total: len(specs)}
				return
			}
			for _, w := range c.Warnings {
				log.Warn("chunk allocated with a fallback", "chunk", s.ID, "warning", w)
			}
			done += s.Size
			out <- Result{ID: s.ID, Chunk: c, Done: i + 1, Total: len(specs)}
			log.Debug("chunk ready", "chunk", s.ID, bytesize.Attr("bytes", s.Size), bytesize.Attr("pageSize", int64(c.PageSize)), "node", c.Node, "locked", c.Locked)
			if (i+1)%step == 0 || i+1 == len(specs) {
				secs := time.Since(start).Seconds()
				log.Info("pool allocation progress", "ready", i+1, "of", len(specs),
					bytesize.Attr("bytes", done), bytesize.Attr("perSecond", int64(float64(done)/max(secs, 1e-9))))
			}
		}
	}()
	return out
}
