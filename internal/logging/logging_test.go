package logging

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"k8s.io/klog/v2"
)

func TestBadOptions(t *testing.T) {
	for _, o := range []Options{
		{Level: "loud"},
		{Level: "info", Format: "xml"},
		{Level: "-4"},
		{Format: "JSONL"},
	} {
		before := slog.Default()
		if _, _, err := Setup(o); err == nil {
			t.Errorf("%+v: no error", o)
		}
		if slog.Default() != before {
			t.Errorf("%+v: default logger replaced on error", o)
		}
	}
}

func TestLevels(t *testing.T) {
	for _, c := range []struct {
		level string
		want  []string
	}{
		{"debug", []string{"d", "i", "w", "e"}},
		{"", []string{"i", "w", "e"}},
		{"INFO", []string{"i", "w", "e"}},
		{"warning", []string{"w", "e"}},
		{"error", []string{"e"}},
	} {
		var buf bytes.Buffer
		l, _, err := New(Options{Level: c.level, Format: "json", Writer: &buf})
		if err != nil {
			t.Fatal(err)
		}
		l.Debug("d")
		l.Info("i")
		l.Warn("w")
		l.Error("e")
		var got []string
		for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
			var m map[string]any
			if err := json.Unmarshal([]byte(line), &m); err != nil {
				t.Fatalf("level %q: not JSON: %q", c.level, line)
			}
			got = append(got, m["msg"].(string))
		}
		if strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Errorf("level %q: logged %v, want %v", c.level, got, c.want)
		}
	}
}

func TestLevelChangesAtRunTime(t *testing.T) {
	var buf bytes.Buffer
	l, level, err := New(Options{Writer: &buf})
	if err != nil {
		t.Fatal(err)
	}
	l.Debug("hidden")
	level.Set(slog.LevelDebug)
	l.Debug("shown", "chunk", "gpu0-numa0-1")
	out := buf.String()
	if strings.Contains(out, "hidden") || !strings.Contains(out, `msg=shown chunk=gpu0-numa0-1`) {
		t.Errorf("text output: %q", out)
	}
}

// client-go's klog lands in the same JSON stream as the agent's own records,
// its V(1) records at debug level.
func TestKlogBridge(t *testing.T) {
	var buf bytes.Buffer
	if _, _, err := Setup(Options{Level: "debug", Format: "json", Writer: &buf}); err != nil {
		t.Fatal(err)
	}
	defer klog.ClearLogger()
	slog.Info("agent", "component", "main")
	klog.InfoS("from klog", "node", "n1")
	klog.V(1).InfoS("klog verbose")
	seen := map[string]map[string]any{}
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		seen[m["msg"].(string)] = m
	}
	for msg, kv := range map[string][2]string{
		"agent":     {"component", "main"},
		"from klog": {"node", "n1"},
	} {
		m, ok := seen[msg]
		if !ok {
			t.Errorf("%q not logged; got %s", msg, buf.String())
			continue
		}
		if m[kv[0]] != kv[1] {
			t.Errorf("%q: %s=%v, want %s", msg, kv[0], m[kv[0]], kv[1])
		}
	}
	if _, ok := seen["klog verbose"]; !ok {
		t.Errorf("V(1) record %q not logged at debug level", "klog verbose")
	}
}

// TestSyncBufferReadWhileWritten: writers and readers at once (run with
// -race) lose nothing, and Bytes is a copy the caller may change.
func TestSyncBufferReadWhileWritten(t *testing.T) {
	var s SyncBuffer
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 1000 {
				if _, err := s.Write([]byte("x\n")); err != nil {
					t.Error(err)
				}
			}
		})
	}
	for range 100 {
		if b := s.Bytes(); strings.Count(string(b), "x\n")*2 != len(b) {
			t.Fatalf("a read of %d bytes holds a torn line", len(b))
		}
	}
	wg.Wait()
	if got := strings.Count(s.String(), "x\n"); got != 4000 {
		t.Fatalf("%d lines, want 4000", got)
	}
	b := s.Bytes()
	b[0] = 'y'
	if s.String()[0] != 'x' {
		t.Fatal("Bytes returned the buffer itself, not a copy")
	}
}

// ListIDs names every ID up to n of them, then the first n and how many
// more, whatever the separator.
func TestListIDs(t *testing.T) {
	ids := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("gpu0-numa0-%d", i)
		}
		return out
	}
	for _, c := range []struct {
		n, max int
		sep    string
		want   string
	}{
		{0, 8, ",", ""},
		{1, 8, ",", "gpu0-numa0-0"},
		{3, 8, ",", "gpu0-numa0-0,gpu0-numa0-1,gpu0-numa0-2"},
		{3, 3, ", ", "gpu0-numa0-0, gpu0-numa0-1, gpu0-numa0-2"},
		{4, 3, ", ", "gpu0-numa0-0, gpu0-numa0-1, gpu0-numa0-2 and 1 more"},
		{64, 64, ",", strings.Join(ids(64), ",")},
		{4096, 2, ",", "gpu0-numa0-0,gpu0-numa0-1 and 4094 more"},
	} {
		if got := ListIDs(ids(c.n), c.max, c.sep); got != c.want {
			t.Errorf("%d IDs, at most %d, %q: %q, want %q", c.n, c.max, c.sep, got, c.want)
		}
	}
}
