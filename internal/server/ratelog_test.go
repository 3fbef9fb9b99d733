package server

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// The rate log lets a burst through, then one line a second per key, and
// reports what it suppressed: on the next line, and by Flush.
func TestRateLog(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1000, 0)
	r := newRateLog(slog.New(slog.NewTextHandler(&buf, nil)), 3, 1)
	r.now = func() time.Time { return now }
	for range 100 {
		r.Log(slog.LevelWarn, "a", "refused a")
	}
	r.Log(slog.LevelWarn, "b", "refused b") // another key has its own bucket
	if n := strings.Count(buf.String(), "refused a"); n != 3 {
		t.Fatalf("%d lines of a flood of 100 with a burst of 3", n)
	}
	if !strings.Contains(buf.String(), "refused b") {
		t.Fatal("key b starved by key a")
	}
	now = now.Add(1500 * time.Millisecond)
	buf.Reset()
	r.Log(slog.LevelWarn, "a", "refused a")
	if !strings.Contains(buf.String(), "suppressed=97") {
		t.Fatalf("next line after the flood: %q", buf.String())
	}
	buf.Reset()
	for range 10 {
		r.Log(slog.LevelWarn, "a", "refused a")
	}
	r.Flush() // no token yet: nothing
	if buf.Len() != 0 {
		t.Fatalf("logged with an empty bucket: %q", buf.String())
	}
	now = now.Add(2 * time.Second)
	r.Flush()
	if !strings.Contains(buf.String(), "log lines suppressed") || !strings.Contains(buf.String(), "suppressed=10") {
		t.Fatalf("flush: %q", buf.String())
	}
}

func TestLogName(t *testing.T) {
	for in, want := range map[string]string{
		"vllm-0":                 "vllm-0",
		"a\x1b[31mb\n":           "a?[31mb?",
		strings.Repeat("x", 100): strings.Repeat("x", 64) + "...(100 bytes)",
		"caf\xc3\xa9":            "caf??",
	} {
		if got := logName(in); got != want {
			t.Errorf("logName(%q) = %q, want %q", in, got, want)
		}
	}
}
