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
	"github.com/kvpool/kvpool/pkg/logging"
	"github.com/kvpool/kvpool/pkg/pool"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "status" { // hook: agent status (cmd/agent/status.go)
		exitOn(runStatus(context.Background(), os.Args[2:]))
	}
	standalone := flag.Bool("standalone", false, "run without kubelet on simulated GPUs and an in-memory pool")
	metricsAddr := flag.String("metrics-address", ":9464", "serve GET /metrics here")
	healthAddr := flag.String("health-address", ":8081", "serve GET /livez, /readyz and /status here")
	logLevel := flag.String("log-level", "info", "debug, info, warn or error")
	logFormat := flag.String("log-format", "text", "text or json")
	flag.Parse()
	if _, _, err := logging.Setup(logging.Options{Level: *logLevel, Format: *logFormat}); err != nil {
		exitOn(err)
	}
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
	targets := map[int]int64{}
	for _, c := range p.Chunks() {
		targets[c.GPU] += c.Size
	}
	obs := newObservability(p, obsOptions{Mode: "standalone", Node: hostname(), Targets: func() map[int]int64 { return targets }})
	for g := range targets {
		obs.Metrics.InitGPU(g)
	}
	if err := obs.start(ctx, *metricsAddr, *healthAddr); err != nil {
		exitOn(err)
	}
	slog.Info("kvpool agent running", "mode", "standalone", "backend", sim.Name(), "gpus", n, "chunks", len(p.Chunks()))
	<-ctx.Done()
	slog.Info("kvpool agent stopped")
}

func exitOn(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
