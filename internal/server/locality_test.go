package server_test

import (
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// syncBuffer is a log sink tests read while the server writes.
type syncBuffer struct{ logging.SyncBuffer }

func (s *syncBuffer) count(sub string) int { return strings.Count(s.String(), sub) }

// localityServer serves a node of four GPUs on two NUMA nodes (GPUs 0, 1
// on node 0; 2, 3 on node 1) whose allocation "A" (token "tok-a") holds
// four chunks sized under GPU 0's name, on node 0, and "B" ("tok-b") two
// of GPU 3's, on node 1. ranks answers Options.Ranks.
func localityServer(t *testing.T, ranks func(alloc string) server.Ranks) (*agent, *syncBuffer) {
	t.Helper()
	a := &agent{pool: pool.New(), chunks: map[string]*hostmem.Chunk{}}
	add := func(id string, gpu, numa int) {
		hc, err := hostmem.Alloc(hostmem.Options{Size: 256 << 10})
		if err != nil {
			t.Fatal(err)
		}
		a.chunks[id] = hc
		if err := a.pool.AddChunk(pool.Chunk{ID: id, GPU: gpu, NUMA: numa, Size: 256 << 10}); err != nil {
			t.Fatal(err)
		}
	}
	var ids []string
	for i := range 4 {
		id := "gpu0-numa0-" + string(rune('0'+i))
		add(id, 0, 0)
		ids = append(ids, id)
	}
	add("gpu3-numa1-0", 3, 1)
	add("gpu3-numa1-1", 3, 1)
	if err := a.pool.Grant("A", ids); err != nil {
		t.Fatal(err)
	}
	if err := a.pool.Grant("B", []string{"gpu3-numa1-0", "gpu3-numa1-1"}); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	gpus := map[string]int{}
	for g := range uint32(4) {
		gpus[gpuUUID(g)] = int(g)
	}
	// GPU 3 is MIG-partitioned: two instances, each its own device, both
	// on GPU 3, by NVML's name and by the CUDA driver's.
	for _, mig := range []string{"aaaaaaaa-0000-0000-0000-000000000001", "aaaaaaaa-0000-0000-0000-000000000002"} {
		gpus["MIG-"+mig], gpus["GPU-"+mig] = 3, 3
	}
	srv, err := server.New(server.Options{
		Pool: a.pool, Logger: slog.New(slog.NewTextHandler(logs, nil)), GPUs: gpus,
		GPUNUMA: map[int]int{0: 0, 1: 0, 2: 1, 3: 1}, Ranks: ranks, SweepInterval: time.Hour,
		Chunks:    func(id string) (*hostmem.Chunk, bool) { c, ok := a.chunks[id]; return c, ok },
		Authorize: server.StaticTokens(map[string]string{"tok-a": "A", "tok-b": "B"}),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, c := range a.chunks {
			c.Close()
		}
	})
	a.serve(t, srv)
	return a, logs
}

func (r *raw) openWith(m *wire.Open) (*wire.OpenReply, wire.Status, string) {
	r.t.Helper()
	r.hello()
	var rep wire.OpenReply
	st, msg := r.do(wire.OpOpen, 0, m, &rep)
	return &rep, st, msg
}

func openOn(token, uuid, inst string, ranks uint32) *wire.Open {
	return &wire.Open{Token: token, GpuUuid: uuid, InstanceId: []byte(inst), Ranks: ranks,
		Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 64}}}
}

// A session binds chunks sized under other GPUs' names: the open reply
// names each chunk's NUMA node and the GPU's; a session whose chunks lie on
// the other node is served, its listing says so, and the agent logs it
// once, not again when the client reconnects.
func TestOpenBindsByLocality(t *testing.T) {
	a, logs := localityServer(t, nil)
	// GPU 1 on allocation A (all of GPU 0's chunks): one rank per GPU the
	// chunks name, so it binds all four, on its own node.
	r := dial(t, a)
	rep, st, msg := r.openWith(openOn("tok-a", gpuUUID(1), "instance-1", 0))
	if st != wire.StatusOK {
		t.Fatalf("open on GPU 1: %s %s", st, msg)
	}
	if len(rep.Chunks) != 4 || rep.GetGpuNuma() != 0 || rep.Ranks != 1 {
		t.Fatalf("reply %v", rep)
	}
	for _, c := range rep.Chunks {
		if c.Numa == nil || c.GetNuma() != 0 {
			t.Fatalf("chunk %s: NUMA %v", c.Id, c.Numa)
		}
	}
	// GPU 0 (node 0) on allocation B, whose chunks are on node 1.
	r2 := dial(t, a)
	rep, st, msg = r2.openWith(openOn("tok-b", gpuUUID(0), "instance-2", 0))
	if st != wire.StatusOK || len(rep.Chunks) != 2 || rep.GetGpuNuma() != 0 || rep.Chunks[0].GetNuma() != 1 {
		t.Fatalf("cross-NUMA open: %s %s %v", st, msg, rep)
	}
	var cross server.SessionInfo
	for _, s := range a.srv.Sessions() {
		if s.Allocation == "B" {
			cross = s
		}
	}
	if l := cross.Locality; l.GPUNUMA != 0 || l.Remote != 2 || len(cross.ChunkNUMA) != 2 || cross.ChunkNUMA[0] != 1 {
		t.Fatalf("cross-NUMA session listed as %+v", cross)
	}
	const warn = "session bound chunks on another NUMA node"
	if n := logs.count(warn); n != 1 {
		t.Fatalf("%d cross-NUMA log lines, want 1", n)
	}
	// The client reconnects and resumes: no second line.
	r2.c.Close()
	r3 := dial(t, a)
	rep, st, msg = r3.openWith(openOn("tok-b", gpuUUID(0), "instance-2", 0))
	if st != wire.StatusOK || !rep.Resumed || rep.GetGpuNuma() != 0 || rep.Chunks[1].GetNuma() != 1 {
		t.Fatalf("resume: %s %s %v", st, msg, rep)
	}
	if n := logs.count(warn); n != 1 {
		t.Fatalf("%d cross-NUMA log lines after a resume, want 1", n)
	}
}

// The ranks of a container share an allocation: by the count Options.Ranks
// gives (with the ranks' GPUs), or by the count the client declares, which
// wins.
func TestOpenSharesAmongRanks(t *testing.T) {
	var asked []string
	var mu sync.Mutex
	a, _ := localityServer(t, func(alloc string) server.Ranks {
		mu.Lock()
		asked = append(asked, alloc)
		mu.Unlock()
		return server.Ranks{Count: 2, GPUs: []int{0, 2}}
	})
	r := dial(t, a)
	rep, st, msg := r.openWith(openOn("tok-a", gpuUUID(2), "rank-one", 0))
	if st != wire.StatusOK || len(rep.Chunks) != 2 || rep.Ranks != 2 {
		t.Fatalf("rank on GPU 2 of 2: %s %s %v", st, msg, rep)
	}
	r2 := dial(t, a)
	rep, st, msg = r2.openWith(openOn("tok-a", gpuUUID(0), "rank-zero", 0))
	if st != wire.StatusOK || len(rep.Chunks) != 2 {
		t.Fatalf("rank on GPU 0 of 2: %s %s %v", st, msg, rep)
	}
	mu.Lock()
	if len(asked) != 2 || asked[0] != "A" {
		t.Errorf("Ranks asked for %v", asked)
	}
	mu.Unlock()
	// Declared: one rank takes all of B.
	r3 := dial(t, a)
	rep, st, msg = r3.openWith(openOn("tok-b", gpuUUID(3), "solo-rank", 1))
	if st != wire.StatusOK || len(rep.Chunks) != 2 || rep.Ranks != 1 {
		t.Fatalf("declared 1 rank: %s %s %v", st, msg, rep)
	}
}

// MIG instances are their own devices: two instances of GPU 3 in one
// allocation are two sessions, each on GPU 3's node; an instance named by
// NVML ("MIG-...") and by the CUDA driver ("GPU-..." of the same bytes) is
// one device, so a second client of it meets the first.
func TestOpenMIGInstances(t *testing.T) {
	a, _ := localityServer(t, nil)
	const mig1, mig2 = "aaaaaaaa-0000-0000-0000-000000000001", "aaaaaaaa-0000-0000-0000-000000000002"
	r := dial(t, a)
	rep, st, msg := r.openWith(openOn("tok-b", "MIG-"+mig1, "mig-one-instance", 2))
	if st != wire.StatusOK || len(rep.Chunks) != 1 || rep.GetGpuNuma() != 1 || rep.Chunks[0].GetNuma() != 1 {
		t.Fatalf("MIG instance 1: %s %s %v", st, msg, rep)
	}
	r2 := dial(t, a)
	if _, st, msg := r2.openWith(openOn("tok-b", "GPU-"+mig1, "other-process", 2)); st != wire.StatusBusy {
		t.Fatalf("the same instance by the driver's name, from another client: %s %s, want busy", st, msg)
	}
	r3 := dial(t, a)
	rep, st, msg = r3.openWith(openOn("tok-b", "GPU-"+mig2, "mig-two-instance", 2))
	if st != wire.StatusOK || len(rep.Chunks) != 1 {
		t.Fatalf("MIG instance 2: %s %s %v", st, msg, rep)
	}
	ss := a.srv.Sessions()
	if len(ss) != 2 || ss[0].GPU != 3 || ss[1].GPU != 3 || ss[0].Locality.Local != 1 {
		t.Fatalf("sessions %+v", ss)
	}
	r4 := dial(t, a)
	if _, st, _ := r4.openWith(openOn("tok-b", "MIG-ffffffff-0000-0000-0000-000000000009", "x-instance", 0)); st != wire.StatusUnknownGPU {
		t.Fatalf("unknown MIG instance: %s", st)
	}
}

// TestResumeOfMappedChunks: an open that resumes the very session the
// client says it maps names every chunk and passes none of their fds (nor
// leaves any for More); an open of a new session, or naming another
// session, or none, passes them all as before.
func TestResumeOfMappedChunks(t *testing.T) {
	a := startServerOf(t, 300, 64<<10, func(o *server.Options) {})
	// open sends m on a new connection and returns the reply and how many
	// fds came with it and with the More requests after it.
	opens := 0
	open := func(m *wire.Open) (*wire.OpenReply, int) {
		t.Helper()
		r := dial(t, a)
		r.hello()
		r.seq++
		pkt, err := wire.AppendPacket(nil, wire.Header{Op: wire.OpOpen, Seq: r.seq}, m)
		if err != nil {
			t.Fatal(err)
		}
		r.sendPacket(pkt, nil)
		h, body, files, ok := r.recv()
		if !ok || h.Status != wire.StatusOK {
			t.Fatalf("open: connection closed %v, status %s", !ok, h.Status)
		}
		var rep wire.OpenReply
		if err := wire.DecodeBody(body, &rep); err != nil {
			t.Fatal(err)
		}
		fds := len(files)
		closeAll(files)
		for fds < len(rep.Chunks) && len(files) == wire.MaxFDs {
			var mr wire.MoreReply
			r.seq++
			pkt, err := wire.AppendPacket(nil, wire.Header{Op: wire.OpMore, Seq: r.seq}, &wire.More{Offset: uint32(fds)})
			if err != nil {
				t.Fatal(err)
			}
			r.sendPacket(pkt, nil)
			h, body, files, ok = r.recv()
			if !ok || h.Status != wire.StatusOK || wire.DecodeBody(body, &mr) != nil {
				t.Fatalf("more: connection closed %v, status %s", !ok, h.Status)
			}
			fds += len(files)
			closeAll(files)
		}
		// The session serves whichever way it opened.
		var off wire.OffloadReply
		opens++
		if st, msg := r.do(wire.OpOffload, 0, &wire.Offload{Rid: fmt.Sprint("r", opens), Label: "l", GpuPages: []int32{0}}, &off); st != 0 || !off.Ok {
			t.Fatalf("offload after the open: %s %s", st, msg)
		}
		r.c.Close()
		return &rep, fds
	}
	first, fds := open(openOn("tok-a", gpuUUID(0), "instance-a", 0))
	if first.ChunksMapped || first.Resumed || len(first.Chunks) <= wire.MaxFDs || fds != len(first.Chunks) {
		t.Fatalf("a new session: resumed %t, chunks mapped %t, %d chunks, %d fds", first.Resumed, first.ChunksMapped, len(first.Chunks), fds)
	}
	waitDisconnected(t, a.srv, first.Session)
	for _, c := range []struct {
		name   string
		mapped uint64
		inst   string
		keep   bool
	}{
		{"the session the client maps", first.Session, "instance-a", true},
		{"no session named", 0, "instance-a", false},
		{"another session named", first.Session + 1, "instance-a", false},
		{"the session the client maps, again", first.Session, "instance-a", true},
	} {
		m := openOn("tok-a", gpuUUID(0), c.inst, 0)
		m.MappedSession = c.mapped
		rep, fds := open(m)
		wantFDs := len(rep.Chunks)
		if c.keep {
			wantFDs = 0
		}
		if !rep.Resumed || rep.Session != first.Session || rep.ChunksMapped != c.keep || fds != wantFDs || !reflect.DeepEqual(ids(rep), ids(first)) {
			t.Fatalf("%s: session %d resumed %t, chunks mapped %t, %d chunks named (%d at first), %d fds (want %d)",
				c.name, rep.Session, rep.Resumed, rep.ChunksMapped, len(rep.Chunks), len(first.Chunks), fds, wantFDs)
		}
		waitDisconnected(t, a.srv, first.Session)
	}
	// A new instance gets a new session, whatever it names.
	m := openOn("tok-a", gpuUUID(0), "instance-b", 0)
	m.MappedSession = first.Session
	if rep, fds := open(m); rep.Resumed || rep.ChunksMapped || rep.Session == first.Session || fds != len(rep.Chunks) {
		t.Fatalf("a new instance naming the old session: session %d resumed %t, chunks mapped %t, %d fds for %d chunks",
			rep.Session, rep.Resumed, rep.ChunksMapped, fds, len(rep.Chunks))
	}
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

func ids(rep *wire.OpenReply) []string {
	var out []string
	for _, c := range rep.Chunks {
		out = append(out, c.Id)
	}
	return out
}
