package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"text/tabwriter"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kvpool/kvpool/internal/agent"
	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/gpu"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/node/kubenode"
	"github.com/kvpool/kvpool/internal/sizing"
)

// runPlan is `agent plan`: discover the node and its GPUs, apply the sizing
// policy and print the plan, with an estimate of the time to pin it; it
// allocates nothing but the estimate's probe (freed at once).
func runPlan(ctx context.Context, args []string) error {
	return plan(ctx, args, os.Stdout, os.Getenv, nvml.New())
}

// planReport is what `agent plan --json` prints.
type planReport struct {
	Mode   string        `json:"mode"` // "node" or "standalone"
	GPUs   string        `json:"gpus"` // where the GPUs came from
	Node   nodeSummary   `json:"node"`
	Policy config.Sizing `json:"policy"`
	Plan   *sizing.Plan  `json:"plan"`
	// PinEstimate is how long the pool takes to pin at start; absent with
	// the reason in NoPinEstimate.
	PinEstimate   *pinEstimate `json:"pinEstimate,omitempty"`
	NoPinEstimate string       `json:"noPinEstimate,omitempty"`
}

type nodeSummary struct {
	MemTotal      int64 `json:"memTotal"`
	MemAvailable  int64 `json:"memAvailable"`
	CgroupVersion int   `json:"cgroupVersion"`
	CgroupLimit   int64 `json:"cgroupLimit"` // -1: none
	Allocatable   int64 `json:"allocatable"` // 0: not in a cluster
	NUMANodes     int   `json:"numaNodes"`
}

func plan(ctx context.Context, args []string, out io.Writer, getenv func(string) string, lib nvml.Interface) error {
	fs := flag.NewFlagSet("agent plan", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() { planUsage(fs, out) }
	asJSON := fs.Bool("json", false, "print the plan as JSON")
	standalone := fs.Bool("standalone", false, "plan standalone mode's pool (standalone.poolBytes) for simulated GPUs when NVML is absent")
	simulate := fs.Int("simulate-gpus", 0, "plan the configuration's sizing for this many simulated GPUs instead of NVML's (as serve --simulate-gpus)")
	root := fs.String("root", "/", "root of the /proc and /sys trees to read (for tests)")
	pinProbe, pinRate := config.Bytes(defaultPinProbe), config.Bytes(0)
	fs.Func("pin-probe", "bytes to pin on each NUMA node to measure the pinning rate for the estimate (0: no probe; only with --root /) (default 64Mi)", bytesFlag(&pinProbe))
	fs.Func("pin-rate", "pinning rate per NUMA node, bytes per second, for the estimate instead of a probe (e.g. kvpool_pool_pin_bytes_per_second of a node like this one)", bytesFlag(&pinRate))
	config.RegisterFlags(fs)
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return nil // usage printed
	} else if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *simulate < 0 || (*simulate > 0 && *standalone) {
		return errors.New("--simulate-gpus takes a positive count and does not go with --standalone (which plans for standalone.gpus)")
	}
	cfg, _, err := config.Load("", getenv, fs)
	if err != nil {
		return err
	}
	for _, w := range cfg.Warnings() {
		fmt.Fprintln(os.Stderr, "agent plan: warning:", w) // not on out, which may be JSON
	}
	info, err := node.Read(*root)
	if err != nil {
		return err
	}
	rep := planReport{Mode: "node", Node: nodeSummary{
		MemTotal: info.MemTotal, MemAvailable: info.MemAvailable,
		CgroupVersion: info.Cgroup.Version, CgroupLimit: info.Cgroup.Limit, NUMANodes: len(info.NUMANodes),
	}}
	devs, source, err := planGPUs(lib, *root, info, cfg.Standalone.GPUs, *simulate, *standalone)
	if err != nil {
		return err
	}
	rep.GPUs = source
	in := sizing.Input{Node: info}
	for _, d := range devs {
		in.GPUs = append(in.GPUs, sizing.GPU{Index: d.Index, UUID: d.UUID, NUMA: d.NUMA, Memory: d.Memory})
	}
	policy := cfg.Sizing
	if *standalone {
		rep.Mode = "standalone"
		policy = sizing.Standalone(cfg, len(devs))
	} else if alloc, err := allocatable(ctx, getenv); err != nil {
		slog.Warn("node allocatable memory unknown; planning without it", "err", err)
	} else {
		in.Allocatable = alloc
		rep.Node.Allocatable = alloc
	}
	rep.Policy = policy
	p, err := sizing.Make(policy, in)
	if err != nil {
		return err
	}
	rep.Plan = p
	planPin(&rep, p, info, int64(pinRate), int64(pinProbe), *root)
	if *asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	printPlan(out, rep)
	return nil
}

// planUsage prints plan's help.
func planUsage(fs *flag.FlagSet, out io.Writer) {
	fmt.Fprintln(out, "usage: agent plan [--json] [--standalone | --simulate-gpus N] [config flags]\n\n"+
		"Prints the pool the agent would allocate on this node, per GPU, and the input that bound it, and how long pinning it\n"+
		"would take at start. Allocates nothing but a short probe that measures the pinning rate (--pin-probe bytes per\n"+
		"NUMA node, pinned as the agent pins and freed at once; --pin-rate gives the rate instead, --pin-probe 0 skips it).\n"+
		"On a node without NVML, --simulate-gpus N plans what the configuration (--config) says for N simulated GPUs,\n"+
		"as `agent serve --simulate-gpus N` would run it; --standalone plans standalone mode's own small pool.")
	fs.PrintDefaults()
}

// planPin fills the plan's estimate of the time to a ready pool: from
// the rate given (pinRate), or from a probe of probe bytes per NUMA node
// on this node (root "/"), or says why there is none.
func planPin(rep *planReport, p *sizing.Plan, info *node.Info, pinRate, probe int64, root string) {
	var err error
	switch {
	case pinRate > 0:
		rep.PinEstimate = givenPin(p, info, pinRate)
	case probe == 0:
		rep.NoPinEstimate = "--pin-probe 0"
	case root != "/":
		rep.NoPinEstimate = "--root names another node's tree: give its rate with --pin-rate"
	default:
		if rep.PinEstimate, err = probePin(p, info, probe); err != nil {
			rep.NoPinEstimate = err.Error()
			fmt.Fprintln(os.Stderr, "agent plan: warning:", err)
		}
	}
}

// planGPUs finds the GPUs to plan for: simulate simulated ones (the
// configuration's sizing applies, as for `serve --simulate-gpus`), else
// NVML's; standalone falls back to standalone.gpus simulated GPUs where
// NVML is absent.
func planGPUs(lib nvml.Interface, root string, info *node.Info, standaloneGPUs, simulate int, standalone bool) ([]gpu.Device, string, error) {
	var numa []int
	for _, n := range info.NUMANodes {
		numa = append(numa, n.ID)
	}
	if simulate > 0 {
		return gpu.Simulated(simulate, agent.SimulatedGPUMemory, numa), fmt.Sprintf("simulated (--simulate-gpus %d)", simulate), nil
	}
	devs, err := gpu.Discover(lib, root)
	switch {
	case errors.Is(err, gpu.ErrNoNVML) && standalone:
		devs = gpu.Simulated(standaloneGPUs, agent.SimulatedGPUMemory, numa)
		return devs, fmt.Sprintf("simulated (%d; no NVML on this node)", len(devs)), nil
	case errors.Is(err, gpu.ErrNoNVML):
		return nil, "", fmt.Errorf("%w\n(use --simulate-gpus N to plan this configuration for N simulated GPUs, or --standalone for standalone mode's pool)", err)
	case err != nil:
		return nil, "", err
	}
	return devs, "NVML", nil
}

// inClusterConfig finds the API server from inside a pod; tests replace it.
var inClusterConfig = rest.InClusterConfig

// allocatable reads the Node's allocatable memory when running in a pod
// (in-cluster config and NODE_NAME); 0 and no error outside a cluster.
func allocatable(ctx context.Context, getenv func(string) string) (int64, error) {
	if getenv("KUBERNETES_SERVICE_HOST") == "" {
		return 0, nil
	}
	rc, err := inClusterConfig()
	if err != nil {
		return 0, err
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return 0, err
	}
	m, err := kubenode.Read(ctx, cs, getenv(kubenode.EnvNodeName))
	if err != nil {
		return 0, err
	}
	return m.Allocatable, nil
}

func printPlan(out io.Writer, r planReport) {
	b := bytesize.Approx
	p := r.Plan
	cg := "none"
	if r.Node.CgroupLimit >= 0 {
		cg = fmt.Sprintf("%s (cgroup v%d)", b(r.Node.CgroupLimit), r.Node.CgroupVersion)
	}
	fmt.Fprintf(out, "mode %s, GPUs from %s\n", r.Mode, r.GPUs)
	fmt.Fprintf(out, "node: MemTotal %s, MemAvailable %s, cgroup limit %s, NUMA nodes %d", b(r.Node.MemTotal), b(r.Node.MemAvailable), cg, r.Node.NUMANodes)
	if r.Node.Allocatable > 0 {
		fmt.Fprintf(out, ", allocatable %s", b(r.Node.Allocatable))
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, "\nlimits:")
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	for _, l := range p.Limits {
		mark := ""
		if l.Name == p.Bound {
			mark = "  <- binds"
		}
		fmt.Fprintf(tw, "  %s\t%s\t= %s%s\n", l.Name, l.How, b(l.Bytes), mark)
	}
	tw.Flush()
	fmt.Fprintf(out, "\npool: %s in %s chunks\n\n", b(p.Total), b(p.ChunkBytes))
	tw = tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tUUID\tNUMA\tBYTES\tCHUNKS\tPAGE\tBOUND BY")
	for _, g := range p.GPUs {
		numa := fmt.Sprint(g.NUMA)
		if g.NUMA < 0 {
			numa = "unknown"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", g.GPU, g.UUID, numa, b(g.Bytes), g.Chunks, b(g.PageSize), g.Bound)
	}
	tw.Flush()
	for _, w := range p.Warnings {
		fmt.Fprintln(out, "warning:", w)
	}
	printPinEstimate(out, r.PinEstimate, r.NoPinEstimate)
}

// defaultPinProbe is --pin-probe's default: large enough that the
// kernel's per-call costs do not show, small enough to take well under a
// second per NUMA node.
const defaultPinProbe = 64 << 20

// bytesFlag parses a flag's size ("64Mi", "2G", "1048576"; never
// negative) into b.
func bytesFlag(b *config.Bytes) func(string) error {
	return func(s string) error {
		v, err := config.ParseBytes(s)
		if err != nil {
			return err
		}
		*b = v
		return nil
	}
}
