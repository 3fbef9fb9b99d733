package wire

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// pair returns both ends of a fresh connection.
func pair(t testing.TB) (client, server *Conn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s")
	l, err := net.ListenUnix(Network, &net.UnixAddr{Name: path, Net: Network})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	uc, err := l.AcceptUnix()
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	s := NewConn(uc)
	t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

// inMode runs f with Recv allowed to wait in the kernel (direct) or not.
func inMode(t *testing.T, f func(t *testing.T)) {
	for _, direct := range []bool{true, false} {
		name := "poller"
		if direct {
			name = "direct"
		}
		t.Run(name, func(t *testing.T) {
			old := blockLimit
			blockLimit = func() int {
				if direct {
					return 1 << 20
				}
				return 0
			}
			defer func() { blockLimit = old }()
			f(t)
		})
	}
}

func TestConnModes(t *testing.T) {
	inMode(t, func(t *testing.T) {
		c, s := pair(t)
		if !c.direct || !s.direct {
			t.Fatal("socket not set up for direct waits")
		}
		buf := make([]byte, MaxMessage+1)

		// A queued packet is taken by the first recvmsg, without the poller.
		before := parked.Load()
		if err := c.Send([]byte("queued"), nil); err != nil {
			t.Fatal(err)
		}
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "queued" {
			t.Fatalf("recv %q %v", pkt, err)
		}
		if n := parked.Load() - before; n != 0 {
			t.Fatalf("%d parks for a packet already queued", n)
		}

		// A packet sent long after the window still arrives.
		go func() {
			time.Sleep(20 * BlockWindow)
			c.Send([]byte("late"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "late" {
			t.Fatalf("late recv %q %v", pkt, err)
		}

		// Both directions, many times, with a maximal packet.
		big := make([]byte, MaxMessage)
		for i := range big {
			big[i] = byte(i * 7)
		}
		for i := 0; i < 200; i++ {
			if err := c.Send(big[:1+i*600], nil); err != nil {
				t.Fatal(err)
			}
			pkt, _, err := s.Recv(buf)
			if err != nil || len(pkt) != 1+i*600 || pkt[len(pkt)-1] != big[i*600] {
				t.Fatalf("round %d: %d bytes, %v", i, len(pkt), err)
			}
			if err := s.Send(pkt, nil); err != nil {
				t.Fatal(err)
			}
			if pkt, _, err := c.Recv(buf); err != nil || len(pkt) != 1+i*600 {
				t.Fatalf("round %d reply: %d bytes, %v", i, len(pkt), err)
			}
		}

		// A deadline set on the underlying connection holds.
		s.UnixConn().SetReadDeadline(time.Now().Add(5 * time.Millisecond))
		if _, _, err := s.Recv(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("recv past the deadline: %v", err)
		}
		s.UnixConn().SetReadDeadline(time.Time{})
		c.UnixConn().SetWriteDeadline(time.Now().Add(-time.Second))
		if err := c.Send([]byte("x"), nil); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("send past the deadline: %v", err)
		}
		c.UnixConn().SetWriteDeadline(time.Time{})

		// The peer going away is io.EOF.
		c.Close()
		if _, _, err := s.Recv(buf); !errors.Is(err, io.EOF) {
			t.Fatalf("recv after the peer closed: %v", err)
		}
	})
}

func TestConnSpin(t *testing.T) {
	c, s := pair(t)
	for _, bad := range []time.Duration{-time.Nanosecond, SpinLimit + 1, time.Second} {
		if err := s.SetSpin(bad); err == nil || s.spin != 0 {
			t.Fatalf("SetSpin(%v): %v, spin now %v", bad, err, s.spin)
		}
	}
	for _, good := range []time.Duration{SpinLimit, 0} {
		if err := s.SetSpin(good); err != nil || s.spin != good {
			t.Fatalf("SetSpin(%v): %v, spin now %v", good, err, s.spin)
		}
	}
	buf := make([]byte, MaxMessage+1)
	inMode(t, func(t *testing.T) {
		// A packet that comes while Recv spins is taken by the spin: no
		// kernel wait, no poller. The spin is longer than SetSpin allows,
		// so that a slow machine cannot miss it.
		s.spin = time.Minute
		spins, parks := spun.Load(), parked.Load()
		go func() {
			time.Sleep(time.Millisecond)
			c.Send([]byte("soon"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "soon" {
			t.Fatalf("recv %q %v", pkt, err)
		}
		if n, p := spun.Load()-spins, parked.Load()-parks; n != 1 || p != 0 {
			t.Fatalf("%d packets taken by the spin, %d parks; want 1 and 0", n, p)
		}

		// One that comes after the spin is still received, the usual way.
		s.spin = 50 * time.Microsecond
		spins = spun.Load()
		go func() {
			time.Sleep(20 * time.Millisecond)
			c.Send([]byte("late"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "late" {
			t.Fatalf("late recv %q %v", pkt, err)
		}
		if n := spun.Load() - spins; n != 0 {
			t.Fatalf("a packet 20 ms late was taken by a 50 µs spin")
		}
	})

	// Closing the Conn ends a spin at once.
	s.spin = time.Minute
	errc := make(chan error, 1)
	go func() {
		_, _, err := s.Recv(buf)
		errc <- err
	}()
	time.Sleep(2 * time.Millisecond)
	s.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("recv on a conn closed while it spun: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("closing the conn did not end the spin")
	}
}

func TestConnCloseWakesRecv(t *testing.T) {
	inMode(t, func(t *testing.T) {
		_, s := pair(t)
		errc := make(chan error, 1)
		go func() {
			_, _, err := s.Recv(make([]byte, MaxMessage+1))
			errc <- err
		}()
		time.Sleep(BlockWindow / 4) // most likely inside recvmsg now
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; !errors.Is(err, net.ErrClosed) {
			t.Fatalf("recv on a closed conn: %v", err)
		}
		if _, _, err := s.Recv(make([]byte, 16)); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("recv after close: %v", err)
		}
		if err := s.Send([]byte("x"), nil); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("send after close: %v", err)
		}
	})
}

func TestConnDirectBudget(t *testing.T) {
	old := blockLimit
	defer func() { blockLimit = old }()
	blockLimit = func() int { return int(open.Load()) }
	c, s := pair(t)
	if !c.mayBlock() || !s.mayBlock() {
		t.Fatal("within the budget, Recv should wait in the kernel")
	}
	blockLimit = func() int { return int(open.Load()) - 1 }
	if c.mayBlock() || s.mayBlock() {
		t.Fatal("over the budget, Recv should use the poller alone")
	}
	n := open.Load()
	c.Close()
	c.Close()
	if got := open.Load(); got != n-1 {
		t.Fatalf("open conns %d after closing one of %d (twice)", got, n)
	}
}

func TestSetKernelWait(t *testing.T) {
	defer SetKernelWait(KernelWait())
	for _, bad := range []time.Duration{-time.Microsecond, KernelWaitLimit + time.Nanosecond, time.Second} {
		before := KernelWait()
		if err := SetKernelWait(bad); err == nil || KernelWait() != before {
			t.Fatalf("SetKernelWait(%v): %v, kernel wait now %v", bad, err, KernelWait())
		}
	}
	// Off: new Conns wait on the poller alone, and work.
	if err := SetKernelWait(0); err != nil {
		t.Fatal(err)
	}
	n := open.Load()
	c, s := pair(t)
	if c.direct || s.direct || c.mayBlock() || open.Load() != n {
		t.Fatal("with the kernel wait off a Conn should not wait in the kernel")
	}
	buf := make([]byte, MaxMessage+1)
	go func() {
		time.Sleep(2 * time.Millisecond)
		c.Send([]byte("later"), nil)
	}()
	if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "later" {
		t.Fatalf("recv on the poller: %q %v", pkt, err)
	}
	// The limit itself is accepted and used.
	if err := SetKernelWait(KernelWaitLimit); err != nil || KernelWait() != KernelWaitLimit {
		t.Fatalf("SetKernelWait(limit): %v", err)
	}
	c2, s2 := pair(t)
	if !c2.direct || !s2.direct {
		t.Fatal("with a kernel wait set a Conn should be set up for direct waits")
	}
	if err := c2.Send([]byte("x"), nil); err != nil {
		t.Fatal(err)
	}
	if pkt, _, err := s2.Recv(buf); err != nil || string(pkt) != "x" {
		t.Fatalf("recv: %q %v", pkt, err)
	}
}
