package main

import (
	"strings"
	"testing"
)

// Lines as the agent's text log writes them (slog's TextHandler).
const (
	logFirst   = `time=2026-12-05T12:58:46.470Z level=INFO msg="kvpool agent serving" mode=standalone node=vm socket=/tmp/s/kv.sock gpus=1 chunks=4 chunk=32Mi startup=160ms socketRefusesFiles=true`
	logAdopt1  = `time=2026-12-05T12:58:47.655Z level=INFO msg="pool adopted from the keeper" chunks=4 sessions=4 streams=524288 booksGen=4 warmHeap=136Mi warmHuge=true warm=12.985ms load=84.361ms adopt=127µs rebuild=40.773ms books=2µs`
	logServe1  = `time=2026-12-05T12:58:47.660Z level=INFO msg="kvpool agent serving" mode=standalone node=vm socket=/tmp/s/kv.sock gpus=1 chunks=4 chunk=32Mi startup=148ms socketRefusesFiles=true`
	logAdopt2  = `time=2026-12-05T12:58:48.655Z level=INFO msg="pool adopted from the keeper" chunks=4 sessions=4 streams=524288 booksGen=5 warmHeap=136Mi warmHuge=true warm=10ms load=80ms adopt=100µs rebuild=40ms books=1ms`
	logServe2  = `time=2026-12-05T12:58:48.660Z level=INFO msg="kvpool agent serving" mode=standalone node=vm socket="/tmp/a b/kv.sock" gpus=1 chunks=4 chunk=32Mi startup=140ms socketRefusesFiles=true`
	logResumed = `time=2026-12-05T12:58:47.659Z level=INFO msg="session resumed" session=1796475510443429`
)

func TestSplitGaps(t *testing.T) {
	full := strings.Join([]string{logFirst, logResumed, logAdopt1, logServe1, logResumed, logAdopt2, logServe2, ""}, "\n")
	gaps, exits := []float64{187, 190}, []float64{7, 2}
	steps := splitGaps(full, gaps, exits)
	if len(steps) != 2 {
		t.Fatalf("steps %+v", steps)
	}
	want := []gapSteps{
		{Exit: 7, Start: 187 - 7 - 148, Warm: 12.985, Load: 84.361, Adopt: 0.127, Rebuild: 40.773, Books: 0.002, Other: 148 - 12.985 - 84.361 - 0.127 - 40.773 - 0.002},
		{Exit: 2, Start: 190 - 2 - 140, Warm: 10, Load: 80, Adopt: 0.1, Rebuild: 40, Books: 1, Other: 140 - 10 - 80 - 0.1 - 40 - 1},
	}
	for i, s := range steps {
		w := want[i]
		for j, d := range []float64{s.Exit - w.Exit, s.Start - w.Start, s.Warm - w.Warm, s.Load - w.Load, s.Adopt - w.Adopt,
			s.Rebuild - w.Rebuild, s.Books - w.Books, s.Other - w.Other} {
			if d > 1e-9 || d < -1e-9 {
				t.Errorf("restart %d, step %d: %+v, want %+v", i, j, s, w)
			}
		}
	}
	// What the log does not say, no split is made of.
	for name, log := range map[string]string{
		"agents above info":  logResumed + "\n",
		"a restart unlogged": strings.Join([]string{logFirst, logAdopt1, logServe1}, "\n"),
		"no first start":     strings.Join([]string{logAdopt1, logServe1, logAdopt2, logServe2}, "\n"),
		"a bad duration":     strings.Join([]string{logFirst, strings.Replace(logAdopt1, "load=84.361ms", "load=soon", 1), logServe1, logAdopt2, logServe2}, "\n"),
		"a step missing":     strings.Join([]string{logFirst, strings.Replace(logAdopt1, " rebuild=40.773ms", "", 1), logServe1, logAdopt2, logServe2}, "\n"),
		"no start-up":        strings.Join([]string{logFirst, logAdopt1, strings.Replace(logServe1, "startup=148ms", "startup=", 1), logAdopt2, logServe2}, "\n"),
	} {
		if s := splitGaps(log, gaps, exits); s != nil {
			t.Errorf("%s: split %+v", name, s)
		}
	}
}

func TestLogFields(t *testing.T) {
	for _, c := range []struct {
		line string
		want map[string]string
	}{
		{`a=1 b=two`, map[string]string{"a": "1", "b": "two"}},
		{`msg="pool adopted" x=1`, map[string]string{"msg": "pool adopted", "x": "1"}},
		{`msg="say \"hi\" now" y=2`, map[string]string{"msg": `say \"hi\" now`, "y": "2"}},
		{`  lead=1   gap=2 `, map[string]string{"lead": "1", "gap": "2"}},
		{`open="no end`, map[string]string{"open": "no end"}},
		{`novalue`, map[string]string{}},
		{`word a=1 other b=2`, map[string]string{"a": "1", "b": "2"}},
		{`=x a=1`, map[string]string{"a": "1"}},
		{`=x`, map[string]string{}},
		{`k=`, map[string]string{"k": ""}},
		{``, map[string]string{}},
	} {
		got := logFields(c.line)
		if len(got) != len(c.want) {
			t.Errorf("%q: %v, want %v", c.line, got, c.want)
			continue
		}
		for k, v := range c.want {
			if got[k] != v {
				t.Errorf("%q: %v, want %v", c.line, got, c.want)
			}
		}
	}
}

// FuzzLogFields: any line is read without a panic, and after one without
// quotes a key written as slog writes a plain value is found with it.
func FuzzLogFields(f *testing.F) {
	for _, s := range []string{logFirst, logAdopt1, `msg="a \"b\" c"`, `x="`, `="=`, "\\\"", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		line = strings.ReplaceAll(line, "\n", " ")
		_ = logFields(line)
		if !strings.ContainsAny(line, `"\`) {
			if got := logFields(line + " zzkey=42")["zzkey"]; got != "42" {
				t.Fatalf("%q: zzkey %q", line, got)
			}
		}
	})
}
