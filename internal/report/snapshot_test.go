package report

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/poolerr"
)

func TestKind(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{errors.New("boom"), "other"},
		{fmt.Errorf("offload: %w", poolerr.ErrFull), "full"},
		{&pool.PendingError{Ticket: 3}, "pending"},
		{fmt.Errorf("x: %w", poolerr.ErrUnknownStream), "unknown_stream"},
		{fmt.Errorf("y: %w", poolerr.ErrBadName), "bad_name"},
		{fmt.Errorf("z: %w", kindErr("bad_token")), "bad_token"},
	} {
		if got := Kind(c.err); got != c.want {
			t.Errorf("Kind(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

type kindErr string

func (k kindErr) Error() string { return string(k) }
func (k kindErr) Kind() string  { return string(k) }

func TestRing(t *testing.T) {
	r := NewRing(3)
	if got := r.Entries(); len(got) != 0 {
		t.Fatalf("empty ring: %v", got)
	}
	r.Op(observe.Op{Name: "offload"})                                            // success: skipped
	r.Op(observe.Op{Name: "offload", Err: fmt.Errorf("o: %w", poolerr.ErrFull)}) // reject: skipped
	r.Op(observe.Op{Name: "offload", Err: &pool.PendingError{}})                 // reject: skipped
	r.Error("plugin", nil)                                                       // nil: skipped
	for i := range 5 {
		r.Error("plugin", fmt.Errorf("e%d", i))
	}
	got := r.Entries()
	if len(got) != 3 || got[0].Message != "e2" || got[2].Message != "e4" || got[0].Component != "plugin" || got[0].Time.IsZero() {
		t.Fatalf("entries = %+v", got)
	}
	if r.Total() != 5 {
		t.Fatalf("total = %d, want 5", r.Total())
	}
	r.Op(observe.Op{Name: "reload", Session: "podA", Err: fmt.Errorf("r: %w", poolerr.ErrUnknownStream)})
	got = r.Entries()
	if last := got[len(got)-1]; last.Op != "reload" || last.Kind != "unknown_stream" || last.Session != "podA" || last.Component != "server" {
		t.Fatalf("last = %+v", last)
	}
	if got[0].Message != "e3" {
		t.Fatalf("oldest = %+v, want e3", got[0])
	}
}

func TestTakeAndServe(t *testing.T) {
	p := pool.New()
	for i, c := range []pool.Chunk{
		{ID: "gpu0-numa0-0", GPU: 0, NUMA: 0, Size: 1 << 20},
		{ID: "gpu0-numa0-1", GPU: 0, NUMA: 0, Size: 1 << 20},
		{ID: "gpu1-numaX-0", GPU: 1, NUMA: -1, Size: 2 << 20},
		{ID: "gpu2-numa1-0", GPU: 2, NUMA: 1, Size: 1 << 20},
	} {
		if err := p.AddChunk(c); err != nil {
			t.Fatal(i, err)
		}
	}
	if err := p.Grant("pod", []string{"gpu0-numa0-0", "gpu0-numa0-1"}); err != nil {
		t.Fatal(err)
	}
	s, err := p.Open("pod", pool.Spec{GPU: 0, PageSize: 1 << 18, DevicePages: 8, MaxPages: 6})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Offload("r", "k", []int32{0, 1, 2}, pool.Meta{}, nil); err != nil {
		t.Fatal(err)
	}
	// A pod on GPU 0 (node 0) whose chunk kubelet took from node 1.
	if err := p.Grant("far", []string{"gpu2-numa1-0"}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.OpenNear("far", pool.Spec{GPU: 0, PageSize: 1 << 18, DevicePages: 8}, pool.Near{NUMA: 0, Ranks: 1}); err != nil {
		t.Fatal(err)
	}
	ring := NewRing(4)
	ring.Error("plugin", errors.New("kubelet gone"))
	now := time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC)
	rep := &Reporter{Pool: p, Errors: ring, Node: "n1", Mode: "standalone", Now: func() time.Time { return now },
		Targets:   func() map[int]int64 { return map[int]int64{0: 4 << 20, 1: 2 << 20, 2: 1 << 20} },
		Readiness: func() (bool, string) { return false, "socket: dial: no such file" }}
	srv := httptest.NewServer(rep)
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got Report
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	// GPU 0 serves both sessions, one of them across NUMA nodes; GPU 2's
	// chunk is granted to that one.
	want0 := GPU{Index: 0, NUMA: 0, TargetBytes: 4 << 20, ReadyBytes: 2 << 20, AllocatedBytes: 2 << 20, UsedBytes: 3 << 18,
		Chunks: ChunkCounts{Granted: 2, Bound: 2}, Sessions: 2, CrossNUMASessions: 1, RemoteChunks: 1, Streams: 1, Requests: 1, PagesTotal: 10, PagesUsed: 3}
	want1 := GPU{Index: 1, NUMA: -1, TargetBytes: 2 << 20, ReadyBytes: 2 << 20, FreeBytes: 2 << 20, Chunks: ChunkCounts{Free: 1}}
	want2 := GPU{Index: 2, NUMA: 1, TargetBytes: 1 << 20, ReadyBytes: 1 << 20, AllocatedBytes: 1 << 20, Chunks: ChunkCounts{Granted: 1, Bound: 1}}
	if len(got.GPUs) != 3 || got.GPUs[0] != want0 || got.GPUs[1] != want1 || got.GPUs[2] != want2 {
		t.Errorf("gpus = %+v\nwant %+v\n     %+v\n     %+v", got.GPUs, want0, want1, want2)
	}
	wantS := []Session{{Allocation: "far", GPU: 0, GPUNUMA: 0, Remote: 1, Ranks: 1, PageSize: 1 << 18, Chunks: 1, Pages: 4},
		{Allocation: "pod", GPU: 0, GPUNUMA: 0, Local: 2, Ranks: 1, PageSize: 1 << 18, Chunks: 2, Pages: 6, Used: 3, Streams: 1, Requests: 1}}
	if !reflect.DeepEqual(got.Sessions, wantS) {
		t.Errorf("sessions = %+v, want %+v", got.Sessions, wantS)
	}
	if got.Ready || got.Health != "socket: dial: no such file" || got.Node != "n1" || !got.Time.Equal(now) {
		t.Errorf("header = %+v", got)
	}
	if len(got.Errors) != 1 || got.ErrorsTotal != 1 || got.Errors[0].Message != "kubelet gone" {
		t.Errorf("errors = %+v (total %d)", got.Errors, got.ErrorsTotal)
	}
	if tot := got.Totals(); tot.ReadyBytes != 5<<20 || tot.Chunks.Total() != 4 || tot.Sessions != 2 || tot.CrossNUMASessions != 1 {
		t.Errorf("totals = %+v", tot)
	}

	post, err := http.Post(srv.URL, "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	post.Body.Close()
	if post.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d", post.StatusCode)
	}
}
