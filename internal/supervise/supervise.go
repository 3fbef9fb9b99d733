// Package supervise restarts the agent's serving process in place when it
// dies, instead of leaving the restart to kubelet.
//
// kubelet notices a dead container at its next relist, creates and starts
// a new one, and after the first crash waits a back-off (10 s, doubling)
// before each restart: on the e2e node a SIGKILLed agent served again
// 0.75-3.9 s later, restarted in place 27-45 ms later (docs/benchmarks.md,
// "Restart in place"). So the container's first
// process supervises: it runs the agent as its child, and when the child
// dies abnormally (a signal, or a non-zero exit not asked for) starts it
// again at once, up to Max times within Window. Past that it exits with
// the child's status, so that a crash loop still reaches kubelet (its
// back-off, the pod's restart count, CrashLoopBackOff).
//
// The supervisor does nothing else: it opens no socket and holds no
// memory of the pool (the keeper does); `agent serve` checks the whole
// configuration before it supervises, so a bad value fails once rather
// than in a loop. Termination signals are passed on to the child, and a
// child that ends after one is not restarted. The child gets SIGKILL if
// the supervisor dies: the chart's pod shares the host's PID namespace, so
// no namespace teardown would end it. (The agent starts no process, so
// the supervisor waits for its own children only and reaps no orphans.)
package supervise

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The child's environment says it is one: EnvChild (it serves and does
// not supervise), how many times it was restarted in place before it
// (EnvRestarts) and how the last one ended (EnvLastExit).
const (
	EnvChild    = "KVPOOL_SUPERVISED"
	EnvRestarts = "KVPOOL_RESTARTS_IN_PLACE"
	EnvLastExit = "KVPOOL_LAST_EXIT"
	// EnvSpare marks a spare: a child started ahead of its turn, which
	// waits for it on fd 3 (AwaitTurn).
	EnvSpare = "KVPOOL_SPARE"
)

// MaxRestarts bounds Options.Max: past a few restarts a minute kubelet's
// back-off is the better judge.
const MaxRestarts = 100

// Options configure Run.
type Options struct {
	// Path and Args are the child's program and its arguments (Args[0]
	// its name).
	Path string
	Args []string
	// Env is the child's environment; Run adds EnvChild, EnvRestarts,
	// EnvLastExit and, for a spare, EnvSpare (replacing any already
	// there).
	Env []string
	// Max is how many restarts in place Window may hold (1 to
	// MaxRestarts); the next abnormal end is the supervisor's own.
	Max int
	// Window is how far back restarts count against Max (positive).
	Window time.Duration
	// Signals are passed on to the child; after one, the child's end is
	// final. Nil: none.
	Signals <-chan os.Signal
	// Spare keeps a spare child: one that has gone through the program's
	// start (for the agent, the 30-45 ms of Go's initialisation of its
	// packages, docs/benchmarks.md) and waits to take over, so that a
	// restart in place starts from there. Started SpareAfter after the
	// first child and after each restart in place (0: at once).
	Spare      bool
	SpareAfter time.Duration
	// Log receives a line for each restart and for the supervisor's end;
	// default slog.Default().
	Log *slog.Logger

	// now is the clock (tests); default time.Now.
	now func() time.Time
}

// Check reports what is wrong with o, or nil.
func (o *Options) Check() error {
	switch {
	case o.Path == "" || len(o.Args) == 0:
		return errors.New("supervise: no program to run")
	case o.Max < 1 || o.Max > MaxRestarts:
		return fmt.Errorf("supervise: %d restarts in place: want 1 to %d", o.Max, MaxRestarts)
	case o.Window <= 0:
		return fmt.Errorf("supervise: window %v: want a positive duration", o.Window)
	case o.SpareAfter < 0:
		return fmt.Errorf("supervise: spare after %v: want 0 or more", o.SpareAfter)
	}
	return nil
}

// Exit is how a child ended, as a container's exit code reports it: its
// exit status, or 128 and the signal that killed it.
type Exit struct {
	Code   int
	Signal syscall.Signal // 0 when it exited
}

func exitOf(ws syscall.WaitStatus) Exit {
	if ws.Signaled() {
		return Exit{Code: 128 + int(ws.Signal()), Signal: ws.Signal()}
	}
	return Exit{Code: ws.ExitStatus()}
}

// String says how the child ended: "exit status 3", "signal: killed".
func (e Exit) String() string {
	if e.Signal != 0 {
		return "signal: " + e.Signal.String()
	}
	return "exit status " + strconv.Itoa(e.Code)
}

// Run runs the child until it ends normally, ends after a passed-on
// signal, or ends abnormally once more than Max times within Window; it
// returns the last child's end (the code to exit with). An error means no
// child could be started (the first: nothing ran; a later one: the
// previous child's end stands in Exit).
func Run(o Options) (Exit, error) {
	if err := o.Check(); err != nil {
		return Exit{}, err
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.now == nil {
		o.now = time.Now
	}
	// A child's parent-death signal fires when the thread that started it
	// exits: every start is made from this goroutine, kept on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Room for every waiter's report (the serving child, the spare, one
	// that failed its turn), so that none is left blocked at the end.
	s := &supervisor{o: o, ended: make(chan ended, 4)}
	defer s.dropSpare()
	serving, err := s.start(0, Exit{})
	if err != nil {
		return Exit{}, fmt.Errorf("supervise: start %s: %w", o.Path, err)
	}
	// The spare waits a little too, so as not to slow the first start.
	var spareAt <-chan time.Time
	if o.Spare {
		spareAt = time.After(o.SpareAfter)
	}
	var (
		restarts []time.Time // within the window, oldest first
		last     Exit
		stopping bool
	)
	for n := 1; ; {
		select {
		case sig, ok := <-o.Signals:
			if !ok {
				o.Signals = nil
				continue
			}
			stopping = true
			if sn, ok := sig.(syscall.Signal); ok {
				_ = syscall.Kill(serving.pid, sn)
			}
			continue
		case <-spareAt:
			spareAt = nil
			if !stopping {
				s.startSpare()
			}
			continue
		case e := <-s.ended:
			if e.pid != serving.pid {
				s.spareEnded(e)
				continue
			}
			if e.err != nil {
				return last, fmt.Errorf("supervise: wait for pid %d: %w", e.pid, e.err)
			}
			last = exitOf(e.ws)
		}
		up := o.now().Sub(serving.started)
		switch {
		case last.Code == 0:
			return last, nil
		case stopping:
			o.Log.Info("agent ended after a signal passed on to it; not restarting", "exit", last.String(), "up", up.Round(time.Millisecond))
			return last, nil
		}
		now := o.now()
		for len(restarts) > 0 && now.Sub(restarts[0]) >= o.Window {
			restarts = restarts[1:]
		}
		if len(restarts) >= o.Max {
			o.Log.Error("agent ended abnormally: restarts in place spent, exiting for kubelet to restart the container",
				"exit", last.String(), "up", up.Round(time.Millisecond), "restartsInWindow", len(restarts), "window", o.Window)
			return last, nil
		}
		restarts = append(restarts, now)
		o.Log.Warn("agent ended abnormally; restarting it in place", "exit", last.String(), "up", up.Round(time.Millisecond),
			"restart", n, "restartsInWindow", len(restarts), "max", o.Max, "window", o.Window, "spare", s.spare != nil)
		if serving = s.wakeSpare(n, last); serving == nil {
			if serving, err = s.start(n, last); err != nil {
				return last, fmt.Errorf("supervise: start %s: %w", o.Path, err)
			}
		}
		n++
		if o.Spare && spareAt == nil && s.spare == nil {
			// Not at once: its start would take CPU from the restore
			// of the agent it stands behind.
			spareAt = time.After(o.SpareAfter)
		}
	}
}

// supervisor is Run's children: the serving one's start and end, and the
// spare.
type supervisor struct {
	o     Options
	ended chan ended
	spare *child
}

type child struct {
	pid     int
	started time.Time
	turn    *os.File // a spare's end of its pipe; nil once it serves
}

type ended struct {
	pid int
	ws  syscall.WaitStatus
	err error
}

// start starts a serving child, the n-th restart after an end last.
func (s *supervisor) start(n int, last Exit) (*child, error) {
	return s.spawn(childEnv(s.o.Env, n, last), nil)
}

// spawn starts the program with env (and r as its fd 3), and a waiter
// that reports its end on s.ended.
func (s *supervisor) spawn(env []string, r *os.File) (*child, error) {
	files := []*os.File{os.Stdin, os.Stdout, os.Stderr}
	if r != nil {
		files = append(files, r)
	}
	p, err := os.StartProcess(s.o.Path, s.o.Args, &os.ProcAttr{
		Env:   env,
		Files: files,
		// Its own process group: a terminal's signals reach the
		// supervisor alone, which passes them on once.
		Sys: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true},
	})
	if err != nil {
		return nil, err
	}
	c := &child{pid: p.Pid, started: s.o.now()}
	_ = p.Release() // waited for by pid below
	go func() {
		ws, err := wait(c.pid)
		s.ended <- ended{c.pid, ws, err}
	}()
	return c, nil
}

// startSpare starts a spare: a child that runs the program's start (Go's
// initialisation of its packages) and then waits on its fd 3 for its turn
// (AwaitTurn). A spare that cannot start is logged and left out.
func (s *supervisor) startSpare() {
	r, w, err := os.Pipe()
	if err != nil {
		s.o.Log.Warn("no spare agent: a pipe", "err", err)
		return
	}
	env := append(childEnv(s.o.Env, 0, Exit{}), EnvSpare+"=1")
	c, err := s.spawn(env, r)
	r.Close()
	if err != nil {
		w.Close()
		s.o.Log.Warn("no spare agent", "err", err)
		return
	}
	c.turn, s.spare = w, c
}

// wakeSpare hands the spare its turn as the n-th restart after an end
// last and returns it, or nil where there is no spare or it is gone.
func (s *supervisor) wakeSpare(n int, last Exit) *child {
	c := s.spare
	if c == nil {
		return nil
	}
	s.spare = nil
	_, err := fmt.Fprintf(c.turn, "%d %s\n", n, last)
	c.turn.Close()
	c.turn = nil
	if err != nil { // it ended: its waiter reports that, to spareEnded
		s.o.Log.Warn("the spare agent could not take its turn", "err", err)
		return nil
	}
	c.started = s.o.now()
	return c
}

// spareEnded takes the end of a child that is not the serving one: the
// spare, dead before its turn (no other is started until the next
// restart), or one dropped.
func (s *supervisor) spareEnded(e ended) {
	if s.spare != nil && e.pid == s.spare.pid {
		s.o.Log.Warn("the spare agent ended before its turn", "exit", exitOf(e.ws).String())
		s.spare.turn.Close()
		s.spare = nil
	}
}

// dropSpare ends the spare, if any, and waits for it.
func (s *supervisor) dropSpare() {
	c := s.spare
	if c == nil {
		return
	}
	s.spare = nil
	c.turn.Close()
	_ = syscall.Kill(c.pid, syscall.SIGKILL)
	for e := range s.ended {
		if e.pid == c.pid {
			return
		}
	}
}

// wait waits for the child pid to end.
func wait(pid int) (syscall.WaitStatus, error) {
	for {
		var ws syscall.WaitStatus
		_, err := syscall.Wait4(pid, &ws, 0, nil)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case err != nil:
			return 0, err
		case ws.Exited() || ws.Signaled():
			return ws, nil
		}
	}
}

// AwaitTurn is a spare's wait (EnvSpare set): it blocks until its
// supervisor hands it the turn, then sets EnvRestarts and EnvLastExit as
// the supervisor would have for a fresh start, unsets EnvSpare and returns
// true. It returns false when the supervisor ended without handing it
// over (the spare then exits).
func AwaitTurn() (bool, error) {
	f := os.NewFile(3, "kvpool-spare-turn")
	if f == nil {
		return false, errors.New("supervise: a spare without its turn's pipe (fd 3)")
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 1024))
	if err != nil {
		return false, fmt.Errorf("supervise: a spare's turn: %w", err)
	}
	if len(b) == 0 {
		return false, nil
	}
	n, last, err := parseTurn(b)
	if err != nil {
		return false, err
	}
	os.Setenv(EnvRestarts, strconv.Itoa(n))
	os.Setenv(EnvLastExit, last)
	os.Unsetenv(EnvSpare)
	return true, nil
}

// parseTurn reads the turn wakeSpare writes: the restart's count (1 or
// more) and how the last child ended, one line.
func parseTurn(b []byte) (n int, last string, err error) {
	line, ok := strings.CutSuffix(string(b), "\n")
	ns, last, ok2 := strings.Cut(line, " ")
	n, err = strconv.Atoi(ns)
	if !ok || !ok2 || err != nil || n < 1 || n > 1<<30 || strconv.Itoa(n) != ns || last == "" || strings.ContainsAny(last, "\n\x00") {
		return 0, "", fmt.Errorf("supervise: a spare's turn %q: want the restart and the last end on one line", b)
	}
	return n, last, nil
}

// childEnv is env with the child's three variables set for the n-th
// restart (0: the first start) after an end last.
func childEnv(env []string, n int, last Exit) []string {
	out := make([]string, 0, len(env)+3)
	for _, kv := range env {
		if hasKey(kv, EnvChild) || hasKey(kv, EnvRestarts) || hasKey(kv, EnvLastExit) || hasKey(kv, EnvSpare) {
			continue
		}
		out = append(out, kv)
	}
	out = append(out, EnvChild+"=1", EnvRestarts+"="+strconv.Itoa(n))
	if n > 0 {
		out = append(out, EnvLastExit+"="+last.String())
	}
	return out
}

func hasKey(kv, key string) bool {
	return len(kv) > len(key) && kv[len(key)] == '=' && kv[:len(key)] == key
}
