package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"time"

	"github.com/kvpool/kvpool/pkg/plugin"
	"github.com/kvpool/kvpool/pkg/pool"
)

// pluginConfig is the device plugin's part of the agent configuration.
// Until pkg/config lands these come from flags; the field names follow the
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

var pluginCfg pluginConfig

func init() {
	fs := flag.CommandLine
	fs.BoolVar(&pluginCfg.Enabled, "device-plugin", false, "register with kubelet as a device plugin (standalone mode registers only with this flag)")
	fs.StringVar(&pluginCfg.ResourceName, "resource-name", plugin.DefaultResourceName, "extended resource name the chunks are advertised as")
	fs.StringVar(&pluginCfg.KubeletDir, "kubelet-dir", plugin.DefaultKubeletDir, "kubelet root directory (device-plugins/ and pod-resources/ inside)")
	fs.StringVar(&pluginCfg.SocketDir, "socket-dir", plugin.DefaultSocketDir, "host directory of the agent socket, mounted into pods")
	fs.StringVar(&pluginCfg.StateDir, "state-dir", plugin.DefaultStateDir, "directory of the agent's checkpoints")
	fs.DurationVar(&pluginCfg.GracePeriod, "reclaim-grace-period", plugin.DefaultGracePeriod, "how long an allocation no pod holds is kept before its chunks are reclaimed")
	fs.DurationVar(&pluginCfg.Interval, "reclaim-interval", plugin.DefaultInterval, "how often allocations are reconciled against PodResources")
}

// startPlugin runs the kubelet device plugin over p when cfg enables it, and
// returns a function that waits for it to stop after ctx ends. zero clears a
// chunk's bytes before the chunk goes to another pod (hostmem.Chunk.Zero for
// real chunks). The feed it returns must get a new snapshot whenever chunks
// become ready or fail (feed.Set(plugin.PoolDevices(p.Chunks()))).
// A configuration the plugin refuses ends the agent.
func startPlugin(ctx context.Context, cfg pluginConfig, p *pool.Pool, zero func(id string) error) (feed *plugin.Feed, wait func()) {
	if !cfg.Enabled {
		return nil, func() {}
	}
	feed = plugin.NewFeed()
	if err := feed.Set(plugin.PoolDevices(p.Chunks())); err != nil {
		slog.Error("device plugin", "err", err)
		os.Exit(1)
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
		slog.Error("device plugin", "err", err)
		os.Exit(2)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := pl.Run(ctx); err != nil {
			slog.Error("device plugin stopped", "err", err)
		}
	}()
	slog.Info("device plugin started", "resource", cfg.ResourceName, "kubeletDir", cfg.KubeletDir, "socketDir", cfg.SocketDir)
	return feed, func() { <-done }
}
