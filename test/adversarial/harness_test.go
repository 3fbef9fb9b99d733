// Package adversarial attacks a real kvpool agent process the way a buggy
// or hostile pod (or any local process) could, one row of issue 14's table
// at a time, and asserts what docs/security.md promises: a well-behaved
// client (the real cmd/kvclient, in its own process) keeps passing during
// and after every attack; the agent's heap and file descriptors stay under
// stated bounds; no byte crosses tenants; the agent keeps serving or exits
// with a logged reason.
//
// The scale is smaller than the where the bound, not the count, is
// what matters: the agent runs with small limits (see agentArgs) so that an
// attacker reaches every bound within a second or two, and the whole suite
// runs in well under a minute after the build.
package adversarial

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/wire"
)

var bins struct {
	dir, agent, kvclient string
}

// TestMain builds the agent and kvclient once, or runs this binary as a
// helper process (an attacker or a session owner that must have a PID of
// its own) when KVPOOL_ADV_ROLE says so.
func TestMain(m *testing.M) {
	if role := os.Getenv("KVPOOL_ADV_ROLE"); role != "" {
		os.Exit(runHelper(role))
	}
	flag.Parse()
	if testing.Short() {
		fmt.Println("test/adversarial: skipped with -short (it builds and starts agent processes)")
		os.Exit(0)
	}
	dir, err := os.MkdirTemp("", "kvpool-adversarial")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.dir = dir
	bins.agent = filepath.Join(dir, "agent")
	bins.kvclient = filepath.Join(dir, "kvclient")
	// The default build settings: its packages are in the build cache
	// whenever the repository was built.
	cmd := exec.Command("go", "build", "-o", dir+"/", "../../cmd/agent", "../../cmd/kvclient")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the agent and kvclient: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// The limits the suite's agent runs with: small, so that every bound is
// reached quickly. The defaults (docs/sizing.md) are larger; the bounds are
// the same code.
const (
	limConns        = 96
	limConnsPerPID  = 24
	limHello        = 700 * time.Millisecond
	limOpen         = 1500 * time.Millisecond
	limAllocSess    = 4
	limStreams      = 10000
	limNameBytes    = 1 << 20
	limDevicePages  = 1 << 20
	limClientName   = 256
	goodToken       = "good-tenant"
	evilToken       = "evil-tenant"
	otherToken      = "other-tenant"
	chunkMiB        = 8
	chunksPerGPU    = 3 // one per token, per GPU
	heapBoundMiB    = 96
	fdSlack         = 16
	kvclientPageKiB = 16
)

func agentArgs(dir string) []string {
	return []string{"--standalone", "--log-format", "json",
		"--socket", filepath.Join(dir, "sock", "kvpool.sock"), "--state-dir", filepath.Join(dir, "state"),
		"--standalone-tokens", goodToken + "," + evilToken + "," + otherToken,
		"--standalone-gpus", "2", "--chunks-per-gpu", strconv.Itoa(chunksPerGPU), "--chunk-mib", strconv.Itoa(chunkMiB),
		"--max-conns", strconv.Itoa(limConns), "--max-conns-per-uid", strconv.Itoa(limConns),
		"--max-conns-per-pid", strconv.Itoa(limConnsPerPID),
		"--hello-timeout", limHello.String(), "--open-timeout", limOpen.String(),
		"--max-sessions-per-allocation", strconv.Itoa(limAllocSess),
		"--max-streams-per-session", strconv.Itoa(limStreams),
		"--max-name-bytes-per-session", strconv.Itoa(limNameBytes),
		"--max-device-pages", strconv.Itoa(limDevicePages),
		"--max-client-name", strconv.Itoa(limClientName),
	}
}

// agentProc is a running agent process.
type agentProc struct {
	t       testing.TB
	cmd     *exec.Cmd
	socket  string
	health  string
	metrics string
	done    chan struct{}
	err     error // Wait's, once done is closed
	cluster bool  // ready means "pool ready", not "standalone tokens granted"

	mu    sync.Mutex
	log   bytes.Buffer
	lines []map[string]any
}

// startAgent runs the agent with agentArgs plus extra and waits until it is
// ready.
func startAgent(t testing.TB, extra ...string) *agentProc {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvadv") // short: the socket path must fit 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	a := launch(t, append(agentArgs(dir), extra...)...)
	a.socket = filepath.Join(dir, "sock", "kvpool.sock")
	a.waitReady()
	return a
}

// launch starts the agent binary with args and collects its log.
func launch(t testing.TB, args ...string) *agentProc {
	t.Helper()
	return launchEnv(t, nil, args...)
}

// launchEnv is launch with env added to the agent's environment.
func launchEnv(t testing.TB, env []string, args ...string) *agentProc {
	t.Helper()
	a := &agentProc{t: t, done: make(chan struct{})}
	a.cmd = exec.Command(bins.agent, args...)
	a.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	stderr, err := a.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	a.cmd.Stdout = a.cmd.Stderr
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var m map[string]any
			json.Unmarshal(sc.Bytes(), &m)
			a.mu.Lock()
			a.log.Write(sc.Bytes())
			a.log.WriteByte('\n')
			if m != nil {
				a.lines = append(a.lines, m)
			}
			a.mu.Unlock()
		}
		io.Copy(io.Discard, stderr)
		a.err = a.cmd.Wait()
		close(a.done)
	}()
	t.Cleanup(func() {
		a.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-a.done:
		case <-time.After(15 * time.Second):
			a.cmd.Process.Kill()
			<-a.done
			t.Errorf("the agent did not stop within 15s of SIGTERM")
		}
		if t.Failed() {
			t.Logf("agent log (last 8 KiB):\n%s", tail(a.logText(), 8<<10))
		}
	})
	return a
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func (a *agentProc) logText() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.log.String()
}

func (a *agentProc) logLen() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.log.Len()
}

// records returns the log records with msg whose fields include want.
func (a *agentProc) records(msg string, want map[string]any) []map[string]any {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []map[string]any
	for _, l := range a.lines {
		if l["msg"] != msg {
			continue
		}
		ok := true
		for k, v := range want {
			if fmt.Sprint(l[k]) != fmt.Sprint(v) {
				ok = false
			}
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

func (a *agentProc) waitReady() {
	t := a.t
	t.Helper()
	end := time.Now().Add(30 * time.Second)
	for time.Now().Before(end) {
		if r := a.records("kvpool agent serving", nil); len(r) > 0 {
			a.health, _ = r[0]["health"].(string)
			a.metrics, _ = r[0]["metrics"].(string)
			break
		}
		select {
		case <-a.done:
			t.Fatalf("the agent exited at start: %v\n%s", a.err, a.logText())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if a.health == "" || a.metrics == "" {
		t.Fatalf("the agent never logged its addresses:\n%s", a.logText())
	}
	for time.Now().Before(end) {
		ready := "standalone tokens granted"
		if a.cluster {
			ready = "pool ready"
		}
		if len(a.records(ready, nil)) > 0 && a.probe("/readyz") == 200 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the agent never became ready:\n%s", a.logText())
}

// probe GETs a health path and returns the status code (0: no answer).
func (a *agentProc) probe(path string) int {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + a.health + path)
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// alive fails the test unless the process runs and both probes pass.
func (a *agentProc) alive() {
	a.t.Helper()
	select {
	case <-a.done:
		a.t.Fatalf("the agent exited: %v", a.err)
	default:
	}
	for _, p := range []string{"/livez", "/readyz"} {
		if code := a.probe(p); code != 200 {
			a.t.Fatalf("%s answered %d", p, code)
		}
	}
}

// scrape returns the agent's metrics text.
func (a *agentProc) scrape() string {
	a.t.Helper()
	resp, err := http.Get("http://" + a.metrics + "/metrics")
	if err != nil {
		a.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		a.t.Fatal(err)
	}
	return string(b)
}

// metric returns the value of the sample whose line starts with series
// (name and labels exactly as exposed), or -1.
func (a *agentProc) metric(series string) float64 {
	a.t.Helper()
	for _, l := range strings.Split(a.scrape(), "\n") {
		if rest, ok := strings.CutPrefix(l, series+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				a.t.Fatal(err)
			}
			return v
		}
	}
	return -1
}

func (a *agentProc) rejects(reason string) float64 {
	return a.metric(`kvpool_limit_rejects_total{reason="` + reason + `"}`)
}

// heapMiB is go_memstats_heap_inuse_bytes in MiB.
func (a *agentProc) heapMiB() float64 {
	a.t.Helper()
	v := a.metric("go_memstats_heap_inuse_bytes")
	if v < 0 {
		a.t.Fatal("no go_memstats_heap_inuse_bytes")
	}
	return v / (1 << 20)
}

// fds counts the agent's open file descriptors.
func (a *agentProc) fds() int {
	a.t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", a.cmd.Process.Pid))
	if err != nil {
		a.t.Fatal(err)
	}
	return len(ents)
}

// checkBounds asserts the stated heap bound and fds at most base+slack.
func (a *agentProc) checkBounds(baseFDs, slack int) {
	a.t.Helper()
	if h := a.heapMiB(); h > heapBoundMiB {
		a.t.Errorf("agent heap in use %.1f MiB, bound %d MiB", h, heapBoundMiB)
	}
	if n := a.fds(); n > baseFDs+slack {
		a.t.Errorf("agent holds %d fds, bound %d (baseline %d + %d)", n, baseFDs+slack, baseFDs, slack)
	}
}

// waitFDs waits until the agent's fds come back to at most n.
func (a *agentProc) waitFDs(n int, within time.Duration) {
	a.t.Helper()
	end := time.Now().Add(within)
	for {
		got := a.fds()
		if got <= n {
			return
		}
		if time.Now().After(end) {
			a.t.Fatalf("the agent holds %d fds %s after the attack, want at most %d", got, within, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// goodClient is the well-behaved tenant: the real kvclient, in its own
// process, checking every byte it reloads.
type goodClient struct {
	cmd  *exec.Cmd
	out  bytes.Buffer
	done chan error
}

// startGood runs kvclient's checks and then its mixed workload for d.
func startGood(t testing.TB, a *agentProc, gpu int, d time.Duration) *goodClient {
	t.Helper()
	g := &goodClient{done: make(chan error, 1)}
	g.cmd = exec.Command(bins.kvclient, "-duration", d.String(), "-gpu", strconv.Itoa(gpu), "-device-pages", "128",
		"-page-bytes", strconv.Itoa(kvclientPageKiB<<10), "-max-pages", "64", "-max-stream", "8")
	g.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "KVPOOL_SOCKET=" + a.socket, "KVPOOL_TOKEN=" + goodToken}
	g.cmd.Stdout, g.cmd.Stderr = &g.out, &g.out
	if err := g.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { g.done <- g.cmd.Wait() }()
	t.Cleanup(func() { g.cmd.Process.Kill(); <-g.done; g.done <- nil })
	return g
}

// wait wants the client to have passed.
func (g *goodClient) wait(t testing.TB) {
	t.Helper()
	select {
	case err := <-g.done:
		g.done <- err
		if err != nil {
			t.Fatalf("the well-behaved client failed: %v\n%s", err, g.out.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("the well-behaved client did not finish:\n%s", g.out.String())
	}
}

// runGood runs a short kvclient to completion and wants it to pass.
func runGood(t testing.TB, a *agentProc) {
	t.Helper()
	startGood(t, a, 0, 300*time.Millisecond).wait(t)
}

// raw is a hand-driven protocol connection, as an attacker writes one.
type raw struct {
	t   testing.TB
	c   *wire.Conn
	seq uint32
	buf []byte
}

func dialRaw(t testing.TB, a *agentProc) *raw {
	t.Helper()
	c, err := wire.Dial(a.socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &raw{t: t, c: c, buf: make([]byte, wire.MaxMessage+1)}
}

func (r *raw) Close() { r.c.Close() }

// do sends op with m and returns the reply's status, message and fds;
// closed is true when the agent closed the connection instead.
func (r *raw) do(op wire.Op, m, rep proto.Message) (st wire.Status, msg string, files []*os.File, closed bool) {
	r.t.Helper()
	r.seq++
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: op, Seq: r.seq}, m)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.c.Send(pkt, nil); err != nil {
		return 0, "", nil, true
	}
	return r.reply(op, rep)
}

func (r *raw) reply(op wire.Op, rep proto.Message) (st wire.Status, msg string, files []*os.File, closed bool) {
	r.t.Helper()
	r.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	pkt, files, err := r.c.Recv(r.buf)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return 0, "", nil, true
		}
		r.t.Fatalf("%s: %v", op, err)
	}
	h, body, err := wire.ParseHeader(pkt)
	if err != nil {
		r.t.Fatal(err)
	}
	if h.Seq != r.seq || h.Op != op {
		r.t.Fatalf("%s: reply op %s seq %d, want seq %d", op, h.Op, h.Seq, r.seq)
	}
	if h.Status != wire.StatusOK {
		var e wire.Error
		if err := wire.DecodeBody(body, &e); err != nil {
			r.t.Fatal(err)
		}
		return h.Status, e.Message, files, false
	}
	if rep != nil {
		if err := wire.DecodeBody(body, rep); err != nil {
			r.t.Fatal(err)
		}
	}
	return wire.StatusOK, "", files, false
}

func (r *raw) hello() {
	r.t.Helper()
	if st, msg, _, closed := r.do(wire.OpHello, &wire.Hello{Version: wire.Version, Client: "attacker"}, &wire.HelloReply{}); st != 0 || closed {
		r.t.Fatalf("hello: %s %s closed=%v", st, msg, closed)
	}
}

// layout is a one-region layout of pages device pages of 4 KiB.
func layout(pages uint32) []*wire.Region {
	return []*wire.Region{{BytesPerPage: 4096, PageCount: pages}}
}

// open says hello and opens a session; the reply's fds are returned open.
func (r *raw) open(token string, gpu uint32, inst string, regions []*wire.Region, maxPages uint32) (*wire.OpenReply, []*os.File) {
	r.t.Helper()
	r.hello()
	var rep wire.OpenReply
	st, msg, files, closed := r.do(wire.OpOpen, &wire.Open{Token: token, GpuUuid: cudart.SimulatedUUID(int(gpu)), InstanceId: []byte(inst), Regions: regions, MaxPages: maxPages}, &rep)
	if st != 0 || closed {
		r.t.Fatalf("open: %s %s closed=%v", st, msg, closed)
	}
	return &rep, files
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}
