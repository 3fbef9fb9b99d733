package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestMain lets the test binary serve as the agent, client and echo
// children that latbench starts from its own executable.
func TestMain(m *testing.M) {
	if slices.Contains(os.Args, "-role") {
		if err := run(os.Args[1:]); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runJSON runs latbench with args, its standard output captured, and
// decodes what it printed into v; it returns the output.
func runJSON(t *testing.T, v any, args ...string) []byte {
	t.Helper()
	out, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = out
	err = run(args)
	os.Stdout = stdout
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out.Name())
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return b
}

func TestLatbenchRuns(t *testing.T) {
	if _, err := exec.LookPath("cc"); err != nil {
		if _, err := exec.LookPath("gcc"); err != nil {
			t.Skip("no C compiler for the echo floor")
		}
	}
	var reps []placementReport
	b := runJSON(t, &reps, "-n", "200", "-rounds", "2", "-warmup", "20", "-placements", "one", "-json")
	if len(reps) != 1 || reps[0].ClientMaxProcs != 1 || len(reps[0].Rows) != 4 {
		t.Fatalf("want one placement on one CPU (GOMAXPROCS 1) with 4 rows: %s", b)
	}
	for _, r := range reps[0].Rows {
		if r.Floor.N != 200 || r.KVPool.N != 200 || r.Floor.P50 <= 0 || r.KVPool.P50 <= 0 || r.KVPool.P99 < r.KVPool.P50 {
			t.Errorf("%s: %+v", r.What, r)
		}
	}
}

func TestLatbenchRejects(t *testing.T) {
	for _, args := range [][]string{
		{"-n", "10"},
		{"-rounds", "0"},
		{"-pages", "0"},
		{"-cpus", "0"},
		{"-cpus", "a,b"},
		{"-role", "nope"},
		{"-role", "pipe-echo"},
		{"-role", "pipe-echo", "0"},
		{"-role", "pipe-echo-client", "10", "40"},
		{"-role", "pipe-echo-client", "10", "40", "5000"},
	} {
		if err := run(args); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

func TestLatbenchSweep(t *testing.T) {
	var cells []sweepCell
	b := runJSON(t, &cells, "-sweep", "-sessions", "1,2", "-procs", "2", "-sweep-time", "100ms", "-repeat", "1", "-placements", "one",
		"-spins", "off,always,rule,control", "-json")
	// 1x1, 1x2 and 2x1, each under the four spin modes.
	if len(cells) != 12 {
		t.Fatalf("%d cells, want 12: %s", len(cells), b)
	}
	for _, c := range cells {
		if c.Pairs < 1 || c.PairsPerSec <= 0 || c.P50 <= 0 || c.P99 < c.P50 || c.Procs*c.Sessions > 2 {
			t.Errorf("%+v", c)
		}
		// The clients' spin counts: none with the spin off and its
		// control; under the rule before issue 25, a spin on every reply
		// (two calls a pair); never a reply taken without a spin.
		switch {
		case (c.Spin == "off" || c.Spin == "control") && (c.Spins != 0 || c.Yields != 0 || c.Taken != 0),
			c.Spin == "always" && c.Spins < 2,
			c.Taken > c.Spins:
			t.Errorf("spin %s: %.2f spins, %.2f yields, %.2f replies taken a pair", c.Spin, c.Spins, c.Yields, c.Taken)
		}
	}
	var buf bytes.Buffer
	printSweep(&buf, cells, []string{"off", "always", "rule", "control"})
	if !strings.Contains(buf.String(), "of 1)") || !strings.Contains(buf.String(), "spins / yields / replies taken a pair") {
		t.Errorf("the summary of the sweep is missing:\n%s", buf.String())
	}
}

func TestSweepRejects(t *testing.T) {
	for _, args := range [][]string{
		{"-sweep", "-sessions", "0"},
		{"-sweep", "-procs", "65"},
		{"-sweep", "-spins", "sometimes"},
		{"-sweep", "-sweep-time", "0s"},
		{"-role", "sweep", "-sessions", "1", "-spin-mode", "sometimes"},
		{"-role", "sweep", "-sessions", "1", "-gpu-base", "64"},
	} {
		if err := run(args); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
}

func TestPairedRatios(t *testing.T) {
	cells := func(vs ...float64) []sweepCell {
		var cs []sweepCell
		for _, v := range vs {
			cs = append(cs, sweepCell{PairsPerSec: v})
		}
		return cs
	}
	tput := func(c sweepCell) float64 { return c.PairsPerSec }
	for _, tc := range []struct {
		name      string
		mode, off []sweepCell
		highBad   bool
		want      string
	}{
		{"none", nil, cells(1), false, "-"},
		{"odd", cells(2, 1, 3), cells(2, 2, 2), false, "1.00 (0.50-1.50, 1 of 3)"},
		{"even", cells(1, 2, 3, 4), cells(2, 2, 2, 2), false, "1.25 (0.50-2.00, 1 of 4)"},
		{"high is bad", cells(1, 2, 3, 4), cells(2, 2, 2, 2), true, "1.25 (0.50-2.00, 2 of 4)"},
		{"repeats paired in order", cells(4, 1), cells(2, 1, 9), false, "1.50 (1.00-2.00, 0 of 2)"},
		{"an empty floor skipped", cells(1, 1), cells(0, 1), false, "1.00 (1.00-1.00, 0 of 1)"},
	} {
		if got := pairedRatios(tc.mode, tc.off, tput, tc.highBad); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
