package health

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvpool/kvpool/pkg/pool"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func TestHeartbeat(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	h := New(Options{Now: clk.Now})
	plugin := h.Heartbeat("plugin-loop", 10*time.Second)
	reclaim := h.Heartbeat("reclaim-loop", 30*time.Second)
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()

	steps := []struct {
		do       func()
		wantCode int
		want     []string
	}{
		{func() {}, 200, []string{"[+]plugin-loop ok", "[+]reclaim-loop ok", "livez ok"}},
		{func() { clk.Add(9 * time.Second) }, 200, []string{"[+]plugin-loop ok"}},
		{func() { clk.Add(2 * time.Second) }, 503, []string{"[-]plugin-loop failed: plugin-loop made no progress for 11s (limit 10s)", "[+]reclaim-loop ok", "livez failed"}},
		{func() { plugin.Beat() }, 200, []string{"[+]plugin-loop ok"}},
		{func() { clk.Add(25 * time.Second); plugin.Beat() }, 503, []string{"[+]plugin-loop ok", "[-]reclaim-loop failed"}},
		{func() { reclaim.Beat() }, 200, []string{"livez ok"}},
	}
	for i, s := range steps {
		s.do()
		code, body := get(t, srv.URL+"/livez")
		if code != s.wantCode {
			t.Errorf("step %d: status %d, want %d; body:\n%s", i, code, s.wantCode, body)
		}
		for _, w := range s.want {
			if !strings.Contains(body, w) {
				t.Errorf("step %d: body lacks %q:\n%s", i, w, body)
			}
		}
	}
}

// /livez/<check> and /readyz/<check> run one check of their probe.
func TestOneCheck(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	h := New(Options{Now: clk.Now})
	h.Heartbeat("plugin-loop", 10*time.Second)
	h.Heartbeat("reclaim-loop", 30*time.Second)
	h.AddReadiness("chunks", func(context.Context) error { return errors.New("no chunk ready") })
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()
	clk.Add(11 * time.Second) // plugin-loop fails, reclaim-loop passes
	for _, c := range []struct {
		path     string
		wantCode int
		want     string
	}{
		{"/livez/reclaim-loop", 200, "[+]reclaim-loop ok\nlivez/reclaim-loop ok\n"},
		{"/livez/plugin-loop", 503, "[-]plugin-loop failed: plugin-loop made no progress for 11s (limit 10s)\nlivez/plugin-loop failed\n"},
		{"/readyz/chunks", 503, "[-]chunks failed: no chunk ready\nreadyz/chunks failed\n"},
		{"/readyz/plugin-loop", 404, "readyz has no check \"plugin-loop\"\n"},
		{"/livez/nothing", 404, "livez has no check \"nothing\"\n"},
	} {
		code, body := get(t, srv.URL+c.path)
		if code != c.wantCode || body != c.want {
			t.Errorf("GET %s: %d %q, want %d %q", c.path, code, body, c.wantCode, c.want)
		}
	}
}

// greeter is a tiny socket server with the shape of the agent's: an accept
// loop that hands each connection to a goroutine which answers a greeting.
// Holding wedge stalls the accept loop, as a deadlocked server would.
type greeter struct {
	ln    net.Listener
	wedge sync.Mutex
}

func startGreeter(t *testing.T, path string) *greeter {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	g := &greeter{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			g.wedge.Lock()
			g.wedge.Unlock() //nolint:staticcheck // a stall point, not a critical section
			go func() {
				defer conn.Close()
				line, err := bufio.NewReader(conn).ReadString('\n')
				if err == nil && line == "KVPOOL 1\n" {
					io.WriteString(conn, "OK 1\n")
				}
			}()
		}
	}()
	return g
}

func hello(_ context.Context, conn net.Conn) error {
	if _, err := io.WriteString(conn, "KVPOOL 1\n"); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "OK 1\n" {
		return errors.New("unexpected greeting " + line)
	}
	return nil
}

func TestWedgedServerFailsLiveness(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "kvpool.sock")
	g := startGreeter(t, sock)
	h := New(Options{Timeout: 300 * time.Millisecond})
	h.AddLiveness("socket", Dial("unix", sock, hello))
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()

	if code, body := get(t, srv.URL+"/livez"); code != 200 {
		t.Fatalf("healthy server: %d\n%s", code, body)
	}
	g.wedge.Lock()
	code, body := get(t, srv.URL+"/livez")
	// The handshake's own deadline and the probe's timeout are the same
	// instant; on a loaded machine either may report first.
	byHandshake := strings.Contains(body, "[-]socket failed: handshake on "+sock) && strings.Contains(body, "timeout")
	byProbe := strings.Contains(body, "[-]socket failed: no answer within 300ms")
	if code != 503 || !(byHandshake || byProbe) {
		t.Errorf("wedged server: %d\n%s", code, body)
	}
	g.wedge.Unlock()
	// The timed-out check may still be winding down (reported as wedged,
	// not run twice); the probe recovers once it has.
	if code, body := getUntil(t, srv.URL+"/livez", func(code int, _ string) bool { return code == 200 }); code != 200 {
		t.Errorf("recovered server: %d\n%s", code, body)
	}
	// A server that is gone fails at once, with the dial error.
	g.ln.Close()
	if code, body := get(t, srv.URL+"/livez"); code != 503 || !strings.Contains(body, "dial "+sock) {
		t.Errorf("closed server: %d\n%s", code, body)
	}
}

// A check that ignores its context fails by timeout, and is not started again
// while it stays stuck; once it returns, the next probe runs it afresh. On
// synctest's virtual clock the timeout and the wedge's age are exact, and
// "once it returns" is synctest.Wait, not a polling loop.
func TestWedgedCheckIsNotRestarted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := New(Options{Timeout: 50 * time.Millisecond})
		release := make(chan struct{})
		var starts atomic.Int32
		h.AddLiveness("stuck", func(context.Context) error {
			starts.Add(1)
			<-release
			return nil
		})
		ctx := context.Background()
		start := time.Now()
		r := h.Live(ctx)
		if r.OK() || !strings.Contains(r.Reason(), "no answer within 50ms") || time.Since(start) != 50*time.Millisecond {
			t.Fatalf("first probe after %s: %v", time.Since(start), r)
		}
		time.Sleep(time.Second)
		r = h.Live(ctx)
		if r.OK() || !strings.Contains(r.Reason(), "still running since 1.05s ago (wedged)") {
			t.Fatalf("second probe: %v", r)
		}
		if n := starts.Load(); n != 1 {
			t.Fatalf("check started %d times while stuck, want 1", n)
		}
		close(release)
		synctest.Wait() // the stuck check has returned
		if r := h.Live(ctx); !r.OK() {
			t.Fatalf("probe after the check returned: %v", r)
		}
		if n := starts.Load(); n != 2 {
			t.Fatalf("check started %d times, want 2 (rerun once it returned)", n)
		}
	})
}

func TestReadinessFlips(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kvpool.sock")
	p := pool.New()
	var registered Flag
	h := New(Options{Timeout: 300 * time.Millisecond})
	h.AddReadiness("chunks", ChunksReady(p))
	h.AddReadiness("socket", Dial("unix", sock, hello))
	h.AddReadiness("kubelet-registration", registered.Check)
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()

	steps := []struct {
		name     string
		do       func(t *testing.T)
		wantCode int
		want     []string
	}{
		{"start", func(*testing.T) {}, 503, []string{
			"[-]chunks failed: no chunk ready (0 awaiting scrub)",
			"[-]socket failed: dial " + sock,
			"[-]kubelet-registration failed: not yet",
			"readyz failed",
		}},
		{"first chunk", func(t *testing.T) {
			if err := p.AddChunk(pool.Chunk{ID: "gpu0-numa0-0", Size: 1 << 20}); err != nil {
				t.Fatal(err)
			}
		}, 503, []string{"[+]chunks ok", "[-]socket failed"}},
		{"socket up", func(t *testing.T) { startGreeter(t, sock) }, 503, []string{"[+]socket ok", "[-]kubelet-registration failed"}},
		{"registered", func(*testing.T) { registered.Set(true, "") }, 200, []string{"[+]chunks ok", "[+]socket ok", "[+]kubelet-registration ok", "readyz ok"}},
		{"kubelet restarted", func(*testing.T) { registered.Set(false, "kubelet restarted; registering again") }, 503,
			[]string{"[-]kubelet-registration failed: kubelet restarted; registering again"}},
		{"registered again", func(*testing.T) { registered.Set(true, "") }, 200, nil},
		{"only chunk dirty", func(t *testing.T) {
			if err := p.Grant("pod", []string{"gpu0-numa0-0"}); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Revoke("pod"); err != nil {
				t.Fatal(err)
			}
		}, 503, []string{"[-]chunks failed: no chunk ready (1 awaiting scrub)"}},
		{"scrubbed", func(t *testing.T) {
			if err := p.Scrubbed("gpu0-numa0-0"); err != nil {
				t.Fatal(err)
			}
		}, 200, []string{"[+]chunks ok"}},
	}
	for _, s := range steps {
		s.do(t)
		code, body := get(t, srv.URL+"/readyz")
		if code != s.wantCode {
			t.Errorf("%s: status %d, want %d\n%s", s.name, code, s.wantCode, body)
		}
		for _, w := range s.want {
			if !strings.Contains(body, w) {
				t.Errorf("%s: body lacks %q\n%s", s.name, w, body)
			}
		}
	}
}

func TestHandlerRejects(t *testing.T) {
	srv := httptest.NewServer(New(Options{}).Handler())
	defer srv.Close()
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{"POST", "/livez", http.StatusMethodNotAllowed},
		{"DELETE", "/readyz", http.StatusMethodNotAllowed},
		{"GET", "/healthz/other", http.StatusNotFound},
		{"GET", "/livez", http.StatusOK},
		{"GET", "/readyz", http.StatusOK},
	} {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, resp.StatusCode, c.want)
		}
	}
}

// getUntil polls url until ok holds or 5s pass, and returns the last answer.
func getUntil(t *testing.T, url string, ok func(int, string) bool) (int, string) {
	t.Helper()
	var code int
	var body string
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if code, body = get(t, url); ok(code, body) {
			break
		}
	}
	return code, body
}
