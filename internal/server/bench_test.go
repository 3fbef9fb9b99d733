package server_test

import (
	"net"
	"testing"

	"github.com/kvpool/kvpool/pkg/pool"
	"github.com/kvpool/kvpool/pkg/wire"
)

// The three benchmarks below are meant to be run side by side:
//
//	go test -run XXX -bench 'RoundTrip|UnixEchoFloor|InProcess' ./internal/server
//
// Each op is one call: one request and its reply. The calls alternate
// between offloading a 64-page stream and reloading it (with the previous
// reload's fence piggybacked), bookkeeping only, no copies.

const benchPages = 64

func benchPagesList() []int32 {
	p := make([]int32, benchPages)
	for i := range p {
		p[i] = int32(i * 3) // scattered device pages
	}
	return p
}

// benchClient is a minimal hand-rolled client: reused buffers and messages,
// the way pkg/client's hot path works.
type benchClient struct {
	c      *wire.Conn
	in     []byte
	out    []byte
	seq    uint32
	off    wire.Offload
	offRep wire.OffloadReply
	rel    wire.Reload
	relRep wire.ReloadReply
	ticket uint64
	sizes  [2][2]int // [offload|reload][request|reply] packet sizes
}

func (bc *benchClient) call(b *testing.B, i int) {
	bc.seq++
	var err error
	if i%2 == 0 {
		bc.out, err = wire.AppendPacket(bc.out[:0], wire.Header{Op: wire.OpOffload, Seq: bc.seq}, &bc.off)
	} else {
		bc.out, err = wire.AppendPacket(bc.out[:0], wire.Header{Op: wire.OpReload, Seq: bc.seq, Fence: bc.ticket}, &bc.rel)
	}
	if err != nil {
		b.Fatal(err)
	}
	if err := bc.c.Send(bc.out, nil); err != nil {
		b.Fatal(err)
	}
	pkt, _, err := bc.c.Recv(bc.in)
	if err != nil {
		b.Fatal(err)
	}
	bc.sizes[i%2] = [2]int{len(bc.out), len(pkt)}
	h, body, err := wire.ParseHeader(pkt)
	if err != nil || h.Status != wire.StatusOK || h.Seq != bc.seq {
		b.Fatalf("reply %+v %v", h, err)
	}
	if i%2 == 0 {
		err = wire.DecodeBody(body, &bc.offRep)
		if err == nil && (!bc.offRep.Ok || len(bc.offRep.HostPages) != benchPages) {
			b.Fatalf("offload reply %v", &bc.offRep)
		}
	} else {
		err = wire.DecodeBody(body, &bc.relRep)
		bc.ticket = bc.relRep.Ticket
	}
	if err != nil {
		b.Fatal(err)
	}
}

func newBenchClient(b *testing.B, a *agent) *benchClient {
	r := dial(b, a)
	r.hello()
	var rep wire.OpenReply
	if st, msg := r.do(wire.OpOpen, 0, &wire.Open{Token: "tok-a", GpuUuid: gpuUUID(0), InstanceId: []byte("bench-instance"),
		Regions: []*wire.Region{{BytesPerPage: 4096, PageCount: 256}}}, &rep); st != 0 {
		b.Fatal(st, msg)
	}
	pages := benchPagesList()
	return &benchClient{c: r.c, in: make([]byte, wire.MaxMessage+1),
		off: wire.Offload{Rid: "request-0001", Label: "attention", GpuPages: pages, StoredLen: 1000, Position: 1024},
		rel: wire.Reload{Rid: "request-0001", Label: "attention", GpuPages: pages}}
}

func BenchmarkRoundTrip(b *testing.B) {
	a := startServer(b)
	bc := newBenchClient(b, a)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		bc.call(b, i)
	}
	b.StopTimer()
	if b.N > 1 {
		b.ReportMetric(float64(bc.sizes[0][0]), "offload-req-B")
		b.ReportMetric(float64(bc.sizes[1][1]), "reload-reply-B")
	}
}

// BenchmarkRoundTripJournaled is BenchmarkRoundTrip with the books
// recording every change before it is answered (an agent with a keeper).
func BenchmarkRoundTripJournaled(b *testing.B) {
	p, chunks, bk, _ := booksPool(b)
	defer bk.Close()
	a, _ := journaled(b, p, chunks, bk, nil)
	bc := newBenchClient(b, a)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		bc.call(b, i)
	}
}

// BenchmarkUnixEchoFloor is the floor under BenchmarkRoundTrip: a bare
// request and reply of the same sizes over a unixpacket connection to a
// goroutine that answers at once.
func BenchmarkUnixEchoFloor(b *testing.B) {
	// Learn the packet sizes from a few real calls.
	a := startServer(b)
	bc := newBenchClient(b, a)
	for i := 0; i < 4; i++ {
		bc.call(b, i)
	}
	sizes := bc.sizes
	l, err := net.ListenUnix(wire.Network, &net.UnixAddr{Name: a.socket + ".echo", Net: wire.Network})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		wc := wire.NewConn(c)
		in := make([]byte, wire.MaxMessage+1)
		replies := [2][]byte{make([]byte, sizes[0][1]), make([]byte, sizes[1][1])}
		for i := 0; ; i++ {
			if _, _, err := wc.Recv(in); err != nil {
				return
			}
			if err := wc.Send(replies[i%2], nil); err != nil {
				return
			}
		}
	}()
	c, err := wire.Dial(a.socket + ".echo")
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	reqs := [2][]byte{make([]byte, sizes[0][0]), make([]byte, sizes[1][0])}
	in := make([]byte, wire.MaxMessage+1)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := c.Send(reqs[i%2], nil); err != nil {
			b.Fatal(err)
		}
		if _, _, err := c.Recv(in); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInProcess makes the same calls on pkg/pool directly.
func BenchmarkInProcess(b *testing.B) {
	a := startServer(b)
	s, err := a.pool.Open("A", pool.Spec{GPU: 0, PageSize: 4096, DevicePages: 256})
	if err != nil {
		b.Fatal(err)
	}
	pages := benchPagesList()
	dst := make([]int32, 0, benchPages)
	var ticket uint64
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 0 {
			dst, err = s.Offload("request-0001", "attention", pages, pool.Meta{StoredLen: 1000, Position: 1024}, dst[:0])
		} else {
			if ticket != 0 {
				if err = s.Fence(ticket); err != nil {
					b.Fatal(err)
				}
			}
			var r pool.Reloaded
			r, err = s.Reload("request-0001", "attention", pages, dst[:0])
			dst, ticket = r.Pages, r.Ticket
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}
