package agent

import (
	"context"
	"log/slog"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// pluginRun is a device plugin, built by the step "plugin" and registered
// with kubelet by the step "register".
type pluginRun struct {
	// Plugin's Authorize maps KVPOOL_TOKEN to the pool allocation; give it
	// to the copy server.
	Plugin *plugin.Plugin
	// Feed must get a new snapshot whenever chunks become ready or fail:
	// Feed.Set(plugin.PoolDevices(p.Chunks())), or Feed.SetHealth.
	Feed    *plugin.Feed
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

// pluginStep is the step "plugin": the kubelet device plugin, built over
// the pool (restoring its checkpoint) and not yet registered.
func (a *agent) pluginStep(m mode) func(context.Context) error {
	return func(context.Context) error {
		if m.standalone && !a.opts.RandomToken {
			a.log.Warn("standalone tokens are ignored with --device-plugin: kubelet's Allocate hands out the tokens")
		}
		feed := plugin.NewFeed()
		if err := feed.Set(plugin.PoolDevices(a.pool.Chunks())); err != nil {
			return err
		}
		o := pluginOptions(a.cfg)
		o.Pool, o.Devices, o.Renew = a.pool, feed, a.renew
		o.Logger, o.Observer = a.log, a.obs.Observer
		ev := a.events
		o.Reclaimed = ev.ChunksReclaimed
		o.ChunkHealth = func(id string, healthy bool, reason string) {
			if healthy {
				ev.ChunkRecovered(id)
			} else {
				ev.ChunkUnhealthy(id, reason)
			}
		}
		pl, err := plugin.New(o)
		if err != nil {
			return err
		}
		if claims := pl.Claims(); !m.dra && len(claims) > 0 {
			// Left from mode dra: kubelet can only unprepare them through
			// the DRA driver (docs/dra.md, moving between the doors).
			a.log.Warn("the checkpoint holds allocations of ResourceClaims the DRA driver prepared; their chunks stay withheld from the device plugin until mode dra runs again and kubelet unprepares them",
				"allocations", len(claims))
		}
		a.plug = &pluginRun{Plugin: pl, Feed: feed, log: a.log, done: make(chan struct{})}
		a.obs.Metrics.InitPlugin()
		return nil
	}
}

// closePlugin is the step "plugin"'s stop: the plugin's PodResources
// client closes (the steps that run it have stopped).
func (a *agent) closePlugin() error {
	if a.plug == nil {
		return nil
	}
	return a.plug.Plugin.Close()
}

// pluginOptions is the device plugin's part of the configuration:
// resourceName, kubeletDir, socketDir, stateDir, reclaim.gracePeriod,
// reclaim.interval, tokenBinding ("pod": BindPods), podLogsDir and
// gpuResources.
func pluginOptions(cfg *config.Config) plugin.Options {
	return plugin.Options{
		ResourceName: cfg.ResourceName,
		KubeletDir:   cfg.KubeletDir,
		SocketDir:    cfg.SocketDir,
		StateDir:     cfg.StateDir,
		GracePeriod:  cfg.Reclaim.GracePeriod.Duration,
		Interval:     cfg.Reclaim.Interval.Duration,
		BindPods:     cfg.TokenBinding == config.TokenBindingPod,
		PodLogsDir:   cfg.PodLogsDir,
		GPUResources: cfg.GPUResources,
	}
}

// UnhealthyChunks counts, per GPU, the chunks kubelet is told are
// unhealthy (the KVPoolNode's Degraded health); nil without a plugin.
func (r *pluginRun) UnhealthyChunks() map[int]int {
	if r == nil {
		return nil
	}
	return r.Plugin.UnhealthyByGPU()
}

// register is the step "register": the plugin registers with kubelet and
// serves until the agent's context ends; unregister waits for it to have
// withdrawn its devices and removed its socket.
func (a *agent) register(ctx context.Context) error {
	a.plug.run(ctx, a.plug.Plugin.Run)
	a.log.Info("device plugin started", "resource", a.cfg.ResourceName, "kubeletDir", a.cfg.KubeletDir, "socketDir", a.cfg.SocketDir)
	return nil
}

// run runs loop (the plugin's Run, or Maintain without the device plugin
// door) until ctx ends; Wait waits for it.
func (r *pluginRun) run(ctx context.Context, loop func(context.Context) error) {
	r.started = true
	go func() {
		defer close(r.done)
		if err := loop(ctx); err != nil {
			r.log.Error("device plugin stopped", "err", err)
		}
	}()
}

func (a *agent) unregister() error {
	a.plug.Wait()
	return nil
}
