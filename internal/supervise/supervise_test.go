package supervise

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary is also the supervised child: with testPlan set it
// writes a line to testRecord (what its supervisor told it) and then does
// the plan's step for its start (the n-th, by EnvRestarts):
//
//	exit:N       exit with status N
//	exitafter:N  exit with status 0 after N ms
//	kill         SIGKILL itself
//	killafter:N  SIGKILL itself after N ms
//	term:N       say "ready", wait for SIGTERM, exit with status N
//
// A spare (EnvSpare) says so first and waits for its turn.
//
// With testSupervisor set it is a supervisor of such children instead
// (Max 5), so that a test can kill one.
const (
	testPlan       = "SUPERVISE_TEST_PLAN"
	testRecord     = "SUPERVISE_TEST_RECORD"
	testSupervisor = "SUPERVISE_TEST_SUPERVISOR"
)

func TestMain(m *testing.M) {
	if os.Getenv(testSupervisor) == "1" {
		os.Unsetenv(testSupervisor)
		exe, _ := os.Executable()
		end, err := Run(Options{Path: exe, Args: os.Args, Env: os.Environ(), Max: 5, Window: time.Hour})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(99)
		}
		os.Exit(end.Code)
	}
	if plan := os.Getenv(testPlan); plan != "" {
		os.Exit(childMain(strings.Split(plan, ",")))
	}
	os.Exit(m.Run())
}

func childMain(plan []string) int {
	f, err := os.OpenFile(os.Getenv(testRecord), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return 98
	}
	woke := false
	if os.Getenv(EnvSpare) != "" {
		fmt.Fprintf(f, "spare pid=%d\n", os.Getpid())
		turn, err := AwaitTurn()
		if !turn {
			fmt.Fprintf(f, "spare dropped pid=%d err=%v\n", os.Getpid(), err)
			return 0
		}
		woke = true
	}
	n, _ := strconv.Atoi(os.Getenv(EnvRestarts))
	fmt.Fprintf(f, "child=%s n=%d last=%q pid=%d woke=%v spare=%q\n", os.Getenv(EnvChild), n, os.Getenv(EnvLastExit), os.Getpid(), woke, os.Getenv(EnvSpare))
	if n >= len(plan) {
		return 97
	}
	step, arg, _ := strings.Cut(plan[n], ":")
	code, _ := strconv.Atoi(arg)
	switch step {
	case "exit":
		return code
	case "kill":
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	case "exitafter": // arg ms, then status 0
		time.Sleep(time.Duration(code) * time.Millisecond)
		return 0
	case "killafter": // arg ms
		time.Sleep(time.Duration(code) * time.Millisecond)
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	case "term":
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM)
		fmt.Fprintln(f, "ready")
		<-sigs
		return code
	}
	return 96
}

// run supervises this test binary on plan and returns the end and the
// children's record lines.
func run(t *testing.T, plan string, o Options) (Exit, []string, error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	rec := filepath.Join(t.TempDir(), "record")
	if err := os.WriteFile(rec, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	o.Path, o.Args = exe, []string{exe}
	o.Env = append(os.Environ(), testPlan+"="+plan, testRecord+"="+rec, EnvRestarts+"=42", EnvChild+"=stale")
	o.Log = slog.New(slog.NewTextHandler(&log, nil))
	end, err := Run(o)
	b, _ := os.ReadFile(rec)
	t.Logf("supervisor's log:\n%s", log.String())
	return end, strings.Split(strings.TrimSpace(string(b)), "\n"), err
}

func started(lines []string) []string {
	var out []string
	for _, l := range lines {
		if strings.HasPrefix(l, "child=") {
			out = append(out, l[:strings.Index(l, " pid=")])
		}
	}
	return out
}

func TestRestartsInPlace(t *testing.T) {
	killed := Exit{Code: 137, Signal: syscall.SIGKILL}
	for _, tc := range []struct {
		name string
		plan string
		max  int
		want Exit
		// each start's view: its restart count and the end before it
		starts []string
	}{
		{"a clean exit ends it", "exit:0", 3, Exit{}, []string{`child=1 n=0 last=""`}},
		{"killed, then clean", "kill,exit:0", 3, Exit{}, []string{`child=1 n=0 last=""`, `child=1 n=1 last="signal: killed"`}},
		{"a failure, then clean", "exit:3,exit:0", 1, Exit{}, []string{`child=1 n=0 last=""`, `child=1 n=1 last="exit status 3"`}},
		{"failures past max: the last one's status", "exit:3,exit:4,exit:5,exit:0", 2, Exit{Code: 5},
			[]string{`child=1 n=0 last=""`, `child=1 n=1 last="exit status 3"`, `child=1 n=2 last="exit status 4"`}},
		{"kills past max: 128 and the signal", "kill,kill,exit:0", 1, killed, []string{`child=1 n=0 last=""`, `child=1 n=1 last="signal: killed"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			end, lines, err := run(t, tc.plan, Options{Max: tc.max, Window: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			if end != tc.want {
				t.Errorf("end %+v (%v), want %+v", end, end, tc.want)
			}
			if got := started(lines); strings.Join(got, "\n") != strings.Join(tc.starts, "\n") {
				t.Errorf("starts:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.starts, "\n"))
			}
		})
	}
}

// Restarts older than the window no longer count against Max.
func TestWindow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		step   time.Duration // the clock's advance at each reading
		want   Exit
		starts int
	}{
		{"all within the window", 0, Exit{Code: 1}, 2},
		{"each restart out of the window by the next end", 2 * time.Hour, Exit{}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := time.Unix(0, 0)
			o := Options{Max: 1, Window: time.Hour, now: func() time.Time { clock = clock.Add(tc.step); return clock }}
			end, lines, err := run(t, "exit:1,exit:1,exit:1,exit:0", o)
			if err != nil {
				t.Fatal(err)
			}
			if end != tc.want || len(started(lines)) != tc.starts {
				t.Errorf("end %v after %d starts, want %v after %d", end, len(started(lines)), tc.want, tc.starts)
			}
		})
	}
}

// A spare, started SpareAfter after the first child, takes over at its
// death: it is woken (not started then) with the restart's count and the
// end before it. The spare started after that restart is ended with the
// supervisor.
func TestSpareTakesOver(t *testing.T) {
	end, lines, err := run(t, "killafter:300,exitafter:300", Options{Max: 3, Window: time.Hour, Spare: true, SpareAfter: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if end != (Exit{}) {
		t.Fatalf("end %v, want exit status 0", end)
	}
	want := []string{`child=1 n=0 last=""`, `child=1 n=1 last="signal: killed"`}
	if got := started(lines); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("starts:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	var spares []int
	for _, l := range lines {
		if p, ok := strings.CutPrefix(l, "spare pid="); ok {
			pid, _ := strconv.Atoi(p)
			spares = append(spares, pid)
		}
	}
	second := lines[len(lines)-1]
	for _, l := range lines {
		if strings.Contains(l, "n=1 ") {
			second = l
		}
	}
	if len(spares) != 2 || !strings.Contains(second, fmt.Sprintf("pid=%d woke=true spare=\"\"", spares[0])) {
		t.Fatalf("the restart was not the first spare woken (spares %v):\n%s", spares, strings.Join(lines, "\n"))
	}
	for _, pid := range spares {
		if alive(pid) {
			t.Errorf("spare %d outlived its supervisor", pid)
		}
	}
}

// A spare that dies before its turn leaves the next restart to a fresh
// start.
func TestSpareDiesFirst(t *testing.T) {
	exe, _ := os.Executable()
	rec := filepath.Join(t.TempDir(), "record")
	os.WriteFile(rec, nil, 0o600)
	go func() {
		for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
			b, _ := os.ReadFile(rec)
			if _, p, ok := strings.Cut(string(b), "spare pid="); ok {
				pid, _ := strconv.Atoi(strings.Fields(p)[0])
				syscall.Kill(pid, syscall.SIGKILL)
				return
			}
		}
	}()
	var log bytes.Buffer
	end, err := Run(Options{Path: exe, Args: []string{exe}, Env: append(os.Environ(), testPlan+"=killafter:1000,exit:0", testRecord+"="+rec),
		Max: 3, Window: time.Hour, Spare: true, SpareAfter: 10 * time.Millisecond, Log: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(rec)
	if end != (Exit{}) || !strings.Contains(string(b), `n=1 last="signal: killed"`) || strings.Contains(string(b), "woke=true") ||
		!strings.Contains(log.String(), "the spare agent ended before its turn") {
		t.Fatalf("end %v; record:\n%s\nlog:\n%s", end, b, log.String())
	}
}

// A signal passed on ends the child for good, whatever its status, and
// the spare with the supervisor.
func TestSignalPassedOn(t *testing.T) {
	for _, code := range []int{0, 5} {
		t.Run(strconv.Itoa(code), func(t *testing.T) {
			sigs := make(chan os.Signal, 1)
			exe, _ := os.Executable()
			rec := filepath.Join(t.TempDir(), "record")
			os.WriteFile(rec, nil, 0o600)
			go func() {
				// Once the child waits for it, and the spare is up.
				for {
					if b, _ := os.ReadFile(rec); bytes.Contains(b, []byte("ready")) && bytes.Contains(b, []byte("spare pid=")) {
						sigs <- syscall.SIGTERM
						return
					}
					time.Sleep(5 * time.Millisecond)
				}
			}()
			end, err := Run(Options{Path: exe, Args: []string{exe}, Env: append(os.Environ(), testPlan+"=term:"+strconv.Itoa(code)+",exit:0", testRecord+"="+rec),
				Max: 3, Window: time.Hour, Signals: sigs, Spare: true})
			if err != nil {
				t.Fatal(err)
			}
			b, _ := os.ReadFile(rec)
			lines := strings.Split(string(b), "\n")
			if end.Code != code || len(started(lines)) != 1 {
				t.Errorf("end %v, record:\n%s\nwant exit status %d after one start", end, b, code)
			}
			for _, l := range lines {
				if p, ok := strings.CutPrefix(l, "spare pid="); ok {
					if pid, _ := strconv.Atoi(p); alive(pid) {
						t.Errorf("the spare %d outlived its supervisor", pid)
					}
				}
			}
		})
	}
}

// A spare's turn is one line: the restart and the last end; anything else
// is refused (and the spare then exits instead of serving).
func TestParseTurn(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		last string
	}{
		{"1 signal: killed\n", 1, "signal: killed"},
		{"12 exit status 2\n", 12, "exit status 2"},
		{"", 0, ""},
		{"1 signal: killed", 0, ""}, // no end of line
		{"0 signal: killed\n", 0, ""},
		{"-1 signal: killed\n", 0, ""},
		{"x signal: killed\n", 0, ""},
		{"1\n", 0, ""},
		{"1 \n", 0, ""},
		{"1 a\nb\n", 0, ""},
		{"1 a\x00\n", 0, ""},
		{"99999999999 signal: killed\n", 0, ""},
		{"01 signal: killed\n", 0, ""},
		{"+1 signal: killed\n", 0, ""},
	} {
		n, last, err := parseTurn([]byte(tc.in))
		if n != tc.n || last != tc.last || (err == nil) != (tc.n > 0) {
			t.Errorf("parseTurn(%q) = %d, %q, %v; want %d, %q", tc.in, n, last, err, tc.n, tc.last)
		}
	}
}

func FuzzParseTurn(f *testing.F) {
	f.Add([]byte("1 signal: killed\n"))
	f.Add([]byte("3 exit status 2\n"))
	f.Add([]byte(""))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, last, err := parseTurn(b)
		if err != nil {
			if n != 0 || last != "" {
				t.Fatalf("refused %q but gave %d, %q", b, n, last)
			}
			return
		}
		// What is accepted is what wakeSpare would have written.
		if n < 1 || last == "" || fmt.Sprintf("%d %s\n", n, last) != string(b) {
			t.Fatalf("accepted %q as %d, %q", b, n, last)
		}
	})
}

// Bad options are refused before anything starts.
func TestOptionsRefused(t *testing.T) {
	rec := filepath.Join(t.TempDir(), "record")
	os.WriteFile(rec, nil, 0o600)
	exe, _ := os.Executable()
	env := append(os.Environ(), testPlan+"=exit:0", testRecord+"="+rec)
	for _, tc := range []struct {
		name string
		o    Options
		want string
	}{
		{"no program", Options{Args: []string{"x"}, Env: env, Max: 1, Window: time.Second}, "no program"},
		{"no arguments", Options{Path: exe, Env: env, Max: 1, Window: time.Second}, "no program"},
		{"max 0", Options{Path: exe, Args: []string{exe}, Env: env, Window: time.Second}, "0 restarts in place: want 1 to 100"},
		{"max past the bound", Options{Path: exe, Args: []string{exe}, Env: env, Max: 101, Window: time.Second}, "want 1 to 100"},
		{"no window", Options{Path: exe, Args: []string{exe}, Env: env, Max: 1}, "window 0s"},
		{"negative window", Options{Path: exe, Args: []string{exe}, Env: env, Max: 1, Window: -time.Second}, "window -1s"},
		{"negative spare delay", Options{Path: exe, Args: []string{exe}, Env: env, Max: 1, Window: time.Second, Spare: true, SpareAfter: -time.Second}, "spare after -1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Run(tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
	if b, _ := os.ReadFile(rec); len(b) != 0 {
		t.Fatalf("a refused supervisor started a child:\n%s", b)
	}
	if _, err := Run(Options{Path: filepath.Join(t.TempDir(), "missing"), Args: []string{"missing"}, Max: 1, Window: time.Second}); err == nil ||
		!strings.Contains(err.Error(), "start") {
		t.Fatalf("a missing program: error %v", err)
	}
}

// A child does not outlive its supervisor.
func TestChildDiesWithSupervisor(t *testing.T) {
	exe, _ := os.Executable()
	rec := filepath.Join(t.TempDir(), "record")
	os.WriteFile(rec, nil, 0o600)
	var p *os.Process
	p, err := os.StartProcess(exe, []string{exe}, &os.ProcAttr{
		Env:   append(os.Environ(), testSupervisor+"=1", testPlan+"=term:0", testRecord+"="+rec),
		Files: []*os.File{nil, os.Stdout, os.Stderr},
	})
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	deadline := time.Now().Add(20 * time.Second)
	for pid == 0 {
		b, _ := os.ReadFile(rec)
		if i := bytes.Index(b, []byte(" pid=")); i >= 0 && bytes.Contains(b, []byte("ready")) {
			pid, _ = strconv.Atoi(strings.Fields(string(b[i+5:]))[0])
		} else if time.Now().After(deadline) {
			p.Kill()
			t.Fatalf("no child ready; record:\n%s", b)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	p.Wait()
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("the child (pid %d) outlived its supervisor", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// alive says whether pid runs (a zombie has ended).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}
