package main

import (
	"context"
	"flag"
	"log/slog"
	"time"

	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

// pluginConfig is the device plugin's part of the agent configuration.
// Until pkg/config is wired in these come from flags; the fields follow the
// AgentConfig file (resourceName, kubeletDir, socketDir, stateDir,
// reclaim.gracePeriod, reclaim.interval).
type pluginConfig struct {
	Enabled      bool // in-cluster mode always; standalone only when asked
	ResourceName string
	KubeletDir   string
	SocketDir    string
	StateDir     string
	GracePeriod  time.Duration
	Interval     time.Duration
}

// addFlags registers the device plugin's flags on fs.
func (c *pluginConfig) addFlags(fs *flag.FlagSet) {
	fs.BoolVar(&c.Enabled, "device-plugin", false, "register with kubelet as a device plugin (standalone mode registers only with this flag)")
	fs.StringVar(&c.ResourceName, "resource-name", plugin.DefaultResourceName, "extended resource name the chunks are advertised as")
	fs.StringVar(&c.KubeletDir, "kubelet-dir", plugin.DefaultKubeletDir, "kubelet root directory (device-plugins/ and pod-resources/ inside)")
	fs.StringVar(&c.SocketDir, "socket-dir", plugin.DefaultSocketDir, "host directory of the agent socket, mounted into pods")
	fs.StringVar(&c.StateDir, "state-dir", plugin.DefaultStateDir, "directory of the agent's checkpoints")
	fs.DurationVar(&c.GracePeriod, "reclaim-grace-period", plugin.DefaultGracePeriod, "how long an allocation no pod holds is kept before its chunks are reclaimed")
	fs.DurationVar(&c.Interval, "reclaim-interval", plugin.DefaultInterval, "how often allocations are reconciled against PodResources")
}

// pluginRun is a running device plugin.
type pluginRun struct {
	// Plugin's Authorize maps KVPOOL_TOKEN to the pool allocation; give it
	// to the copy server.
	Plugin *plugin.Plugin
	// Feed must get a new snapshot whenever chunks become ready or fail:
	// Feed.Set(plugin.PoolDevices(p.Chunks())), or Feed.SetHealth.
	Feed *plugin.Feed
	done chan struct{}
}

// Wait returns once the plugin has stopped (after ctx ended).
func (r *pluginRun) Wait() {
	if r != nil {
		<-r.done
	}
}

// startPlugin runs the kubelet device plugin over p until ctx ends, or
// returns nil when cfg does not enable it. zero clears a chunk's bytes before
// the chunk goes to another pod (hostmem.Chunk.Zero for real chunks).
func startPlugin(ctx context.Context, cfg pluginConfig, p *pool.Pool, zero func(id string) error) (*pluginRun, error) {
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
		Zero:         zero,
		GracePeriod:  cfg.GracePeriod,
		Interval:     cfg.Interval,
	})
	if err != nil {
		return nil, err
	}
	r := &pluginRun{Plugin: pl, Feed: feed, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		if err := pl.Run(ctx); err != nil {
			slog.Error("device plugin stopped", "err", err)
		}
	}()
	slog.Info("device plugin started", "resource", cfg.ResourceName, "kubeletDir", cfg.KubeletDir, "socketDir", cfg.SocketDir)
	return r, nil
}
