package metrics

import (
	"fmt"
	"io"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

// The server calls Op once per socket call, so its cost is compared with a
// floor in the same run: an atomic add (what the cheapest possible counting
// would cost).
func BenchmarkOp(b *testing.B) {
	op := observe.Op{Name: observe.OpOffload, GPU: 1, Duration: 12 * time.Microsecond, Pages: 16, Bytes: 16 << 20}
	bad := observe.Op{Name: observe.OpReload, GPU: 1, Duration: 3 * time.Microsecond, Err: fmt.Errorf("r: %w", poolerr.ErrUnknownStream)}
	m := New(pool.New(), Options{NoRuntime: true})
	ring := report.NewRing(64)
	var n atomic.Int64
	for _, c := range []struct {
		name string
		obs  observe.Observer
		op   observe.Op
	}{
		{"floor-atomic", observe.Func(func(observe.Op) { n.Add(1) }), op},
		{"metrics", m, op},
		{"metrics+ring", observe.Multi(m, ring), op},
		{"metrics+ring-error", observe.Multi(m, ring), bad},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				c.obs.Op(c.op)
			}
		})
	}
}

// A scrape of a node with 2 GPUs, 512 chunks and 64 sessions, compared with
// the floor of listing the chunks alone.
func BenchmarkScrape(b *testing.B) {
	p := pool.New()
	for i := range 512 {
		if err := p.AddChunk(pool.Chunk{ID: fmt.Sprintf("gpu%d-numa0-%d", i%2, i), GPU: i % 2, Size: 1 << 20}); err != nil {
			b.Fatal(err)
		}
	}
	for a := range 64 {
		ids := []string{fmt.Sprintf("gpu%d-numa0-%d", a%2, a), fmt.Sprintf("gpu%d-numa0-%d", a%2, a+128)}
		// chunk a and a+128 are on the same GPU (a%2 == (a+128)%2).
		ids[0] = fmt.Sprintf("gpu%d-numa0-%d", a%2, a)
		ids[1] = fmt.Sprintf("gpu%d-numa0-%d", (a+128)%2, a+128)
		alloc := fmt.Sprintf("pod-%d", a)
		if err := p.Grant(alloc, ids); err != nil {
			b.Fatal(err)
		}
		if _, err := p.Open(alloc, pool.Spec{GPU: a % 2, PageSize: 64 << 10, DevicePages: 64}); err != nil {
			b.Fatal(err)
		}
	}
	m := New(p, Options{NoRuntime: true})
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	b.Run("floor-chunks", func(b *testing.B) {
		for b.Loop() {
			_ = p.Chunks()
		}
	})
	b.Run("gather", func(b *testing.B) {
		for b.Loop() {
			if _, err := m.Registry().Gather(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("http", func(b *testing.B) {
		for b.Loop() {
			resp, err := srv.Client().Get(srv.URL)
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
}
