package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

// TestMain lets the test binary stand in for the agent binary: run with
// KVPOOL_TEST_AGENT=1 it is the agent, so tests can cross a real process
// boundary without a separate build.

// fields returns the whitespace-separated fields of the first line of out
// that starts with prefix.
func fields(out, prefix string) []string {
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, prefix) {
			return strings.Fields(line)
		}
	}
	return nil
}

func TestStatusTableAndJSON(t *testing.T) {
	p := pool.New()
	for _, c := range []pool.Chunk{
		{ID: "gpu0-numa0-0", GPU: 0, NUMA: 0, Size: 64 << 20},
		{ID: "gpu0-numa0-1", GPU: 0, NUMA: 0, Size: 64 << 20},
		{ID: "gpu1-numaX-0", GPU: 1, NUMA: -1, Size: 64 << 20},
	} {
		if err := p.AddChunk(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Grant("pod-uid-1", []string{"gpu0-numa0-0"}); err != nil {
		t.Fatal(err)
	}
	s, err := p.Open("pod-uid-1", pool.Spec{GPU: 0, PageSize: 1 << 20, DevicePages: 100})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Offload("req-1", "kv", []int32{0, 1, 2}, pool.Meta{}, nil); err != nil {
		t.Fatal(err)
	}
	// The agent's /status (internal/agent observability.go), fed as the
	// agent feeds it.
	ring := report.NewRing(64)
	rep := &report.Reporter{Pool: p, Errors: ring, Node: "node-a", Mode: "standalone", Started: time.Now(),
		Targets:   func() map[int]int64 { return map[int]int64{0: 256 << 20, 1: 64 << 20} },
		Readiness: func() (bool, string) { return true, "" }}
	_, err = s.Reload("nope", "kv", []int32{3}, nil)
	ring.Op(observe.Op{Name: observe.OpReload, GPU: 0, Session: "7", Allocation: "pod-uid-1", Err: err})
	ring.Error("plugin", errors.New("ListAndWatch stream closed"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	mux := http.NewServeMux()
	mux.Handle("/status", rep)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")

	var out bytes.Buffer
	if err := statusCmd(ctx, []string{"--addr", addr}, &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	t.Logf("agent status:\n%s", text)
	for _, c := range []struct {
		prefix string
		want   []string
	}{
		{"Node:", []string{"Node:", "node-a"}},
		{"Ready:", []string{"Ready:", "yes"}},
		{"0 ", []string{"0", "0", "256Mi", "128Mi", "64Mi", "3Mi", "1/1/0", "1", "1", "3/0/64"}},
		{"1 ", []string{"1", "X", "64Mi", "64Mi", "0", "0", "1/0/0", "0", "0", "0/0/0"}},
		{"all ", []string{"all", "320Mi", "192Mi", "64Mi", "3Mi", "2/1/0", "1", "1", "3/0/64"}},
		{"pod-uid-1", []string{"pod-uid-1", "0", "0", "1/0/0", "1Mi", "64", "3", "0", "1", "1"}},
	} {
		if got := fields(text, c.prefix); strings.Join(got, " ") != strings.Join(c.want, " ") {
			t.Errorf("line %q: got %q, want %q", c.prefix, got, c.want)
		}
	}
	if !strings.Contains(text, "Recent errors (last 2 of 2):") {
		t.Errorf("no error header")
	}
	// Newest first.
	plugin, server := strings.Index(text, "ListAndWatch stream closed"), strings.Index(text, `reload "nope"/"kv": unknown stream`)
	if plugin < 0 || server < 0 || plugin > server {
		t.Errorf("errors missing or out of order (plugin at %d, server at %d)", plugin, server)
	}
	if f := fields(text, "20"); len(f) < 6 || f[1] != "plugin" || f[2] != "-" || f[3] != "other" || f[4] != "-" || f[5] != "-" {
		t.Errorf("first error row %q", f)
	}
	if i := strings.LastIndex(text, "\n20"); i < 0 || !slices.Equal(strings.Fields(text[i:])[1:6], []string{"server", "reload", "unknown_stream", "7", "pod-uid-1"}) {
		t.Errorf("server error row: %q", text[max(i, 0):])
	}

	out.Reset()
	if err := statusCmd(ctx, []string{"--addr", "http://" + addr + "/", "--json"}, &out); err != nil {
		t.Fatal(err)
	}
	var got report.Report
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatalf("--json output is not a report: %v\n%s", err, out.String())
	}
	if got.Node != "node-a" || len(got.GPUs) != 2 || got.GPUs[0].UsedBytes != 3<<20 || len(got.Sessions) != 1 || got.ErrorsTotal != 2 {
		t.Errorf("json report %+v", got)
	}
}

// In mode dra the report names the door and every prepared claim, one
// line per request, with its pool allocation, chunks and bytes.
func TestStatusClaims(t *testing.T) {
	rep := &report.Reporter{Pool: pool.New(), Node: "node-a", Mode: "cluster", Door: "dra", Started: time.Now(),
		Claims: func() []report.Claim {
			return []report.Claim{{Namespace: "ns", Name: "kv", UID: "u1", Chunks: 3, Bytes: 3 << 30, Requests: []report.ClaimRequest{
				{Name: "a", Allocation: "alloc-1", Chunks: []string{"gpu0-numa0-0", "gpu0-numa0-1"}, Bytes: 2 << 30},
				{Name: "b", Allocation: "alloc-2", Chunks: []string{"gpu1-numa1-0"}, Bytes: 1 << 30}}}}
		}}
	srv := httptest.NewServer(rep)
	defer srv.Close()
	var out bytes.Buffer
	if err := statusCmd(context.Background(), []string{"--addr", strings.TrimPrefix(srv.URL, "http://")}, &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	var lines []string
	for _, l := range strings.Split(text, "\n") {
		if f := strings.Fields(l); len(f) > 0 && (f[0] == "Mode:" || f[0] == "CLAIM" || f[0] == "ns/kv") {
			lines = append(lines, strings.Join(f, " "))
		}
	}
	want := []string{"Mode: cluster (dra)", "CLAIM REQUEST ALLOCATION CHUNKS BYTES", "ns/kv a alloc-1 2 2Gi", "ns/kv b alloc-2 1 1Gi"}
	if !slices.Equal(lines, want) {
		t.Errorf("lines %q, want %q\n%s", lines, want, text)
	}
}

// With a keeper the report says what the agent took over at start: chunks
// adopted, fresh and locked by the keeper, sessions, streams and the gap.
func TestStatusRestart(t *testing.T) {
	steps := &report.RestoreSteps{WarmSeconds: 0.0131, WarmBytes: 136 << 20, LoadSeconds: 0.08436, AdoptSeconds: 0.000127, RebuildSeconds: 0.04077, BooksSeconds: 0.000002}
	rep := &report.Reporter{Pool: pool.New(), Node: "node-a", Mode: "cluster", Started: time.Now(),
		Restart: func() *report.Restart {
			return &report.Restart{Keeper: "/k.sock", AdoptedChunks: 6, FreshChunks: 2, KeeperLockedChunks: 7, Sessions: 3, Streams: 1000,
				LastGapSeconds: 0.0654, KeeperConnected: true,
				Restore: steps}
		}}
	srv := httptest.NewServer(rep)
	defer srv.Close()
	var out bytes.Buffer
	if err := statusCmd(context.Background(), []string{"--addr", strings.TrimPrefix(srv.URL, "http://")}, &out); err != nil {
		t.Fatal(err)
	}
	want := "Restart: 6 chunks adopted from the keeper, 2 fresh, 7 locked by the keeper; 3 sessions and 1000 streams restored; gap 65ms"
	if got := strings.Join(strings.Fields(grepLines(out.String(), "Restart:")), " "); got != want {
		t.Errorf("restart line %q, want %q\n%s", got, want, out.String())
	}
	want = "Restore: heap warmed 13.1ms (136Mi), books replayed 84.4ms, chunks adopted 100µs, pool rebuilt 40.8ms, fresh books waited for 0s"
	if got := strings.Join(strings.Fields(grepLines(out.String(), "Restore:")), " "); got != want {
		t.Errorf("restore line %q, want %q\n%s", got, want, out.String())
	}
	// A spare's read ahead: the bytes the restore still replayed.
	steps.ReadAhead, steps.ReplayedBytes, steps.WarmBytes, steps.LoadSeconds, steps.SpareSeconds = true, 12<<10, 0, 0.0012, 0.0034
	out.Reset()
	if err := statusCmd(context.Background(), []string{"--addr", strings.TrimPrefix(srv.URL, "http://")}, &out); err != nil {
		t.Fatal(err)
	}
	want = "Restore: heap not warmed, books read ahead by the spare (handed over 3.4ms into the restore), their last 12Ki replayed 1.2ms, chunks adopted 100µs, pool rebuilt 40.8ms, fresh books waited for 0s"
	if got := strings.Join(strings.Fields(grepLines(out.String(), "Restore:")), " "); got != want {
		t.Errorf("restore line %q, want %q\n%s", got, want, out.String())
	}
}

func TestStatusErrors(t *testing.T) {
	// A port nothing listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	// A server that is not an agent.
	other := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/status" && r.URL.Query().Get("x") == "" {
			io.WriteString(w, "<html>not json</html>")
			return
		}
		http.NotFound(w, r)
	})}
	oln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go other.Serve(oln)
	defer other.Close()

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--bogus"}, "flag provided but not defined"},
		{[]string{"extra"}, `unexpected arguments ["extra"]`},
		{[]string{"--timeout", "0s"}, "--timeout must be positive"},
		{[]string{"--addr", closed}, "is the agent running?"},
		{[]string{"--addr", oln.Addr().String()}, "decode the report"},
		{[]string{"--addr", "http://" + oln.Addr().String() + "/nested"}, "404 Not Found"},
	} {
		var out bytes.Buffer
		err := statusCmd(context.Background(), c.args, &out)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: err %v, want %q", c.args, err, c.want)
		}
	}
}

// The agent and `agent status` as two real processes.
func TestStandaloneAgentAndStatusProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	agent := exec.CommandContext(ctx, exe, "--standalone", "--socket-dir", t.TempDir(), "--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0", "--log-format", "json")
	agent.Env = append(os.Environ(), "KVPOOL_TEST_AGENT=1")
	stderr, err := agent.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	defer agent.Process.Kill()

	addrs := map[string]string{}
	sc := bufio.NewScanner(stderr)
	for len(addrs) < 2 && sc.Scan() {
		var rec struct{ Msg, Server, Address string }
		if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == "serving" {
			addrs[rec.Server] = rec.Address
		}
	}
	if len(addrs) < 2 {
		t.Fatalf("agent did not report its addresses: %v (%v)", addrs, sc.Err())
	}
	go io.Copy(io.Discard, stderr)

	st := exec.CommandContext(ctx, exe, "status", "--addr", addrs["health"])
	st.Env = append(os.Environ(), "KVPOOL_TEST_AGENT=1")
	out, err := st.CombinedOutput()
	if err != nil {
		t.Fatalf("agent status: %v\n%s", err, out)
	}
	t.Logf("agent status (separate processes):\n%s", out)
	// The standalone agent: 2 simulated GPUs, 4 chunks of 64 MiB each, all
	// granted to its one (random) token.
	for _, prefix := range []string{"0 ", "1 "} {
		if f := fields(string(out), prefix); len(f) < 7 || f[3] != "256Mi" || f[6] != "0/4/0" {
			t.Errorf("GPU row %q: %q", prefix, f)
		}
	}
	if !strings.Contains(string(out), "Mode:") || !strings.Contains(string(out), "standalone") {
		t.Errorf("no mode in\n%s", out)
	}

	resp, err := http.Get("http://" + addrs["metrics"] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !regexp.MustCompile(`(?m)^kvpool_pool_ready_bytes\{gpu="1"\} 2\.68435456e\+08$`).Match(body) {
		t.Errorf("metrics lack the ready bytes of GPU 1:\n%s", grepLines(string(body), "kvpool_pool_ready"))
	}
	for _, path := range []string{"/livez", "/readyz"} {
		resp, err := http.Get("http://" + addrs["health"] + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s: %d", path, resp.StatusCode)
		}
	}

	agent.Process.Signal(syscall.SIGTERM)
	if err := agent.Wait(); err != nil {
		t.Errorf("agent exit: %v", err)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
