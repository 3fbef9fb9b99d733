// Command kvclient checks a kvpool agent end to end from a client's side:
// on a simulated GPU it offloads random bytes, poisons the device pages,
// reloads onto other pages and compares byte for byte; it checks labels,
// num_pages, discard, remove_request and that an offload into a full pool
// returns false and changes nothing; then it runs a mixed random workload.
// It exits 1 on any mismatch or error.
//
// It reads KVPOOL_SOCKET and KVPOOL_TOKEN like any kvpool client; flags
// override them. It needs no cgo (CGO_ENABLED=0 builds it), so it drops into
// any container image.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvpool/kvpool/internal/workload"
	"github.com/kvpool/kvpool/pkg/contract"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvclient:", err)
		os.Exit(1)
	}
}

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		var n int
		if _, err := fmt.Sscan(v, &n); err == nil {
			return n
		}
	}
	return def
}

func run(args []string) error {
	fs := flag.NewFlagSet("kvclient", flag.ContinueOnError)
	var cfg workload.Config
	fs.StringVar(&cfg.Socket, "socket", os.Getenv(contract.EnvSocket), "agent socket (default $KVPOOL_SOCKET, then "+contract.ContainerSocket+")")
	fs.StringVar(&cfg.Token, "token", os.Getenv(contract.EnvToken), "allocation token (default $KVPOOL_TOKEN)")
	fs.IntVar(&cfg.GPU, "gpu", envInt("KVCLIENT_GPU", -1), "simulated GPU of the session, named like the agent's simulated GPU of that index; -1: the first one the allocation has chunks of ($KVCLIENT_GPU)")
	fs.IntVar(&cfg.DevicePages, "device-pages", 256, "pages of the simulated device KV cache")
	page := fs.Int("page-bytes", 16<<10, "bytes per page in each of the K and V regions")
	fs.IntVar(&cfg.MaxPages, "max-pages", envInt("KVCLIENT_MAX_PAGES", 128), "host pages to ask the agent for; -1: every chunk of the GPU in the allocation ($KVCLIENT_MAX_PAGES)")
	fs.IntVar(&cfg.MaxStream, "max-stream", 16, "most pages in one stream")
	fs.IntVar(&cfg.Ops, "ops", envInt("KVCLIENT_OPS", 2000), "mixed operations after the checks ($KVCLIENT_OPS)")
	fs.DurationVar(&cfg.Duration, "duration", 0, "run the mixed workload for this long instead of -ops")
	seed := fs.Uint64("seed", 0, "random seed (default: time)")
	verbose := fs.Bool("v", false, "debug logging")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.PageBytes = uint64(*page)
	cfg.Seed = *seed
	if cfg.Duration > 0 {
		cfg.Ops = 0
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cfg.Logger = log
	cfg.Progress = func(n int) { fmt.Fprintf(os.Stderr, "kvclient: progress %d mixed ops\n", n) }
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	res, err := workload.Run(ctx, cfg)
	if res != nil {
		log.Info("kvclient result", "pid", os.Getpid(), "gpu", res.GPU, "capacity", res.Capacity, "elapsed", time.Since(start).Round(time.Millisecond), "summary", res.Summary())
	}
	if err != nil {
		return err
	}
	fmt.Printf("kvclient: OK (%d checks, %d full rejects, 0 mismatches)\n", res.Checks, res.FullRejects)
	return nil
}
