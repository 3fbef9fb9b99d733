// Package supervise restarts the agent's serving process in place when it
// dies, instead of leaving the restart to kubelet.
//
// kubelet notices a dead container at its next relist, creates and starts
// a new one, and after the first crash waits a back-off (10 s, doubling)
// before each restart: on the e2e node a SIGKILLed agent served again
// seconds later, while the agent itself is back in tens of milliseconds
// (docs/benchmarks.md, "Restart in place"). So the container's first
// process supervises: it runs the agent as its child, and when the child
// dies abnormally (a signal, or a non-zero exit not asked for) starts it
// again at once, up to Max times within Window. Past that it exits with
// the child's status, so that a crash loop still reaches kubelet (its
// back-off, the pod's restart count, CrashLoopBackOff).
//
// The supervisor does nothing else: it reads no configuration beyond its
// own two fields, opens no socket and holds no memory of the pool (the
// keeper does). Termination signals are passed on to the child, and a
// child that ends after one is not restarted. The child gets SIGKILL if
// the supervisor dies: the chart's pod shares the host's PID namespace, so
// no namespace teardown would end it. As a PID namespace's init the
// supervisor also reaps any orphan.
package supervise

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync"
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
	// Env is the child's environment; Run adds EnvChild, EnvRestarts and
	// EnvLastExit (replacing any already there).
	Env []string
	// Max is how many restarts in place Window may hold (1 to
	// MaxRestarts); the next abnormal end is the supervisor's own.
	Max int
	// Window is how far back restarts count against Max (positive).
	Window time.Duration
	// Signals are passed on to the child; after one, the child's end is
	// final. Nil: none.
	Signals <-chan os.Signal
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
	// The child's parent-death signal fires when the thread that started
	// it exits: keep this goroutine, and every start, on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	var (
		mu       sync.Mutex
		pid      int  // the running child, 0 between children
		stopping bool // a signal was passed on: the next end is final
	)
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case <-done:
				return
			case sig, ok := <-o.Signals:
				if !ok {
					return
				}
				mu.Lock()
				stopping = true
				if pid > 0 {
					if s, ok := sig.(syscall.Signal); ok {
						_ = syscall.Kill(pid, s)
					}
				}
				mu.Unlock()
			}
		}
	}()

	var restarts []time.Time // within the window, oldest first
	var last Exit
	for n := 0; ; n++ {
		env := childEnv(o.Env, n, last)
		mu.Lock()
		if stopping {
			mu.Unlock()
			return last, nil
		}
		p, err := os.StartProcess(o.Path, o.Args, &os.ProcAttr{
			Env:   env,
			Files: []*os.File{os.Stdin, os.Stdout, os.Stderr},
			// Its own process group: a terminal's signals reach the
			// supervisor alone, which passes them on once.
			Sys: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true},
		})
		if err != nil {
			mu.Unlock()
			return last, fmt.Errorf("supervise: start %s: %w", o.Path, err)
		}
		pid = p.Pid
		started := o.now()
		mu.Unlock()

		ws, err := wait(p.Pid)
		mu.Lock()
		pid = 0
		stop := stopping
		mu.Unlock()
		if err != nil {
			return last, fmt.Errorf("supervise: wait for pid %d: %w", p.Pid, err)
		}
		last = exitOf(ws)
		up := o.now().Sub(started)
		switch {
		case last.Code == 0:
			return last, nil
		case stop:
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
			"restart", n+1, "restartsInWindow", len(restarts), "max", o.Max, "window", o.Window)
	}
}

// wait waits for the child pid to end. As a PID namespace's init the
// supervisor also reaps whatever else ends (orphans reparented to it).
func wait(pid int) (syscall.WaitStatus, error) {
	reapAll := os.Getpid() == 1
	for {
		var ws syscall.WaitStatus
		w := pid
		if reapAll {
			w = -1
		}
		got, err := syscall.Wait4(w, &ws, 0, nil)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case err != nil:
			return 0, err
		case got == pid && (ws.Exited() || ws.Signaled()):
			return ws, nil
		}
	}
}

// childEnv is env with the child's three variables set for the n-th
// restart (0: the first start) after an end last.
func childEnv(env []string, n int, last Exit) []string {
	out := make([]string, 0, len(env)+3)
	for _, kv := range env {
		if hasKey(kv, EnvChild) || hasKey(kv, EnvRestarts) || hasKey(kv, EnvLastExit) {
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
