package client_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	stdsync "sync"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

// FuzzClientReply has a fake agent answer an offload and then a reload with
// arbitrary bodies (under a valid header). Whatever the agent says, the
// client must return an error or a result whose copies stayed inside its
// chunks and device regions: the simulator rejects any other address, and
// the client must have checked before it got there.
func FuzzClientReply(f *testing.F) {
	enc := func(m proto.Message) []byte { b, _ := proto.Marshal(m); return b }
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{0, 1}}), enc(&wire.ReloadReply{HostPages: []int32{0, 1}, Ticket: 1}))
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{99, -1}}), enc(&wire.ReloadReply{HostPages: []int32{1 << 30, 0}, Ticket: 9}))
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{0}}), enc(&wire.ReloadReply{}))
	f.Add(enc(&wire.OffloadReply{Ok: false}), []byte{0xff})
	f.Add([]byte{0x12, 0x03, 0x80, 0x80, 0x80}, []byte{})
	// Long replies: totals past what the first part holds, continued by
	// more replies that are the reload body again.
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{0}, Total: 2}), enc(&wire.MoreReply{HostPages: []int32{1}}))
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{0}, Total: 3}), enc(&wire.ReloadReply{HostPages: []int32{1}, Ticket: 1, Total: 2}))
	f.Add(enc(&wire.OffloadReply{Ok: true, HostPages: []int32{0, 1}, Total: 1}), enc(&wire.ReloadReply{HostPages: []int32{0}, Ticket: 1, Total: 1 << 31}))

	hc, err := hostmem.Alloc(hostmem.Options{Size: 64 << 10})
	if err != nil {
		f.Fatal(err)
	}
	defer hc.Close()
	f.Fuzz(func(t *testing.T, offBody, relBody []byte) {
		path := filepath.Join(t.TempDir(), "f.sock")
		l, err := net.ListenUnix(wire.Network, &net.UnixAddr{Name: path, Net: wire.Network})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		var wg stdsync.WaitGroup
		var mu stdsync.Mutex
		var conns []*wire.Conn
		serve := func(c *wire.Conn) {
			defer wg.Done()
			buf := make([]byte, wire.MaxMessage+1)
			for i := 0; ; i++ {
				pkt, _, err := c.Recv(buf)
				if err != nil {
					return
				}
				h, _, _ := wire.ParseHeader(pkt)
				var out []byte
				var fds []int
				switch h.Op {
				case wire.OpHello:
					out, _ = wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.HelloReply{Version: wire.Version})
				case wire.OpOpen:
					out, _ = wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.OpenReply{Session: 1, PageSize: 4096,
						PagesPerChunk: 16, Capacity: 16, Chunks: []*wire.ChunkGrant{{Id: "c", Size: 64 << 10}}})
					fds = []int{int(hc.File.Fd())}
				case wire.OpOffload:
					out = append(wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq}), offBody...)
				case wire.OpReload, wire.OpMore:
					// A long reply's continuation gets the reload body too.
					out = append(wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq}), relBody...)
				default:
					out = wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq})
				}
				if len(out) > wire.MaxMessage || c.Send(out, fds) != nil {
					return
				}
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				uc, err := l.AcceptUnix()
				if err != nil {
					return
				}
				c := wire.NewConn(uc)
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
				wg.Add(1)
				go serve(c)
			}
		}()
		defer func() {
			l.Close()
			mu.Lock()
			for _, c := range conns {
				c.Close()
			}
			mu.Unlock()
			wg.Wait()
		}()
		sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
		dev, _ := sim.Open(0)
		defer dev.Close()
		base, _ := dev.MemAlloc(8 * 4096)
		p, err := client.Open(context.Background(), client.Options{NoLane: true, Socket: path, Token: "t", Device: dev, Logger: quiet,
			InstanceID: []byte("fuzz-instance"), Regions: []cudart.Region{{Base: base, Stride: 4096, PageBytes: 4096, Pages: 8}}})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		check := func(err error) {
			var ce *cudart.Error
			if errors.As(err, &ce) {
				t.Fatalf("a bad reply reached the device: %v", err)
			}
		}
		_, err = p.OffloadStream("r", "l", []int32{2, 3}, 0, 0, 0)
		check(err)
		_, err = p.ReloadStream("r", "l", []int32{4, 5})
		check(err)
		check(p.Synchronize())
	})
}

// FuzzClientOpen has a fake agent answer an open, and every more after it,
// with arbitrary bodies (under a valid header), each passing n descriptors
// of a real 64 KiB chunk. Whatever the agent says, the client opens a
// session whose pages all lie in chunks it mapped (an offload to its last
// page copies inside them), or returns an error; it never panics, and
// never asks for more after a short packet.
func FuzzClientOpen(f *testing.F) {
	enc := func(m proto.Message) []byte { b, _ := proto.Marshal(m); return b }
	grants := func(n int) []*wire.ChunkGrant {
		g := make([]*wire.ChunkGrant, n)
		for i := range g {
			g[i] = &wire.ChunkGrant{Id: fmt.Sprint("c", i), Size: 64 << 10}
		}
		return g
	}
	f.Add(enc(&wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 16, Capacity: 16, Chunks: grants(1)}), []byte{}, uint8(1))
	f.Add(enc(&wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 16, Capacity: 16, Chunks: grants(wire.MaxFDs), ChunkCount: wire.MaxFDs + 1}),
		enc(&wire.MoreReply{Chunks: grants(1)}), uint8(wire.MaxFDs))
	f.Add(enc(&wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 16, Capacity: 1 << 20, Chunks: grants(wire.MaxFDs), ChunkCount: 1 << 31}),
		enc(&wire.MoreReply{Chunks: grants(wire.MaxFDs)}), uint8(wire.MaxFDs))
	f.Add(enc(&wire.OpenReply{Session: 1, PageSize: 4096, PagesPerChunk: 16, Capacity: 16, Chunks: grants(2)}), enc(&wire.MoreReply{}), uint8(1))

	hc, err := hostmem.Alloc(hostmem.Options{Size: 64 << 10})
	if err != nil {
		f.Fatal(err)
	}
	defer hc.Close()
	f.Fuzz(func(t *testing.T, openBody, moreBody []byte, n uint8) {
		fds := make([]int, min(int(n), wire.MaxFDs))
		for i := range fds {
			fds[i] = int(hc.File.Fd())
		}
		var mores atomic.Int32
		path := fakeAgentBody(t, openBody, fds, func(c *wire.Conn, buf []byte) {
			for {
				pkt, _, err := c.Recv(buf)
				if err != nil {
					return
				}
				h, _, _ := wire.ParseHeader(pkt)
				out, pass := wire.AppendHeader(nil, wire.Header{Op: h.Op, Seq: h.Seq}), []int(nil)
				switch h.Op {
				case wire.OpMore:
					mores.Add(1)
					out, pass = append(out, moreBody...), fds
				case wire.OpOffload:
					// The last page the session may hold.
					var or wire.OpenReply
					if proto.Unmarshal(openBody, &or) == nil && or.Capacity > 0 {
						out, _ = wire.AppendPacket(nil, wire.Header{Op: h.Op, Seq: h.Seq}, &wire.OffloadReply{Ok: true, HostPages: []int32{int32(or.Capacity - 1)}})
					}
				}
				if len(out) > wire.MaxMessage || c.Send(out, pass) != nil {
					return
				}
			}
		})
		sim := cudart.NewSim(cudart.SimOptions{Devices: 1})
		dev, _ := sim.Open(0)
		defer dev.Close()
		base, _ := dev.MemAlloc(8 * 4096)
		p, err := client.Open(context.Background(), client.Options{NoLane: true, Socket: path, Token: "t", Device: dev, Logger: quiet, RetryFor: -1,
			InstanceID: []byte("fuzz-instance"), Regions: []cudart.Region{{Base: base, Stride: 4096, PageBytes: 4096, Pages: 8}}})
		if err == nil {
			// Every page the session may hold lies in a mapped chunk: a
			// copy to the last of them (the fake agent's answer to an
			// offload) outside them fails in the simulator.
			_, capacity, _ := p.Session()
			if capacity > 0 {
				if _, err := p.OffloadStream("r", "l", []int32{0}, 0, 0, 0); err != nil {
					var ce *cudart.Error
					if errors.As(err, &ce) {
						t.Fatalf("a bad open reply reached the device: %v", err)
					}
				}
			}
			p.Close()
		}
		// The client waits for each more's reply: every one it sent is
		// counted by now.
		if len(fds) < wire.MaxFDs && mores.Load() > 0 {
			t.Fatalf("the client asked for more after a packet of %d fds", len(fds))
		}
	})
}
