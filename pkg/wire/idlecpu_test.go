package wire

import (
	"errors"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestParseLoadavgRunning(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"0.61 1.14 1.77 3/412 12345\n", 3, true},
		{"12.00 11.50 9.25 130/2048 99", 130, true},
		{"0.00 0.00 0.00 0/1 1", 0, true},
		{"", 0, false},
		{"0.61 1.14 1.77", 0, false},
		{"0.61 1.14 1.77 ", 0, false},
		{"0.61 1.14 1.77 3", 0, false},
		{"0.61 1.14 1.77 /412 1", 0, false},
		{"0.61 1.14 1.77 x/412 1", 0, false},
		{"0.61 1.14 1.77 3412 1", 0, false},
		{"0.61 1.14 1.77 12345678901/4 1", 0, false},
	} {
		got, ok := parseLoadavgRunning([]byte(c.in))
		if got != c.want || ok != c.ok {
			t.Errorf("parseLoadavgRunning(%q) = %d, %v; want %d, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

// The machine's own files parse: the gate is not silently open here.
func TestIdleCPUReadsThisMachine(t *testing.T) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		t.Skipf("no /proc/loadavg: %v", err)
	}
	if _, ok := parseLoadavgRunning(b); !ok {
		t.Fatalf("/proc/loadavg %q does not parse", b)
	}
	if onlineCPUs <= 0 {
		t.Fatalf("online CPUs unknown (%d)", onlineCPUs)
	}
	// The gate's own raw read sees the same file, and a missing one is an
	// error, not an empty reading.
	var buf [128]byte
	n, err := readSmall(loadavgPath, buf[:])
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := parseLoadavgRunning(buf[:n]); !ok {
		t.Fatalf("readSmall read %q", buf[:n])
	}
	if n, err := readSmall([]byte("/proc/no-such-file\x00"), buf[:]); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("readSmall of a missing file: %d bytes, %v", n, err)
	}
}

// A reading stands for a while (idleCPUEvery, idleCPUBusyHold): the
// kernel is asked once, not per Recv, and a busy machine's reading closes
// the gate until the next.
func TestIdleCPUCachesItsReading(t *testing.T) {
	reads, busy := 0, true
	old := idleCPURead
	idleCPURead = func() bool { reads++; return !busy }
	idleUntil.Store(0)
	t.Cleanup(func() { idleCPURead = old; idleUntil.Store(0) })

	for range 100 {
		if idleCPU() {
			t.Fatal("the gate opened on a busy reading")
		}
	}
	if reads != 1 {
		t.Fatalf("%d readings for 100 calls within %v, want 1", reads, idleCPUEvery)
	}
	busy = false
	idleUntil.Store(1) // the last reading is old now
	if !idleCPU() || reads != 2 {
		t.Fatalf("an old reading was not renewed: reads %d", reads)
	}
	// A busy reading stands longer than an idle one.
	busy = true
	idleUntil.Store(1)
	idleCPU()
	busyFor := idleUntil.Load() - int64(time.Since(idleEpoch))
	busy = false
	idleUntil.Store(1)
	idleCPU()
	idleFor := idleUntil.Load() - int64(time.Since(idleEpoch))
	if busyFor <= idleFor || busyFor > int64(idleCPUBusyHold) || idleFor > int64(idleCPUEvery) {
		t.Fatalf("a busy reading stands %v, an idle one %v; want at most %v and %v, busy the longer",
			time.Duration(busyFor), time.Duration(idleFor), idleCPUBusyHold, idleCPUEvery)
	}
}

// withIdleMachine makes the machine-wide gate (idleCPU) read idle, or
// busy, for the test.
func withIdleMachine(t *testing.T, idle bool) {
	t.Helper()
	old := idleCPURead
	idleCPURead = func() bool { return idle }
	idleUntil.Store(0)
	t.Cleanup(func() { idleCPURead = old; idleUntil.Store(0) })
}

// spinningPair is a connected pair whose second end spins as long as it
// may, in a process whose spin budget has room for any number of callers.
func spinningPair(t *testing.T) (c, s *Conn, buf []byte) {
	t.Helper()
	withPeerElsewhere(t)
	c, s = pair(t)
	if err := s.SetSpin(SpinLimit); err != nil {
		t.Fatal(err)
	}
	old := spinBudget
	spinBudget = func() int { return 1 << 20 }
	t.Cleanup(func() { spinBudget = old })
	return c, s, make([]byte, MaxMessage+1)
}

// A budgeted Conn does not spin while the machine's runnable tasks fill
// its CPUs, however much budget its process has; SpinAlways does.
func TestSpinGatedByTheMachine(t *testing.T) {
	c, s, buf := spinningPair(t)
	for _, tc := range []struct {
		rule SpinRule
		idle bool
		want int64
	}{
		{SpinBudgeted, false, 0},
		{SpinBudgeted, true, 1},
		{SpinAlways, false, 1},
	} {
		withSpinRule(t, tc.rule)
		withIdleMachine(t, tc.idle)
		s.skip = 0
		spins := spun.Load()
		c.Send([]byte("x"), nil)
		time.Sleep(time.Millisecond) // in the socket before Recv polls
		if _, _, err := s.Recv(buf); err != nil {
			t.Fatal(err)
		}
		if got := spun.Load() - spins; got != tc.want {
			t.Errorf("%v, machine idle %v: %d packets taken by the spin, want %d", tc.rule, tc.idle, got, tc.want)
		}
	}
}

// A reply already waiting is taken by the spin's first poll, before the
// spin locks its thread and reads its switches (the bookkeeping of a spin
// that yields): on one CPU the send that woke the peer has usually let it
// answer already. A reply that comes later is waited for by the spin
// proper.
func TestSpinFirstPollSkipsTheBookkeeping(t *testing.T) {
	c, s, buf := spinningPair(t)
	withSpinRule(t, SpinBudgeted)
	withIdleMachine(t, true)

	s.skip = 0
	spins, w := spun.Load(), watched.Load()
	c.Send([]byte("x"), nil)
	time.Sleep(time.Millisecond) // in the socket before Recv polls
	if _, _, err := s.Recv(buf); err != nil {
		t.Fatal(err)
	}
	if got, gw := spun.Load()-spins, watched.Load()-w; got != 1 || gw != 0 {
		t.Errorf("a waiting reply: %d taken by the spin, %d spins watched; want 1 and 0", got, gw)
	}
	if s.skip != 1 {
		t.Errorf("after a waiting reply the next %d Recvs skip the spin, want 1 (a backoff)", s.skip)
	}

	s.skip = 0
	w = watched.Load()
	go func() {
		time.Sleep(5 * time.Millisecond)
		c.Send([]byte("y"), nil)
	}()
	if _, _, err := s.Recv(buf); err != nil {
		t.Fatal(err)
	}
	if gw := watched.Load() - w; gw != 1 {
		t.Errorf("a reply still to come: %d spins watched, want 1", gw)
	}
}

// A reply already waiting at the spin's first poll came while the Conn's
// thread was still in its send: the peer runs on this CPU, where a spin
// saves no wake-up. The Conn backs off as after a cut spin, skipping the
// spin (and the gate) for 1, 2, 4 ... Recvs, while replies keep coming
// that way.
func TestSpinBacksOffFromAWaitingReply(t *testing.T) {
	c, s, buf := spinningPair(t)
	withSpinRule(t, SpinBudgeted)
	withIdleMachine(t, true)
	asked := 0
	spinBudget = func() int { asked++; return 1 << 20 } // spinningPair restores it
	s.skip, s.lastBackoff = 0, 0
	var ran []int
	for i := range 16 {
		c.Send([]byte("x"), nil)
		time.Sleep(time.Millisecond) // in the socket before Recv polls
		before := asked
		if _, _, err := s.Recv(buf); err != nil {
			t.Fatal(err)
		}
		if asked != before {
			ran = append(ran, i)
		}
	}
	if want := []int{0, 2, 5, 10}; !slices.Equal(ran, want) {
		t.Fatalf("the spin ran at Recvs %v, want %v (backoffs of 1, 2 and 4 Recvs)", ran, want)
	}
}

func FuzzParseLoadavgRunning(f *testing.F) {
	f.Add([]byte("0.61 1.14 1.77 3/412 12345\n"))
	f.Add([]byte("0.61 1.14 1.77 /412"))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, ok := parseLoadavgRunning(b)
		if !ok && n != 0 || n < 0 {
			t.Fatalf("parseLoadavgRunning(%q) = %d, %v", b, n, ok)
		}
		if ok && !strings.Contains(string(b), strconv.Itoa(n)+"/") {
			t.Fatalf("parseLoadavgRunning(%q) = %d: not in the input", b, n)
		}
	})
}

// withPeerElsewhere makes SetSpin take every peer for another process's
// (this package's pairs are all in process) until the test ends.
func withPeerElsewhere(t *testing.T) {
	old := peerInProcess
	peerInProcess = func(int) bool { return false }
	t.Cleanup(func() { peerInProcess = old })
}
