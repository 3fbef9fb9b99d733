package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/kvpool/kvpool/internal/config"
)

// step is one part of the agent's start-up: start brings it up, stop
// undoes it. Boot runs the steps of the agent's mode in order; a failed
// start, and later Wait, cancel the agent's context and then run the stops
// in reverse. A stop therefore runs with the context already done, and it
// runs for the step whose start failed too: it must undo whatever part of
// start happened (and nothing when nothing did). stop is nil where there is
// nothing to undo.
//
// Adding a component is adding one step to (*agent).steps.
type step struct {
	name  string
	start func(ctx context.Context) error
	stop  func() error
}

// mode is what decides which steps the agent runs, fixed once from its
// Options before anything starts.
type mode struct {
	standalone bool // --standalone: simulated GPUs, no API server, a local socket
	plugin     bool // the kubelet device plugin: always in a cluster, standalone only with --device-plugin
	keeper     bool // keeperSocket: the pool is adopted from the keeper and kept there
	fixed      bool // a fixed standalone layout (--chunks-per-gpu/--chunk-mib, pkg/standalone)
	// dra: mode "dra" (cluster only): the DRA driver is the front door;
	// the device plugin's ledger serves it, unregistered.
	dra bool
}

func modeOf(o Options) mode {
	return mode{
		standalone: o.Standalone,
		plugin:     !o.Standalone || o.DevicePlugin,
		keeper:     o.Config.KeeperSocket != "",
		fixed:      o.Standalone && o.ChunksPerGPU > 0 && o.ChunkBytes > 0,
		dra:        !o.Standalone && o.Config.Mode == config.ModeDRA,
	}
}

// static: standalone tokens name their chunks up front (no device plugin
// hands out tokens).
func (m mode) static() bool { return m.standalone && !m.plugin }

// String names the mode as docs/architecture.md lists its steps:
// "cluster" or "standalone", then "+dra" or "+device-plugin" (standalone
// only), "+fixed" and "+keeper".
func (m mode) String() string {
	s := "cluster"
	if m.dra {
		s += "+dra"
	}
	if m.standalone {
		s = "standalone"
		if m.plugin {
			s += "+device-plugin"
		}
	}
	if m.fixed {
		s += "+fixed"
	}
	if m.keeper {
		s += "+keeper"
	}
	return s
}

// steps is the agent's start-up in mode m, in order. Every mode check of
// start-up is made here, once; the steps themselves do not ask which mode
// they run in. docs/architecture.md lists these names per mode
// (TestStepsPerMode keeps the two equal).
func (a *agent) steps(m mode) []step {
	var s []step
	add := func(on bool, st step) {
		if on {
			s = append(s, st)
		}
	}
	add(true, step{name: "node", start: a.readNode})
	// The keeper first: the plan counts what it holds as the pool's own,
	// and a restart that adopts a pool reads the Node beside serving.
	add(m.keeper, step{name: "keeper", start: do(a.connectKeeper), stop: a.closeKeeper})
	add(!m.standalone, step{name: "kube", start: a.startKube, stop: a.closeKube})
	add(true, a.gpusStep(m))
	add(true, a.planStep(m))
	add(m.keeper, step{name: "restore", start: do(a.restore), stop: a.stopRestore})
	add(m.keeper, background("locks", a.startLocks))
	add(m.static(), step{name: "tokens", start: do(a.prepareTokens)})
	add(true, step{name: "observability", start: a.newObservability})
	add(m.plugin, step{name: "plugin", start: a.pluginStep(m), stop: a.closePlugin})
	add(m.keeper, step{name: "settle", start: do(a.settleRestored)})
	// Standalone tokens name their chunks up front: allocate before the
	// socket appears, so that a client that finds the socket finds its
	// chunks.
	add(m.static(), step{name: "allocate", start: a.allocateNow})
	// The device plugin is built before the server, whose authorize
	// resolves the tokens it hands out.
	add(true, step{name: "server", start: a.newServer})
	add(m.standalone, step{name: "socket-dir", start: a.checkSocketDir})
	add(m.keeper, step{name: "sessions", start: a.restoreSessions})
	add(true, step{name: "listen", start: a.listen, stop: a.unlisten})
	add(m.keeper, background("heartbeat", a.startHeartbeat))
	add(true, step{name: "serve", start: a.serve, stop: a.served})
	add(true, background("probes", a.addHealthChecks))
	add(true, step{name: "endpoints", start: a.startEndpoints})
	add(m.plugin && !m.dra, step{name: "register", start: a.register, stop: a.unregister})
	// In mode dra the ledger's loops run unregistered, and the DRA
	// driver registers with kubelet and publishes the ResourceSlices.
	add(m.dra, step{name: "dra", start: a.startDRA, stop: a.stopDRA})
	add(!m.standalone, a.statusStep())
	add(!m.static(), background("allocate-background", a.allocateBackground))
	return s
}

// do adapts a start that needs no context.
func do(start func() error) func(context.Context) error {
	return func(context.Context) error { return start() }
}

// background is a step that starts goroutines (through wg) which end
// with the agent's context; its stop waits for them.
func background(name string, start func(ctx context.Context, wg *sync.WaitGroup) error) step {
	wg := new(sync.WaitGroup)
	return step{
		name:  name,
		start: func(ctx context.Context) error { return start(ctx, wg) },
		stop:  func() error { wg.Wait(); return nil },
	}
}

// slowStep is the duration from which a step's start or stop is logged at
// info level; faster ones are logged at debug level.
const slowStep = 100 * time.Millisecond

// lifecycle runs steps and remembers which have started, so that they can
// be stopped in reverse.
type lifecycle struct {
	log     *slog.Logger
	started []step
}

// start runs each step's start in order. On a failure it returns that
// step's error; the caller then cancels the context and calls stop, which
// also undoes the failed step.
func (l *lifecycle) start(ctx context.Context, steps []step) error {
	for _, s := range steps {
		t := time.Now()
		l.started = append(l.started, s)
		if err := s.start(ctx); err != nil {
			l.log.Info("start-up step failed; undoing the steps started", "step", s.name, "err", err)
			return err
		}
		l.logTook("start-up step", s.name, time.Since(t))
	}
	return nil
}

// stop runs the stops of the started steps in reverse, each once, and
// joins their errors. The agent's context must be done.
func (l *lifecycle) stop() error {
	var errs []error
	for i := len(l.started) - 1; i >= 0; i-- {
		s := l.started[i]
		if s.stop == nil {
			continue
		}
		t := time.Now()
		if err := s.stop(); err != nil {
			l.log.Warn("shutdown step", "step", s.name, "err", err)
			errs = append(errs, fmt.Errorf("stop %s: %w", s.name, err))
		}
		l.logTook("shutdown step", s.name, time.Since(t))
	}
	l.started = nil
	return errors.Join(errs...)
}

func (l *lifecycle) logTook(msg, name string, took time.Duration) {
	level := slog.LevelDebug
	if took >= slowStep {
		level = slog.LevelInfo
	}
	l.log.Log(context.Background(), level, msg, "step", name, "took", took.Round(time.Microsecond))
}

// stepNames lists the names of steps, space-separated.
func stepNames(steps []step) string {
	names := make([]string, len(steps))
	for i, s := range steps {
		names[i] = s.name
	}
	return strings.Join(names, " ")
}
