package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/health"
	"github.com/kvpool/kvpool/internal/metrics"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

// observability is the agent's metrics, health checks, status report and
// recent-error log, served on two ports: metrics (GET /metrics) and health
// (GET /livez, /readyz, each with /<check> under it, and /status).
type observability struct {
	Metrics *metrics.Metrics
	Health  *health.Health
	Errors  *report.Ring
	Report  *report.Reporter
	// Observer is what the socket server reports each operation to.
	Observer observe.Observer

	log                     *slog.Logger
	metricsAddr, healthAddr net.Addr
}

type obsOptions struct {
	Node, Mode, Version string
	// Targets returns the planned bytes per GPU; nil when there is no plan.
	Targets func() map[int]int64
	// Log is the agent's logger; default slog.Default().
	Log *slog.Logger
}

// newObservability is the step "observability": metrics, health checks,
// the error ring and the status reporter exist before anything can fail at
// run time, so that the failures of the later steps are counted.
func (a *agent) newObservability(context.Context) error {
	a.obs = newObservability(a.pool, obsOptions{Node: a.node, Mode: a.mode, Version: a.opts.Version, Log: a.log,
		Targets: func() map[int]int64 {
			m := map[int]int64{}
			for _, g := range a.plan.GPUs {
				m[g.GPU] = g.Bytes
			}
			return m
		}})
	for _, g := range a.plan.GPUs {
		a.obs.Metrics.InitGPU(g.GPU)
	}
	a.obs.Metrics.RestartsInPlace(a.opts.RestartsInPlace)
	if n := a.opts.RestartsInPlace; n > 0 {
		a.log.Warn("restarted in place: the agent before this one in this container died", "lastExit", a.opts.LastExit, "restartsInPlace", n)
		a.events.RestartedInPlace(a.opts.LastExit, n)
	}
	a.obs.Report.Restart = a.restartStatus
	a.obs.Metrics.Restart(a.restartStatus)
	if !a.opts.Standalone {
		a.obs.Report.Door = a.cfg.Mode
	}
	a.obs.Report.Claims = a.claims
	if a.cfg.Mode == config.ModeDRA && !a.opts.Standalone {
		a.obs.Metrics.InitDRA(a.claims)
	}
	return nil
}

// newObservability watches p. Components add their checks to Health
// (heartbeats, the socket handshake, the kubelet registration flag) and
// report operations and errors to Observer (metrics and the error ring).
func newObservability(p *pool.Pool, o obsOptions) *observability {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	obs := &observability{
		Metrics: metrics.New(p, metrics.Options{Targets: o.Targets}),
		Health:  health.New(health.Options{}),
		Errors:  report.NewRing(64),
		log:     o.Log,
	}
	obs.Observer = observe.Multi(obs.Metrics, obs.Errors)
	obs.Metrics.InitLimitRejects(server.RefusalReasons)
	obs.Health.AddReadiness("chunks", health.ChunksReady(p))
	obs.Report = &report.Reporter{
		Pool: p, Errors: obs.Errors, Targets: o.Targets,
		Node: o.Node, Mode: o.Mode, Version: o.Version, Started: time.Now(),
		Readiness: func() (bool, string) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			r := obs.Health.Ready(ctx)
			return r.OK(), r.Reason()
		},
	}
	return obs
}

// start listens on both addresses (an empty address leaves that server
// off) and serves until ctx ends. It fails, serving nothing, when either
// address cannot be bound.
func (o *observability) start(ctx context.Context, metricsAddr, healthAddr string) error {
	var ml, hl net.Listener
	var err error
	if metricsAddr != "" {
		if ml, err = net.Listen("tcp", metricsAddr); err != nil {
			return fmt.Errorf("metrics listener (metrics.address %q): %w", metricsAddr, err)
		}
		o.metricsAddr = ml.Addr()
	}
	if healthAddr != "" {
		if hl, err = net.Listen("tcp", healthAddr); err != nil {
			if ml != nil {
				ml.Close()
			}
			return fmt.Errorf("health listener (health.address %q): %w", healthAddr, err)
		}
		o.healthAddr = hl.Addr()
	}

	mmux := http.NewServeMux()
	mmux.Handle("GET /metrics", o.Metrics.Handler())
	hmux := http.NewServeMux()
	hmux.Handle("/livez", o.Health.Handler())
	hmux.Handle("/readyz", o.Health.Handler())
	hmux.Handle("/livez/", o.Health.Handler())
	hmux.Handle("/readyz/", o.Health.Handler())
	hmux.Handle("/status", o.Report)
	for _, s := range []struct {
		name string
		ln   net.Listener
		h    http.Handler
	}{{"metrics", ml, mmux}, {"health", hl, hmux}} {
		if s.ln == nil {
			o.log.Info("server off (empty address)", "server", s.name)
			continue
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				o.log.Error("http server stopped", "server", s.name, "err", err)
			}
		}()
		context.AfterFunc(ctx, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				o.log.Warn("http server shutdown", "server", s.name, "err", err)
			}
		})
		o.log.Info("serving", "server", s.name, "address", s.ln.Addr().String())
	}
	return nil
}
