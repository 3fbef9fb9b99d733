// Command kvclient checks a kvpool agent end to end from a client's side:
// on a simulated GPU it offloads random bytes, poisons the device pages,
// reloads onto other pages and compares byte for byte; it checks labels,
// num_pages, discard, remove_request and that an offload into a full pool
// returns false and changes nothing; then it runs a mixed random workload.
// It exits 1 on any mismatch or error.
//
// It reads KVPOOL_SOCKET and KVPOOL_TOKEN like any kvpool client; flags
// override them. It takes its GPU the way an engine in a pod does: the
// container's visible GPUs (NVIDIA_VISIBLE_DEVICES, narrowed by
// CUDA_VISIBLE_DEVICES, as the NVIDIA device plugin and CUDA set them),
// the -rank'th of them; -all-ranks runs one process per visible GPU, as a
// tensor-parallel engine does. It needs no cgo (CGO_ENABLED=0 builds it),
// so it drops into any container image.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvpool/kvpool/internal/workload"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/cudart"
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

// gpuFlags say which GPU the session serves.
type gpuFlags struct {
	uuid     string // a UUID given outright
	gpu      int    // the agent's simulated GPU of this index; -1: the GPU the container was given
	rank     int    // which of the visible GPUs
	allRanks bool   // one process per visible GPU
}

// device is the UUID of the GPU the session serves, as an engine would
// have it, or "" for the agent's simulated GPU g.gpu; said names where it
// came from, for the log.
func (g gpuFlags) device() (uuid, said string, err error) {
	switch {
	case g.uuid != "":
		return g.uuid, "-device", nil
	case g.gpu >= 0:
		return "", fmt.Sprintf("-gpu %d (the agent's simulated GPU %d)", g.gpu, g.gpu), nil
	}
	vis, err := cudart.VisibleFromEnv()
	if errors.Is(err, cudart.ErrNoVisibleList) {
		// A pod without GPUs: the agent's first simulated GPU stands in.
		return cudart.SimulatedUUID(0), "no GPU given (" + cudart.EnvNVIDIAVisible + " unset): the agent's simulated GPU 0", nil
	}
	if err != nil {
		return "", "", err
	}
	if g.rank < 0 || g.rank >= len(vis) {
		return "", "", fmt.Errorf("rank %d, but the container sees %d GPUs (%s=%q, %s=%q)", g.rank, len(vis),
			cudart.EnvNVIDIAVisible, os.Getenv(cudart.EnvNVIDIAVisible), cudart.EnvCUDAVisible, os.Getenv(cudart.EnvCUDAVisible))
	}
	return vis[g.rank], fmt.Sprintf("visible GPU %d of %d", g.rank, len(vis)), nil
}

func run(args []string) error {
	fs := flag.NewFlagSet("kvclient", flag.ContinueOnError)
	var cfg workload.Config
	var g gpuFlags
	fs.StringVar(&cfg.Socket, "socket", os.Getenv(contract.EnvSocket), "agent socket (default $KVPOOL_SOCKET, then "+contract.ContainerSocket+")")
	fs.StringVar(&cfg.Token, "token", os.Getenv(contract.EnvToken), "allocation token (default $KVPOOL_TOKEN)")
	fs.StringVar(&g.uuid, "device", "", "UUID of the session's GPU (default: the GPU the container was given)")
	fs.IntVar(&g.gpu, "gpu", envInt("KVCLIENT_GPU", -1), "pick the agent's simulated GPU of this index instead of the GPU the container was given ($KVCLIENT_GPU; -1: given)")
	fs.IntVar(&g.rank, "rank", envInt("KVCLIENT_RANK", 0), "which of the container's visible GPUs ("+cudart.EnvNVIDIAVisible+", then "+cudart.EnvCUDAVisible+") this process serves ($KVCLIENT_RANK)")
	fs.BoolVar(&g.allRanks, "all-ranks", false, "run one kvclient process per visible GPU, each on its own, all at once (a tensor-parallel engine)")
	fs.IntVar(&cfg.Ranks, "ranks", envInt("KVCLIENT_RANKS", 0), "ranks that share the allocation, declared to the agent ($KVCLIENT_RANKS; 0: the agent counts the container's GPUs)")
	fs.IntVar(&cfg.DevicePages, "device-pages", 256, "pages of the simulated device KV cache")
	page := fs.Int("page-bytes", 16<<10, "bytes per page in each of the K and V regions")
	fs.IntVar(&cfg.MaxPages, "max-pages", envInt("KVCLIENT_MAX_PAGES", 128), "host pages to ask the agent for; -1: the session's fair share of the allocation ($KVCLIENT_MAX_PAGES)")
	fs.IntVar(&cfg.MaxStream, "max-stream", 16, "most pages in one stream")
	fs.IntVar(&cfg.Ops, "ops", envInt("KVCLIENT_OPS", 2000), "mixed operations after the checks ($KVCLIENT_OPS)")
	fs.DurationVar(&cfg.Duration, "duration", 0, "run the mixed workload for this long instead of -ops")
	seed := fs.Uint64("seed", 0, "random seed (default: time)")
	verbose := fs.Bool("v", false, "debug logging")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if g.allRanks {
		return allRanks(args)
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
	uuid, said, err := g.device()
	if err != nil {
		return err
	}
	cfg.Device, cfg.GPU = uuid, max(g.gpu, 0)
	log.Info("kvclient GPU", "device", cmpOr(uuid, cudart.SimulatedUUID(cfg.GPU)), "from", said)
	cfg.Progress = func(n int) { fmt.Fprintf(os.Stderr, "kvclient: progress %d mixed ops\n", n) }
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	res, err := workload.Run(ctx, cfg)
	if res != nil {
		l := res.Locality
		var ids []string
		for _, c := range l.Chunks {
			ids = append(ids, c.ID)
		}
		log.Info("kvclient chunks", "device", res.Device, "ids", strings.Join(ids, ","))
		log.Info("kvclient result", "pid", os.Getpid(), "device", res.Device, "rank", g.rank, "capacity", res.Capacity,
			"chunks", len(l.Chunks), "gpuNUMA", l.GPUNUMA, "local", l.Local, "remote", l.Remote, "ranks", l.Ranks,
			"elapsed", time.Since(start).Round(time.Millisecond), "summary", res.Summary())
	}
	if err != nil {
		return err
	}
	fmt.Printf("kvclient: OK (%d checks, %d full rejects, 0 mismatches)\n", res.Checks, res.FullRejects)
	return nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// allRanks runs this program once per visible GPU, each with -rank i and
// the other arguments, at once, and fails unless every one succeeds. Each
// is its own process, with its own instance ID, as an engine's ranks are.
func allRanks(args []string) error {
	vis, err := cudart.VisibleFromEnv()
	if err != nil {
		return fmt.Errorf("-all-ranks: %w", err)
	}
	if len(vis) == 0 {
		return fmt.Errorf("-all-ranks: the container sees no GPU (%s=%q)", cudart.EnvNVIDIAVisible, os.Getenv(cudart.EnvNVIDIAVisible))
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	var rest []string
	for _, a := range args {
		if a != "-all-ranks" && a != "--all-ranks" && !strings.HasPrefix(strings.TrimLeft(a, "-"), "all-ranks=") {
			rest = append(rest, a)
		}
	}
	errs := make([]error, len(vis))
	var wg sync.WaitGroup
	for r := range vis {
		cmd := exec.Command(self, append(rest, "-rank", strconv.Itoa(r))...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		wg.Go(func() {
			if err := cmd.Run(); err != nil {
				errs[r] = fmt.Errorf("rank %d (%s): %w", r, vis[r], err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	fmt.Printf("kvclient: all %d ranks OK\n", len(vis))
	return nil
}
