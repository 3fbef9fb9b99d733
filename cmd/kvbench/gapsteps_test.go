package main

import (
	"strings"
	"testing"
	"time"
)

// Lines as the agent's text log writes them (slog's TextHandler): the
// first agent's start, then two restarts' (the first as agents logged it
// before the wait for a spare was a step of its own).
const (
	logConfig0 = `time=2026-12-05T12:58:46.310Z level=INFO msg=configuration setFrom="keeperSocket=flag,log.level=flag"`
	logFirst   = `time=2026-12-05T12:58:46.470Z level=INFO msg="kvpool agent serving" mode=standalone node=vm socket=/tmp/s/kv.sock gpus=1 chunks=4 chunk=32Mi startup=160ms socketRefusesFiles=true`
	logConfig1 = `time=2026-12-05T12:58:47.512Z level=INFO msg=configuration setFrom="keeperSocket=flag,log.level=flag"`
	logWarning = `time=2026-12-05T12:58:47.512Z level=WARN msg=configuration warning="a warning, not the start"`
	logAdopt1  = `time=2026-12-05T12:58:47.655Z level=INFO msg="pool adopted from the keeper" chunks=4 sessions=4 streams=524288 booksGen=4 warmHeap=136Mi warmHuge=true warm=12.985ms load=84.361ms adopt=127µs rebuild=40.773ms books=2µs`
	logServed1 = `time=2026-12-05T12:58:47.657Z level=INFO msg="serving again after a restart" gap=187ms adoptedChunks=4 sessions=4 streams=524288`
	logServe1  = `time=2026-12-05T12:58:47.660Z level=INFO msg="kvpool agent serving" mode=standalone node=vm socket=/tmp/s/kv.sock gpus=1 chunks=4 chunk=32Mi startup=148ms socketRefusesFiles=true`
	logConfig2 = `time=2026-12-05T12:58:48.500Z level=INFO msg=configuration setFrom="keeperSocket=flag,log.level=flag"`
	logAdopt2  = `time=2026-12-05T12:58:48.655Z level=INFO msg="pool adopted from the keeper" chunks=4 sessions=4 streams=524288 booksGen=5 readAhead=true warmHeap=136Mi warmHuge=true spare=3.5ms warm=10ms load=80ms adopt=100µs rebuild=40ms books=1ms`
	logServed2 = `time=2026-12-05T12:58:48.660Z level=INFO msg="serving again after a restart" gap=190ms adoptedChunks=4 sessions=4 streams=524288`
	logResumed = `time=2026-12-05T12:58:47.659Z level=INFO msg="session resumed" session=1796475510443429`
)

func at(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t
}

func TestSplitGaps(t *testing.T) {
	full := strings.Join([]string{logConfig0, logFirst, logResumed, logConfig1, logWarning, logAdopt1, logServed1, logServe1, logResumed,
		logConfig2, logAdopt2, logServed2, ""}, "\n")
	times := []restartTimes{
		{kill: at("2026-12-05T12:58:47.470Z"), exec: at("2026-12-05T12:58:47.474Z"), ok: at("2026-12-05T12:58:47.6585Z")},
		{kill: at("2026-12-05T12:58:48.460Z"), exec: at("2026-12-05T12:58:48.462Z"), ok: at("2026-12-05T12:58:48.661Z")},
	}
	steps := splitGaps(full, times)
	if len(steps) != 2 {
		t.Fatalf("steps %+v", steps)
	}
	want := []gapSteps{
		{Exit: 4, Start: 38, Warm: 12.985, Load: 84.361, Adopt: 0.127, Rebuild: 40.773, Books: 0.002, Other: 145 - 12.985 - 84.361 - 0.127 - 40.773 - 0.002, After: 1.5},
		{Exit: 2, Start: 38, Spare: 3.5, Warm: 10, Load: 80, Adopt: 0.1, Rebuild: 40, Books: 1, Other: 160 - 3.5 - 10 - 80 - 0.1 - 40 - 1, After: 1, ReadAhead: true},
	}
	for i, s := range steps {
		w := want[i]
		if s.ReadAhead != w.ReadAhead {
			t.Errorf("restart %d: read ahead %v, want %v", i, s.ReadAhead, w.ReadAhead)
		}
		for j, d := range []float64{s.Exit - w.Exit, s.Start - w.Start, s.Spare - w.Spare, s.Warm - w.Warm, s.Load - w.Load, s.Adopt - w.Adopt,
			s.Rebuild - w.Rebuild, s.Books - w.Books, s.Other - w.Other, s.After - w.After} {
			if d > 1e-9 || d < -1e-9 {
				t.Errorf("restart %d, step %d: %+v, want %+v", i, j, s, w)
			}
		}
		sum := s.total()
		if gap := float64(times[i].ok.Sub(times[i].kill).Microseconds()) / 1e3; sum-gap > 1e-9 || gap-sum > 1e-9 {
			t.Errorf("restart %d: steps add up to %.3f ms, the gap is %.3f", i, sum, gap)
		}
	}
	// What the log does not say, no split is made of.
	for name, log := range map[string]string{
		"agents above info":  logResumed + "\n",
		"a restart unlogged": strings.Join([]string{logConfig0, logFirst, logConfig1, logAdopt1, logServed1}, "\n"),
		"no first start":     strings.Join([]string{logConfig1, logAdopt1, logServed1, logConfig2, logAdopt2, logServed2}, "\n"),
		"a bad duration":     strings.Join([]string{logConfig0, logConfig1, strings.Replace(logAdopt1, "load=84.361ms", "load=soon", 1), logServed1, logConfig2, logAdopt2, logServed2}, "\n"),
		"a bad spare wait":   strings.Join([]string{logConfig0, logConfig1, logAdopt1, logServed1, logConfig2, strings.Replace(logAdopt2, "spare=3.5ms", "spare=3.5", 1), logServed2}, "\n"),
		"a step missing":     strings.Join([]string{logConfig0, logConfig1, strings.Replace(logAdopt1, " rebuild=40.773ms", "", 1), logServed1, logConfig2, logAdopt2, logServed2}, "\n"),
		"a bad time":         strings.Join([]string{logConfig0, strings.Replace(logConfig1, "time=2026", "time=when", 1), logAdopt1, logServed1, logConfig2, logAdopt2, logServed2}, "\n"),
		"no serving again":   strings.Join([]string{logConfig0, logConfig1, logAdopt1, logConfig2, logAdopt2, logServed2}, "\n"),
	} {
		if s := splitGaps(log, times); s != nil {
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
