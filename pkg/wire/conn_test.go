package wire

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// inMode runs f on a fresh pair of direct Conns (out of the poller,
// waiting in the kernel) and on a fresh pair of polled ones; then again on
// pairs whose sockets both refuse files (RefuseFiles: every receive a
// recvfrom), where the kernel can, and on pairs whose packets travel a
// lane (UseLane).
func inMode(t *testing.T, f func(t *testing.T, c, s *Conn)) {
	for _, kind := range []string{"", "/refusing-files", "/lane"} {
		for _, direct := range []bool{true, false} {
			t.Run(modeName(direct)+kind, func(t *testing.T) {
				c, s := pairIn(t, direct)
				switch {
				case kind == "/refusing-files" && !refuseBoth(t, c, s):
					return
				case kind == "/lane":
					withLane(t, c, s)
				}
				f(t, c, s)
			})
		}
	}
}

// withLane gives both Conns of a pair a lane.
func withLane(t testing.TB, c, s *Conn) {
	t.Helper()
	ours, theirs, err := LanePipes()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.UseLane(ours[0], ours[1]); err != nil {
		t.Fatal(err)
	}
	if err := c.UseLane(theirs[0], theirs[1]); err != nil {
		t.Fatal(err)
	}
}

// refuseBoth makes both Conns refuse files, and reports whether they do: a
// kernel before 6.16 has no SO_PASSRIGHTS, and the test is skipped.
func refuseBoth(t *testing.T, c, s *Conn) bool {
	t.Helper()
	if !s.RefuseFiles() {
		if CanRefuseFiles() {
			t.Fatal("RefuseFiles failed on a kernel that has SO_PASSRIGHTS")
		}
		t.Skip("this kernel has no SO_PASSRIGHTS (Linux 6.16): a Conn cannot refuse files")
		return false
	}
	if !c.RefuseFiles() {
		t.Fatal("one socket refuses files, its peer cannot")
	}
	return true
}

func modeName(direct bool) string {
	if direct {
		return "direct"
	}
	return "poller"
}

// pairIn returns a fresh pair of direct Conns, which may wait in the
// kernel for the rest of the test, or of polled ones.
func pairIn(t testing.TB, direct bool) (client, server *Conn) {
	t.Helper()
	old := blockLimit
	t.Cleanup(func() { blockLimit = old })
	blockLimit = func() int {
		if direct {
			return 1 << 20
		}
		return 0
	}
	c, s := pair(t)
	if direct {
		s.TryDirect()
	}
	if (c.d != nil) != direct || (s.d != nil) != direct {
		t.Fatalf("conns direct %v and %v, want %v", c.d != nil, s.d != nil, direct)
	}
	return c, s
}

func TestConnModes(t *testing.T) {
	inMode(t, func(t *testing.T, c, s *Conn) {
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

		// A packet sent long after the window (which the kernel rounds
		// up to its ticks: up to 12 ms) still arrives.
		go func() {
			time.Sleep(30 * time.Millisecond)
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
		// (A send goes on beside the receive: a pipe holds less than a
		// maximal packet.)
		sent := make(chan error, 1)
		for i := 0; i < 200; i++ {
			go func() { sent <- c.Send(big[:1+i*600], nil) }()
			pkt, _, err := s.Recv(buf)
			if err != nil || len(pkt) != 1+i*600 || pkt[len(pkt)-1] != big[i*600] {
				t.Fatalf("round %d: %d bytes, %v", i, len(pkt), err)
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
			go func() { sent <- s.Send(pkt, nil) }()
			if pkt, _, err := c.Recv(buf); err != nil || len(pkt) != 1+i*600 || pkt[len(pkt)-1] != big[i*600] {
				t.Fatalf("round %d reply: %d bytes, %v", i, len(pkt), err)
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
		}

		// Deadlines hold.
		s.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
		if _, _, err := s.Recv(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("recv past the deadline: %v", err)
		}
		s.SetReadDeadline(time.Time{})
		c.SetWriteDeadline(time.Now().Add(-time.Second))
		if err := c.Send([]byte("x"), nil); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("send past the deadline: %v", err)
		}
		c.SetWriteDeadline(time.Time{})

		// The peer going away is io.EOF.
		c.Close()
		if _, _, err := s.Recv(buf); !errors.Is(err, io.EOF) {
			t.Fatalf("recv after the peer closed: %v", err)
		}
	})
}

func TestConnSpin(t *testing.T) {
	_, s := pair(t)
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
	// The spin's mechanics, under the rule that always spins: the budgeted
	// rule would end a spin whose yield ran the sending goroutine, or any
	// other thread of this machine.
	withSpinRule(t, SpinAlways)
	inMode(t, func(t *testing.T, c, s *Conn) {
		// A packet that comes while Recv spins is taken by the spin: no
		// kernel wait, no poller. The spin is longer than SetSpin allows,
		// so that a slow machine cannot miss it.
		s.spin = time.Minute
		spins, parks, stats := spun.Load(), parked.Load(), ReadSpinStats()
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
		// The stats say so: one spin, which yielded while it waited a
		// millisecond, and took its packet.
		if d := ReadSpinStats(); d.Spins-stats.Spins != 1 || d.Yields == stats.Yields || d.Taken-stats.Taken != 1 {
			t.Fatalf("spin stats went from %+v to %+v: want one spin, some yields, one packet taken", stats, d)
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

// withSpinRule sets the process's spin rule for the rest of the test.
func withSpinRule(t *testing.T, r SpinRule) {
	t.Helper()
	old := CurrentSpinRule()
	if err := SetSpinRule(r); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = SetSpinRule(old) })
}

func TestSetSpinRule(t *testing.T) {
	if CurrentSpinRule() != SpinBudgeted {
		t.Fatalf("default spin rule %v, want %v", CurrentSpinRule(), SpinBudgeted)
	}
	for _, bad := range []SpinRule{-1, 2, 1 << 20} {
		if err := SetSpinRule(bad); err == nil || CurrentSpinRule() != SpinBudgeted {
			t.Fatalf("SetSpinRule(%v): %v, rule now %v", bad, err, CurrentSpinRule())
		}
	}
	withSpinRule(t, SpinAlways)
	if CurrentSpinRule() != SpinAlways || SpinAlways.String() != "always" || SpinBudgeted.String() != "budgeted" || SpinRule(7).String() != "SpinRule(7)" {
		t.Fatalf("rule %v after SetSpinRule(SpinAlways)", CurrentSpinRule())
	}
}

func TestSpareCPUs(t *testing.T) {
	for _, c := range []struct{ procs, cpus, want int }{
		{1, 1, 1},   // a lone CPU: the lone caller still spins
		{1, 0, 1},   // affinity unknown
		{2, 2, 1},   // one CPU left to the rest of the process
		{8, 8, 7},   // seven spinners at most
		{8, 2, 1},   // GOMAXPROCS above the CPUs the process may use
		{2, 16, 1},  // a CPU quota below the CPUs
		{64, 0, 63}, // affinity unknown: GOMAXPROCS alone
	} {
		if got := spareCPUs(c.procs, c.cpus); got != c.want {
			t.Errorf("spareCPUs(%d, %d) = %d, want %d", c.procs, c.cpus, got, c.want)
		}
	}
}

func TestKeepSpinning(t *testing.T) {
	const w = 50 * time.Microsecond
	for _, c := range []struct {
		name            string
		rule            SpinRule
		elapsed         time.Duration
		waiting, budget int
		switched, want  bool
	}{
		{"lone caller on its own CPU", SpinBudgeted, 10 * time.Microsecond, 1, 1, false, true},
		{"window over", SpinBudgeted, w, 1, 1, false, false},
		{"window over, always", SpinAlways, w + 1, 1, 1, false, false},
		{"more callers than spare CPUs", SpinBudgeted, 0, 2, 1, false, false},
		{"as many callers as spare CPUs", SpinBudgeted, 0, 7, 7, false, true},
		{"the yield ran another thread", SpinBudgeted, time.Microsecond, 1, 1, true, false},
		{"always: crowded", SpinAlways, time.Microsecond, 64, 1, false, true},
		{"always: the CPU taken", SpinAlways, time.Microsecond, 1, 1, true, true},
	} {
		if got := keepSpinning(c.rule, c.elapsed, w, c.waiting, c.budget, c.switched); got != c.want {
			t.Errorf("%s: keepSpinning = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestSpinBackoff(t *testing.T) {
	last := 0
	for i, c := range []struct {
		cut  bool
		want int
	}{
		{false, 0}, {true, 1}, {true, 2}, {true, 4}, {true, 8}, {true, 16},
		{true, 32}, {true, 64}, {true, 64}, {false, 0}, {true, 1}, {false, 0},
	} {
		if last = spinBackoff(last, c.cut); last != c.want {
			t.Fatalf("step %d (cut %v): backoff %d, want %d", i, c.cut, last, c.want)
		}
	}
}

// A Conn spins only within the process's budget of spinning Conns, which
// counts each open Conn with a spin once.
func TestConnSpinBudget(t *testing.T) {
	withPeerElsewhere(t)
	base := spinConns.Load()
	c, s := pair(t)
	buf := make([]byte, MaxMessage+1)
	withSpinRule(t, SpinBudgeted)
	withIdleMachine(t, true) // what a loaded test machine shows is not this test's
	for _, d := range []time.Duration{time.Minute, time.Second, 0, 0, time.Minute} {
		s.SetSpin(min(d, SpinLimit))
		want := base
		if d > 0 {
			want++
		}
		if n := spinConns.Load(); n != want {
			t.Fatalf("after SetSpin(%v): %d spinning conns counted, want %d", d, n, want)
		}
	}
	old := spinBudget
	spinBudget = func() int { return 0 } // every caller is one too many
	t.Cleanup(func() { spinBudget = old })
	inMode(t, func(t *testing.T, c, s *Conn) {
		s.spin = time.Minute
		stats := ReadSpinStats()
		go func() {
			time.Sleep(time.Millisecond)
			c.Send([]byte("soon"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "soon" {
			t.Fatalf("recv %q %v", pkt, err)
		}
		if d := ReadSpinStats(); d != stats {
			t.Fatalf("a spin over the budget ran: spin stats went from %+v to %+v", stats, d)
		}
	})
	// A refused Conn does not ask the gate again for its next gateHold
	// Recvs, and asks at the one after them.
	asked := 0
	spinBudget = func() int { asked++; return 0 }
	s.skip = 0
	for i := range 2*gateHold + 3 {
		c.Send([]byte("x"), nil)
		if _, _, err := s.Recv(buf); err != nil {
			t.Fatal(err)
		}
		if want := i/(gateHold+1) + 1; asked != want {
			t.Fatalf("recv %d: the gate asked %d times, want %d", i, asked, want)
		}
	}
	// A backoff skips the spin for as many Recvs, whatever the budget.
	spinBudget = func() int { return 1 << 20 }
	s.skip = 2
	for i := range 3 {
		spins := spun.Load()
		c.Send([]byte("x"), nil)
		time.Sleep(time.Millisecond) // in the socket before Recv polls
		if _, _, err := s.Recv(buf); err != nil {
			t.Fatal(err)
		}
		if got, want := spun.Load()-spins, int64(min(i/2, 1)); got != want {
			t.Fatalf("recv %d: %d packets taken by the spin, want %d", i, got, want)
		}
	}
	s.Close()
	s.Close()
	if err := s.SetSpin(time.Millisecond); err != nil || spinConns.Load() != base {
		t.Fatalf("after Close: SetSpin %v, %d spinning conns counted, want %d", err, spinConns.Load(), base)
	}
}

// The context switch reading the budgeted spin relies on works here.
func TestInvoluntarySwitches(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var c Conn
	a := c.involuntarySwitches()
	for range 100 {
		_, _, _ = syscall.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	}
	if b := c.involuntarySwitches(); a < 0 || b < a {
		t.Fatalf("involuntary switches %d then %d", a, b)
	}
}

func TestConnCloseWakesRecv(t *testing.T) {
	for _, lane := range []bool{false, true} {
		for _, direct := range []bool{true, false} {
			// Inside the kernel wait (a direct Conn's recvmsg), then past it
			// (on the poller).
			for _, after := range []time.Duration{BlockWindow / 4, 50 * time.Millisecond} {
				name := fmt.Sprintf("%s/%v", modeName(direct), after)
				if lane {
					name += "/lane"
				}
				t.Run(name, func(t *testing.T) {
					c, s := pairIn(t, direct)
					if lane {
						withLane(t, c, s)
					}
					errc := make(chan error, 1)
					go func() {
						_, _, err := s.Recv(make([]byte, MaxMessage+1))
						errc <- err
					}()
					time.Sleep(after)
					if err := s.Close(); err != nil {
						t.Fatal(err)
					}
					if err := <-errc; !errors.Is(err, net.ErrClosed) {
						t.Fatalf("recv on a conn closed %v into it: %v", after, err)
					}
					if _, _, err := s.Recv(make([]byte, 16)); !errors.Is(err, net.ErrClosed) {
						t.Fatalf("recv after close: %v", err)
					}
					if err := s.Send([]byte("x"), nil); !errors.Is(err, net.ErrClosed) {
						t.Fatalf("send after close: %v", err)
					}
					if err := s.SetDeadline(time.Now()); !errors.Is(err, net.ErrClosed) {
						t.Fatalf("deadline after close: %v", err)
					}
					if err := s.Close(); !errors.Is(err, net.ErrClosed) {
						t.Fatalf("second close: %v", err)
					}
				})
			}
		}
	}
}

// The first blockLimit Conns of the process are direct, the next ones
// polled; closing a direct one (once, however often it is closed) frees
// its place.
func TestConnDirectBudget(t *testing.T) {
	old := blockLimit
	defer func() { blockLimit = old }()
	base := directSlots.Load()
	blockLimit = func() int { return int(base) + 1 }
	c, s := pair(t) // a dialed Conn is direct, an accepted one polled
	if c.d == nil || s.d != nil {
		t.Fatalf("direct: client %v, server %v; want the client alone", c.d != nil, s.d != nil)
	}
	if s.TryDirect() || s.d != nil {
		t.Fatal("promoted with no place free")
	}
	// A direct Conn waits in the kernel only while the process has no
	// more Conns open than the limit; a polled one never.
	blockLimit = func() int { return int(open.Load()) }
	if !c.mayBlock() || s.mayBlock() {
		t.Fatalf("within the limit: may block %v and %v, want the client alone", c.mayBlock(), s.mayBlock())
	}
	blockLimit = func() int { return int(open.Load()) - 1 }
	if c.mayBlock() {
		t.Fatal("over the limit, a direct Conn should not wait in the kernel")
	}
	blockLimit = func() int { return int(base) + 1 }
	n := open.Load()
	if got := directSlots.Load(); got != base+1 {
		t.Fatalf("%d direct conns counted, want %d", got, base+1)
	}
	c.Close()
	c.Close()
	if got := directSlots.Load(); got != base || open.Load() != n-1 {
		t.Fatalf("%d direct conns and %d open counted after closing one (twice), want %d and %d", got, open.Load(), base, n-1)
	}
	// Its place is free again, and a failed dial does not keep it.
	if _, err := Dial(filepath.Join(t.TempDir(), "nobody")); err == nil || directSlots.Load() != base {
		t.Fatalf("dial nowhere: %v, %d direct conns counted", err, directSlots.Load())
	}
	// The place goes to the server side's Conn when it asks for it.
	if !s.TryDirect() || s.d == nil || directSlots.Load() != base+1 || !s.TryDirect() {
		t.Fatalf("promotion with a place free: direct %v, %d counted", s.d != nil, directSlots.Load())
	}
	s.Close()
	c2, s2 := pair(t)
	if c2.d == nil || s2.d != nil {
		t.Fatalf("direct after a close: client %v, server %v", c2.d != nil, s2.d != nil)
	}
	// A promoted Conn works both ways, with what was queued before.
	if err := c2.Send([]byte("early"), nil); err != nil {
		t.Fatal(err)
	}
	blockLimit = func() int { return int(base) + 2 }
	if !s2.TryDirect() {
		t.Fatal("no promotion with a place free")
	}
	if pkt, _, err := s2.Recv(make([]byte, 16)); err != nil || string(pkt) != "early" {
		t.Fatalf("recv after the promotion %q %v", pkt, err)
	}
	for _, x := range [][2]*Conn{{c2, s2}, {s2, c2}} {
		if err := x[0].Send([]byte("ping"), nil); err != nil {
			t.Fatal(err)
		}
		if pkt, _, err := x[1].Recv(make([]byte, 16)); err != nil || string(pkt) != "ping" {
			t.Fatalf("recv %q %v", pkt, err)
		}
	}
	// A read deadline sends a direct Conn's waits to the poller, which
	// keeps it exactly.
	blockLimit = func() int { return 1 << 20 }
	if err := c2.SetReadDeadline(time.Now().Add(time.Hour)); err != nil || c2.mayBlock() {
		t.Fatalf("with a read deadline: %v, may block %v", err, c2.mayBlock())
	}
	if err := c2.SetReadDeadline(time.Time{}); err != nil || !c2.mayBlock() {
		t.Fatalf("deadline cleared: %v, may block %v", err, c2.mayBlock())
	}
}

// The direct Conns' limit and the spin's budget follow GOMAXPROCS without
// a Recv asking the runtime (whose answer takes the scheduler's global
// lock) every time: a Conn reads it again once in procsEvery Recvs, and a
// Conn taking a direct place reads it at once.
func TestProcsFollowGOMAXPROCS(t *testing.T) {
	was := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(was); readProcs() })
	c, s := pair(t)
	if int(procs.Load()) != was {
		t.Fatalf("procs %d, GOMAXPROCS %d", procs.Load(), was)
	}
	runtime.GOMAXPROCS(was + 1)
	c.rmu.Lock()
	c.recvs = 0
	c.rmu.Unlock()
	buf := make([]byte, MaxMessage+1)
	for i := 1; i <= procsEvery; i++ {
		if err := s.Send([]byte{byte(i)}, nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := c.Recv(buf); err != nil {
			t.Fatal(err)
		}
		want := was
		if i == procsEvery {
			want = was + 1
		}
		if got := int(procs.Load()); got != want {
			t.Fatalf("after %d Recvs since GOMAXPROCS became %d: procs %d, want %d", i, was+1, got, want)
		}
	}
	if got, want := blockLimit(), max(1, was); got != want {
		t.Fatalf("blockLimit %d at GOMAXPROCS %d, want %d", got, was+1, want)
	}
	runtime.GOMAXPROCS(was + 2)
	_, _ = pair(t) // its Dial takes a direct place, or tries to
	if got := int(procs.Load()); got != was+2 {
		t.Fatalf("a Dial after GOMAXPROCS became %d left procs at %d", was+2, got)
	}
}

// A failed dial is a *net.OpError naming the path, in both kinds of Conn,
// as net.DialUnix's (callers tell "nobody there" by it).
func TestDialErrors(t *testing.T) {
	dir := t.TempDir()
	notSocket := filepath.Join(dir, "file")
	if err := os.WriteFile(notSocket, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, direct := range []bool{true, false} {
		for _, path := range []string{filepath.Join(dir, "nobody"), notSocket, "/" + strings.Repeat("x", 200)} {
			old := blockLimit
			blockLimit = func() int {
				if direct {
					return 1 << 20
				}
				return 0
			}
			n := directSlots.Load()
			c, err := Dial(path)
			blockLimit = old
			var op *net.OpError
			if err == nil || !errors.As(err, &op) || op.Op != "dial" || !strings.Contains(err.Error(), path) || directSlots.Load() != n {
				if c != nil {
					c.Close()
				}
				t.Errorf("%s: dial %.40s: %v (%T); %d direct conns counted, want %d", modeName(direct), path, err, err, directSlots.Load(), n)
			}
		}
	}
}

// A direct Conn's socket is in no epoll set of the process (the point of
// it: every packet to a registered socket costs a callback in the kernel),
// a polled Conn's is in Go's.
func TestConnDirectOutOfPoller(t *testing.T) {
	c, s := pairIn(t, true)
	// A wait past the kernel's goes to the poller, and leaves it after.
	go func() {
		time.Sleep(kernelStay + 50*time.Millisecond)
		c.Send([]byte("late"), nil)
	}()
	parks := parked.Load()
	if pkt, _, err := s.Recv(make([]byte, 16)); err != nil || string(pkt) != "late" || parked.Load() == parks {
		t.Fatalf("late recv %q %v, %d waits past the kernel wait", pkt, err, parked.Load()-parks)
	}
	var flags int
	var ferr error
	if err := s.rc.Control(func(fd uintptr) { flags, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) }); err != nil || ferr != nil {
		t.Fatal(err, ferr)
	}
	if flags&unix.O_NONBLOCK != 0 {
		t.Fatal("a direct socket left non-blocking after a wait on the poller")
	}
	pc, ps := pairIn(t, false)
	watched := epollTargets(t)
	for _, x := range []struct {
		what string
		c    *Conn
		in   bool
	}{{"direct client", c, false}, {"direct server", s, false}, {"polled client", pc, true}, {"polled server", ps, true}} {
		if ino := inode(t, x.c); watched[ino] != x.in {
			t.Errorf("%s (socket inode %d): in an epoll set %v, want %v", x.what, ino, watched[ino], x.in)
		}
	}
}

// A direct Conn that waits on the poller while the process has more Conns
// open than blockLimit keeps its socket registered from then on (no
// kernel wait, no registration a wait), and still works and closes.
// closeEndsRecv closes s while a Recv waits on it (where, for the message)
// and checks that the Recv returns net.ErrClosed.
func closeEndsRecv(t *testing.T, s *Conn, buf []byte, where string) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		_, _, err := s.Recv(buf)
		errc <- err
	}()
	time.Sleep(5 * time.Millisecond)
	s.Close()
	if err := <-errc; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("recv on a conn closed while it waited %s: %v", where, err)
	}
}

func TestConnDirectKeptOnPoller(t *testing.T) {
	c, s := pairIn(t, true)
	blockLimit = func() int { return int(open.Load()) - 1 } // pairIn restores it
	buf := make([]byte, 16)
	for i := range 3 {
		go func() {
			time.Sleep(5 * time.Millisecond)
			c.Send([]byte("late"), nil)
		}()
		if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "late" {
			t.Fatalf("recv %d: %q %v", i, pkt, err)
		}
	}
	if s.d.kept == nil || s.mayBlock() || !s.d.nonBlock.Load() {
		t.Fatalf("kept %v, may block %v, non-blocking %v; want a kept duplicate and no kernel wait", s.d.kept != nil, s.mayBlock(), s.d.nonBlock.Load())
	}
	if !epollTargets(t)[inode(t, s)] {
		t.Fatal("the kept duplicate is not registered")
	}
	// A deadline on the kept duplicate holds, and is gone after.
	if err := s.SetReadDeadline(time.Now().Add(5 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Recv(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("recv past the deadline: %v", err)
	}
	if err := s.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(20 * time.Millisecond)
		c.Send([]byte("after"), nil)
	}()
	if pkt, _, err := s.Recv(buf); err != nil || string(pkt) != "after" {
		t.Fatalf("recv after the deadline was cleared: %q %v", pkt, err)
	}
	closeEndsRecv(t, s, buf, "on the kept duplicate")

	// Back within the limit (the Conns over it were short-lived: a
	// probe), the next wait lets the duplicate go: the socket is out of
	// the epoll set and waits in the kernel again.
	c2, s2 := pairIn(t, true)
	blockLimit = func() int { return int(open.Load()) - 1 }
	go func() {
		time.Sleep(5 * time.Millisecond)
		c2.Send([]byte("late"), nil)
	}()
	if _, _, err := s2.Recv(buf); err != nil || s2.d.kept == nil {
		t.Fatalf("recv over the limit: %v, kept %v", err, s2.d.kept != nil)
	}
	blockLimit = func() int { return 1 << 20 }
	for i := range 2 {
		if err := c2.Send([]byte("x"), nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s2.Recv(buf); err != nil {
			t.Fatal(err)
		}
		if i == 0 && (s2.d.kept != nil || s2.d.nonBlock.Load() || epollTargets(t)[inode(t, s2)]) {
			t.Fatalf("within the limit again: kept %v, non-blocking %v", s2.d.kept != nil, s2.d.nonBlock.Load())
		}
	}
	if !s2.mayBlock() {
		t.Fatal("within the limit again, the Conn should wait in the kernel")
	}
}

// inode returns the inode of c's socket.
func inode(t *testing.T, c *Conn) uint64 {
	t.Helper()
	var st unix.Stat_t
	var serr error
	if err := c.rc.Control(func(fd uintptr) { serr = unix.Fstat(int(fd), &st) }); err != nil || serr != nil {
		t.Fatal(err, serr)
	}
	return st.Ino
}

// epollTargets returns the inodes of the files registered in the process's
// epoll sets, from /proc/self/fdinfo (whatever descriptor registered them).
func epollTargets(t *testing.T) map[uint64]bool {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	out := map[uint64]bool{}
	sets := 0
	for _, e := range fds {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); l != "anon_inode:[eventpoll]" {
			continue
		}
		info, err := os.ReadFile("/proc/self/fdinfo/" + e.Name())
		if err != nil {
			continue
		}
		sets++
		for _, line := range strings.Split(string(info), "\n") {
			if !strings.HasPrefix(line, "tfd:") {
				continue
			}
			for _, f := range strings.Fields(line) {
				if v, ok := strings.CutPrefix(f, "ino:"); ok {
					ino, err := strconv.ParseUint(v, 16, 64)
					if err != nil {
						t.Fatalf("fdinfo line %q: %v", line, err)
					}
					out[ino] = true
				}
			}
		}
	}
	if sets == 0 {
		t.Fatal("no epoll set in the process, though polled Conns are open")
	}
	return out
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
	n := directSlots.Load()
	c, s := pair(t)
	if c.d != nil || s.d != nil || c.mayBlock() || directSlots.Load() != n {
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
	c2, s2 := pairIn(t, true)
	if c2.d == nil || s2.d == nil {
		t.Fatal("with a kernel wait set a Conn should be set up for direct waits")
	}
	if err := c2.Send([]byte("x"), nil); err != nil {
		t.Fatal(err)
	}
	if pkt, _, err := s2.Recv(buf); err != nil || string(pkt) != "x" {
		t.Fatalf("recv: %q %v", pkt, err)
	}
}

// A Conn whose peer is this very process (an agent embedded beside its
// client) never spins under the budgeted rule, nor counts as a spinner:
// the peer's reply needs a P, and a spin holds one.
func TestSpinNotForAPeerInProcess(t *testing.T) {
	withSpinRule(t, SpinBudgeted)
	withIdleMachine(t, true)
	base := spinConns.Load()
	buf := make([]byte, MaxMessage+1)
	inMode(t, func(t *testing.T, c, s *Conn) {
		if err := s.SetSpin(SpinLimit); err != nil {
			t.Fatal(err)
		}
		if !s.peerHere || spinConns.Load() != base {
			t.Fatalf("peer in process %v, %d spinning conns counted, want %d", s.peerHere, spinConns.Load(), base)
		}
		s.spin = time.Minute
		for range 3 {
			spins := spun.Load()
			c.Send([]byte("x"), nil)
			time.Sleep(time.Millisecond) // in the socket before Recv polls
			if _, _, err := s.Recv(buf); err != nil {
				t.Fatal(err)
			}
			if n := spun.Load() - spins; n != 0 {
				t.Fatalf("%d packets taken by a spin whose peer is this process", n)
			}
		}
	})
}

// A Conn that refuses files (RefuseFiles) reads with recvfrom: a peer's
// files are refused at its send and nothing arrives; a packet longer than
// the buffer, or than MaxMessage, is still ErrTooLarge; it says so twice
// and changes nothing the second time.
func TestRefuseFiles(t *testing.T) {
	inMode(t, func(t *testing.T, c, s *Conn) {
		if !s.noFiles {
			return // the usual Conns: TestConnPassesFDsAndLimits
		}
		if !s.RefuseFiles() || !s.noFiles {
			t.Fatal("a second RefuseFiles did not report the first")
		}
		f, err := os.CreateTemp(t.TempDir(), "fd")
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := c.Send([]byte("with a file"), []int{int(f.Fd())}); !errors.Is(err, unix.EPERM) {
			t.Fatalf("send of a file to a socket refusing them: %v, want EPERM", err)
		}
		buf := make([]byte, MaxMessage+1)
		if err := c.Send([]byte("after"), nil); err != nil {
			t.Fatal(err)
		}
		if pkt, files, err := s.Recv(buf); err != nil || string(pkt) != "after" || len(files) != 0 {
			t.Fatalf("recv %q, %d files, %v; want the packet after the refused one, alone", pkt, len(files), err)
		}

		// A packet longer than the buffer is not cut short silently.
		if err := c.Send(make([]byte, 100), nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.Recv(make([]byte, 99)); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("100 bytes into 99: %v, want ErrTooLarge", err)
		}
		// Nor one longer than MaxMessage, past Send's own check.
		recvOversized(t, c, s)
		// An empty buffer after a full one: the packet is too large for
		// it, not a fault.
		if err := c.Send([]byte("x"), nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := s.Recv(nil); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("a packet into no buffer: %v, want ErrTooLarge", err)
		}
		// Exactly MaxMessage is a packet.
		if err := c.Send(make([]byte, MaxMessage), nil); err != nil {
			t.Fatal(err)
		}
		if pkt, _, err := s.Recv(buf); err != nil || len(pkt) != MaxMessage {
			t.Fatalf("recv of MaxMessage bytes: %d, %v", len(pkt), err)
		}
	})
}
