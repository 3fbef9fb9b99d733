package agent

import (
	"context"
	"log/slog"
	"time"

	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

// pluginConfig is the device plugin's part of the agent configuration,
// taken from the AgentConfig (resourceName, kubeletDir, socketDir,
// stateDir, reclaim.gracePeriod, reclaim.interval).
type pluginConfig struct {
	Enabled      bool // in-cluster mode always; standalone only with --device-plugin
	ResourceName string
	KubeletDir   string
	SocketDir    string
	StateDir     string
	GracePeriod  time.Duration
	Interval     time.Duration
	BindPods     bool             // tokenBinding "pod"
	PodLogsDir   string           // kubelet's pod log directory
	Observer     observe.Observer // the plugin's operations and failures: metrics and the error ring
}

// pluginRun is a device plugin, built by newPlugin and registered with
// kubelet by start.
type pluginRun struct {
	// Plugin's Authorize maps KVPOOL_TOKEN to the pool allocation; give it
	// to the copy server.
	Plugin *plugin.Plugin
	// Feed must get a new snapshot whenever chunks become ready or fail:
	// Feed.Set(plugin.PoolDevices(p.Chunks())), or Feed.SetHealth.
	Feed    *plugin.Feed
	cfg     pluginConfig
	log     *slog.Logger
	done    chan struct{}
	started bool
}

// Wait returns once the plugin has stopped (after ctx ended), at once when
// it never started.
func (r *pluginRun) Wait() {
	if r != nil && r.started {
		<-r.done
	}
}

// Running reports whether the plugin's serve loop is still going (or
// has not started yet).
func (r *pluginRun) Running() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}

// newPlugin builds the kubelet device plugin over p (restoring its
// checkpoint), or returns nil when cfg does not enable it. renew replaces a
// reclaimed chunk with fresh memory (plugin.Options.Renew).
func newPlugin(cfg pluginConfig, p *pool.Pool, renew func(id string) error, ev events.Events, log *slog.Logger) (*pluginRun, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	feed := plugin.NewFeed()
	if err := feed.Set(plugin.PoolDevices(p.Chunks())); err != nil {
		return nil, err
	}
	pl, err := plugin.New(plugin.Options{
		ResourceName: cfg.ResourceName,
		KubeletDir:   cfg.KubeletDir,
		SocketDir:    cfg.SocketDir,
		StateDir:     cfg.StateDir,
		Pool:         p,
		Devices:      feed,
		Renew:        renew,
		Reclaimed:    ev.ChunksReclaimed,
		ChunkHealth: func(id string, healthy bool, reason string) {
			if healthy {
				ev.ChunkRecovered(id)
			} else {
				ev.ChunkUnhealthy(id, reason)
			}
		},
		GracePeriod: cfg.GracePeriod,
		Interval:    cfg.Interval,
		BindPods:    cfg.BindPods,
		PodLogsDir:  cfg.PodLogsDir,
		Logger:      log,
		Observer:    cfg.Observer,
	})
	if err != nil {
		return nil, err
	}
	return &pluginRun{Plugin: pl, Feed: feed, cfg: cfg, log: log, done: make(chan struct{})}, nil
}

// UnhealthyChunks counts, per GPU, the chunks kubelet is told are
// unhealthy (the KVPoolNode's Degraded health); nil without a plugin.
func (r *pluginRun) UnhealthyChunks() map[int]int {
	if r == nil {
		return nil
	}
	return r.Plugin.UnhealthyByGPU()
}

// start registers with kubelet and serves until ctx ends.
func (r *pluginRun) start(ctx context.Context) {
	r.started = true
	go func() {
		defer close(r.done)
		if err := r.Plugin.Run(ctx); err != nil {
			r.log.Error("device plugin stopped", "err", err)
		}
	}()
	r.log.Info("device plugin started", "resource", r.cfg.ResourceName, "kubeletDir", r.cfg.KubeletDir, "socketDir", r.cfg.SocketDir)
}
