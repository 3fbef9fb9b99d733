package adversarial

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/keeper"
)

// Row 17: the keeper's socket. An agent whose keeper socket is inside the
// socket directory pods mount refuses to start (a process in a pod could
// take the pool's chunks and books from the keeper while the agent is
// down); and a local process flooding the keeper with idle connections
// grows neither its descriptors nor its memory past its bound, nor keeps
// the agent out.
func TestRow17KeeperSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvadv17")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	t.Run("inside-the-socket-dir", func(t *testing.T) {
		a := launch(t, append(agentArgs(dir), "--keeper-socket", filepath.Join(dir, "sock", "keeper.sock"))...)
		select {
		case <-a.done:
		case <-time.After(20 * time.Second):
			t.Fatal("the agent started with its keeper socket inside the socket directory")
		}
		if a.err == nil || !strings.Contains(a.logText(), "is inside the socket directory") {
			t.Fatalf("exit %v, log:\n%s", a.err, tail(a.logText(), 2<<10))
		}
	})
	t.Run("idle-connection-flood", func(t *testing.T) {
		ksock := filepath.Join(dir, "keeper", "keeper.sock")
		kp := exec.Command(bins.agent, "keeper", "--socket", ksock, "--log-level", "error")
		kp.Stderr = os.Stderr
		if err := kp.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { kp.Process.Signal(syscall.SIGTERM); kp.Wait() }()
		for deadline := time.Now().Add(10 * time.Second); ; {
			if _, err := os.Stat(ksock); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no keeper socket")
			}
			time.Sleep(20 * time.Millisecond)
		}
		fds := func() int {
			ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", kp.Process.Pid))
			if err != nil {
				t.Fatal(err)
			}
			return len(ents)
		}
		base := fds()
		// The attacker re-dials every connection the keeper closes.
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				var held []*net.UnixConn
				defer func() {
					for _, c := range held {
						c.Close()
					}
				}()
				for {
					select {
					case <-stop:
						return
					default:
					}
					c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: ksock, Net: "unixpacket"})
					if err == nil {
						held = append(held, c)
					}
					if len(held) > 40 {
						held[0].Close()
						held = held[1:]
					}
					time.Sleep(2 * time.Millisecond)
				}
			})
		}
		defer func() { close(stop); wg.Wait() }()
		time.Sleep(500 * time.Millisecond)
		worst := 0
		for range 10 {
			worst = max(worst, fds())
			time.Sleep(50 * time.Millisecond)
		}
		if worst > base+keeper.MaxConns+4 {
			t.Errorf("the keeper holds %d fds under the flood, bound %d (baseline %d + %d connections + 4)", worst, base+keeper.MaxConns+4, base, keeper.MaxConns)
		}
		// The agent gets its connection all the same, and serves.
		a := startAgent(t, "--keeper-socket", ksock)
		runGood(t, a)
		st, err := keeper.Query(ksock)
		if err != nil || !st.Agent || st.Chunks != 2*chunksPerGPU {
			t.Fatalf("keeper stat under the flood: %+v %v", st, err)
		}
		t.Logf("keeper fds: baseline %d, at most %d under the flood; the agent connected and holds %d chunks in it", base, worst, st.Chunks)
	})
}

// Row 18: idle connections cannot lock a tenant out. Four processes of
// the tenant's own uid hold every connection the uid may have (each at its
// per-process bound) with connections that say hello and never open, and
// dial again the moment one is closed; the well-behaved client, of the same
// uid, still opens its session and passes (the oldest idle connection makes
// room for it), and the agent stays ready: it never refused a client it
// could make room for.
func TestRow18IdleConnectionsCannotLockOut(t *testing.T) {
	a := startAgent(t)
	var hs []*helper
	for range limConns / limConnsPerPID {
		h := startHelper(t, a, fmt.Sprintf("redial %d", limConnsPerPID))
		h.expect(t, "redialing")
		hs = append(hs, h)
	}
	time.Sleep(time.Second) // every place taken, and the squatters older than the eviction grace
	before := a.rejects("evicted_idle")
	g := startGood(t, a, 0, 2*time.Second)
	g.wait(t)
	if ev := a.rejects("evicted_idle") - before; ev < 1 {
		t.Errorf("the good client got in without an eviction: %v (were the squatters at the bound?)", ev)
	}
	if a.probe("/readyz") != 200 {
		t.Errorf("/readyz %d while connections without sessions made room", a.probe("/readyz"))
	}
	for _, h := range hs {
		h.stop()
	}
	t.Logf("evictions: %.0f; refused at a bound: %.0f", a.rejects("evicted_idle")-before, a.rejects("conns")+a.rejects("conns_per_uid")+a.rejects("conns_per_pid"))
}
