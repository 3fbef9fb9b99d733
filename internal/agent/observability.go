package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

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

	// limitRejects counts the socket server's refusals by reason
	// (kvpool_limit_rejects_total).
	limitRejects *prometheus.CounterVec

	metricsAddr, healthAddr net.Addr
}

type obsOptions struct {
	Node, Mode, Version string
	// Targets returns the planned bytes per GPU; nil when there is no plan.
	Targets func() map[int]int64
}

// newObservability watches p. Components add their checks to Health
// (heartbeats, the socket handshake, the kubelet registration flag) and
// report operations and errors to Observer (metrics and the error ring).
func newObservability(p *pool.Pool, o obsOptions) *observability {
	obs := &observability{
		Metrics: metrics.New(p, metrics.Options{Targets: o.Targets}),
		Health:  health.New(health.Options{}),
		Errors:  report.NewRing(64),
	}
	obs.Observer = observe.Multi(obs.Metrics, obs.Errors)
	obs.limitRejects = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metrics.Namespace, Name: "limit_rejects_total",
		Help: "Connections and requests the socket server refused by a per-tenant bound, a bad token, a resume by another process, or a temporary accept failure, by reason.",
	}, []string{"reason"})
	for _, r := range server.RefusalReasons {
		obs.limitRejects.WithLabelValues(r)
	}
	obs.Metrics.Registry().MustRegister(obs.limitRejects)
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
			slog.Info("server off (empty address)", "server", s.name)
			continue
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				slog.Error("http server stopped", "server", s.name, "err", err)
			}
		}()
		context.AfterFunc(ctx, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				slog.Warn("http server shutdown", "server", s.name, "err", err)
			}
		})
		slog.Info("serving", "server", s.name, "address", s.ln.Addr().String())
	}
	return nil
}
