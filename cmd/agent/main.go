// Command agent is the kvpool node agent.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvpool/kvpool/pkg/cudart"
	"github.com/kvpool/kvpool/pkg/pool"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "plan" {
		exitOn(runPlan(context.Background(), os.Args[2:]))
	}
	standalone := flag.Bool("standalone", false, "run without kubelet on simulated GPUs and an in-memory pool")
	var pluginCfg pluginConfig
	pluginCfg.addFlags(flag.CommandLine)
	flag.Parse()
	if !*standalone {
		fmt.Fprintln(os.Stderr, "agent: only --standalone is implemented so far")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	sim := cudart.NewSim(cudart.SimOptions{Devices: 2})
	n, _ := sim.DeviceCount()
	p := pool.New()
	for g := 0; g < n; g++ {
		for i := 0; i < 4; i++ {
			if err := p.AddChunk(pool.Chunk{ID: fmt.Sprintf("gpu%d-numa0-%d", g, i), GPU: g, Size: 64 << 20}); err != nil {
				slog.Error("add chunk", "err", err)
				os.Exit(1)
			}
		}
	}
	plug, err := startPlugin(ctx, pluginCfg, p, func(string) error { return nil }) // simulated chunks hold no bytes
	if err != nil {
		slog.Error("device plugin", "err", err)
		os.Exit(2)
	}
	slog.Info("kvpool agent running", "mode", "standalone", "backend", sim.Name(), "gpus", n, "chunks", len(p.Chunks()))
	<-ctx.Done()
	plug.Wait()
	slog.Info("kvpool agent stopped")
}

// exitOn ends a subcommand: status 0, or 1 with the error on stderr.
func exitOn(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
	os.Exit(0)
}
