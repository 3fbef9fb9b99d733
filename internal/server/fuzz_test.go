package server_test

import (
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvpool/kvpool/pkg/wire"
)

// socketpair returns a connected unixpacket pair.
func socketpair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "sp")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conv(fds[0]), conv(fds[1])
}

// FuzzServerPacket feeds one arbitrary packet to a live server connection
// after hello, open, an offload and a pages packet, then checks that the server either answered it and
// still answers, or closed that connection; and that the pool's invariants
// hold either way.
func FuzzServerPacket(f *testing.F) {
	for _, m := range []struct {
		op   wire.Op
		body []byte
	}{
		{wire.OpOffload, []byte{0x0a, 0x01, 'r', 0x12, 0x01, 'l', 0x1a, 0x02, 0x01, 0x02}},
		{wire.OpReload, []byte{0x0a, 0x01, 'r', 0x12, 0x01, 'l', 0x1a, 0x02, 0x03, 0x04}},
		{wire.OpDiscard, []byte{0x0a, 0x01, 'r', 0x12, 0x01, 'l'}},
		{wire.OpRemoveRequest, []byte{0x0a, 0x01, 'r'}},
		{wire.OpLabels, []byte{0x0a, 0x01, 'r'}},
		{wire.OpUsage, nil},
		{wire.OpFence, nil},
		{wire.OpClose, nil},
		{wire.OpOpen, []byte{0x0a, 0x05, 't', 'o', 'k', '-', 'a'}},
		{wire.OpPages, []byte{0x0a, 0x02, 0x01, 0x02}},
		{wire.OpMore, []byte{0x08, 0x01}},
		{wire.OpMore, nil},
		{77, nil},
	} {
		f.Add(append(wire.AppendHeader(nil, wire.Header{Op: m.op, Seq: 9}), m.body...))
	}
	f.Add([]byte{1})
	a := startServer(f)
	f.Fuzz(func(t *testing.T, pkt []byte) {
		sc, cc := socketpair(t)
		done := make(chan struct{})
		go func() { a.srv.ServeConn(sc); close(done) }()
		r := &raw{t: t, c: wire.NewConn(cc), buf: make([]byte, wire.MaxMessage+1)}
		r.open(0, "fuzz-instance")
		var off wire.OffloadReply
		r.do(wire.OpOffload, 0, &wire.Offload{Rid: "r", Label: "l", GpuPages: []int32{5, 6}}, &off)
		// Staged pages, which a fuzzed offload or reload takes first and
		// any other request drops.
		r.do(wire.OpPages, 0, &wire.Pages{GpuPages: []int32{7, 8}}, nil)
		if len(pkt) > wire.MaxMessage {
			pkt = pkt[:wire.MaxMessage]
		}
		r.sendPacket(pkt, nil)
		if _, _, files, ok := r.recv(); ok {
			for _, f := range files {
				f.Close()
			}
			r.seq = 100
			var u wire.UsageReply
			r.do(wire.OpUsage, 0, nil, &u) // any status; the connection must answer
		}
		if err := a.pool.Check(); err != nil {
			t.Fatal(err)
		}
		// End the session so the next input starts clean.
		r.c.Close()
		<-done
		rr := &raw{t: t}
		sc, cc = socketpair(t)
		go func() { a.srv.ServeConn(sc) }()
		rr.c, rr.buf = wire.NewConn(cc), make([]byte, wire.MaxMessage+1)
		rr.open(0, "fuzz-instance")
		rr.do(wire.OpClose, 0, nil, nil)
		rr.c.Close()
	})
}
