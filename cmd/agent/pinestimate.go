package main

import (
	"fmt"
	"io"
	"os"
	"slices"
	"text/tabwriter"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/hostmem"
	"github.com/kvpool/kvpool/internal/node"
	"github.com/kvpool/kvpool/internal/sizing"
)

// pinEstimate is how long the planned pool takes to pin at start, from a
// rate per NUMA node: measured by pinning a probe chunk there (and a
// memset of fresh memory beside it, the floor), or given (--pin-rate).
// The agent pins each node's chunks in turn, the nodes side by side, the
// GPUs of a node taking turns chunk by chunk (sizing.Plan.Specs).
type pinEstimate struct {
	Source     string         `json:"source"`               // "probe" or "--pin-rate"
	ProbeBytes int64          `json:"probeBytes,omitempty"` // per node, for "probe"
	Nodes      []nodeEstimate `json:"nodes"`
	// FirstChunkSeconds: until the pool's first chunk is ready (the agent
	// serves from then on); EveryGPUSeconds: until every GPU has one;
	// ReadySeconds: until the whole pool is pinned (the slowest node).
	FirstChunkSeconds float64 `json:"firstChunkSeconds"`
	EveryGPUSeconds   float64 `json:"everyGPUSeconds"`
	ReadySeconds      float64 `json:"readySeconds"`
	// Note says what the figures assume (ordinary pages for a huge page
	// plan, an unlocked probe).
	Note string `json:"note,omitempty"`
}

type nodeEstimate struct {
	NUMA    int   `json:"numa"` // -1: GPUs whose node is unknown (unbound chunks)
	Workers int   `json:"workers"`
	GPUs    int   `json:"gpus"`
	Bytes   int64 `json:"bytes"` // planned on this node
	// PinBytesPerSecond is the rate the estimate uses; the memset floor
	// and the ratio come with a probe.
	PinBytesPerSecond    float64 `json:"pinBytesPerSecond"`
	MemsetBytesPerSecond float64 `json:"memsetBytesPerSecond,omitempty"`
	Ratio                float64 `json:"ratio,omitempty"`
	ReadySeconds         float64 `json:"readySeconds"`
}

// planNodes groups the plan's GPUs by NUMA node, in the order they first
// appear: the agent's lanes.
func planNodes(p *sizing.Plan) []nodeEstimate {
	var nodes []nodeEstimate
	for _, g := range p.GPUs {
		numa := max(g.NUMA, -1)
		i := slices.IndexFunc(nodes, func(n nodeEstimate) bool { return n.NUMA == numa })
		if i < 0 {
			nodes = append(nodes, nodeEstimate{NUMA: numa})
			i = len(nodes) - 1
		}
		nodes[i].GPUs++
		nodes[i].Bytes += g.Bytes
	}
	return nodes
}

// estimatePin fills in the times from each node's PinBytesPerSecond.
func estimatePin(e *pinEstimate, p *sizing.Plan) {
	e.FirstChunkSeconds, e.EveryGPUSeconds, e.ReadySeconds = -1, 0, 0
	for i := range e.Nodes {
		n := &e.Nodes[i]
		if n.PinBytesPerSecond <= 0 {
			continue
		}
		n.ReadySeconds = float64(n.Bytes) / n.PinBytesPerSecond
		first := float64(p.ChunkBytes) / n.PinBytesPerSecond
		if e.FirstChunkSeconds < 0 || first < e.FirstChunkSeconds {
			e.FirstChunkSeconds = first
		}
		e.EveryGPUSeconds = max(e.EveryGPUSeconds, float64(n.GPUs)*first)
		e.ReadySeconds = max(e.ReadySeconds, n.ReadySeconds)
	}
	e.FirstChunkSeconds = max(e.FirstChunkSeconds, 0)
}

// probeRuns is how many times probePin measures each node (the rates are
// those of the sums: one run of a small probe is at the mercy of whatever
// else the node does in that moment).
const probeRuns = 3

// probePin measures the pin rate on each of the plan's NUMA nodes with a
// probe chunk of probe bytes (probeRuns times), pinned as the agent pins (bound to the node,
// its workers on the node's CPUs, locked where the memory lock limit
// allows). It allocates probe bytes at a time and frees them.
func probePin(p *sizing.Plan, info *node.Info, probe int64) (*pinEstimate, error) {
	page := int64(os.Getpagesize())
	probe = max(probe/page*page, page)
	e := &pinEstimate{Source: "probe", ProbeBytes: probe, Nodes: planNodes(p)}
	workers := sizing.NodeWorkers(info)
	unlocked := false
	for i := range e.Nodes {
		n := &e.Nodes[i]
		w, cpus := workers(n.NUMA)
		n.Workers = w
		var sum hostmem.PinRate
		for range probeRuns {
			r, err := hostmem.MeasurePin(hostmem.Options{Size: probe, Name: "kvpool-pin-probe", Bind: n.NUMA >= 0, Node: max(n.NUMA, 0),
				Workers: w, CPUs: cpus, Lock: true, LockFallback: true})
			if err != nil {
				return nil, fmt.Errorf("pin probe on NUMA node %d: %w", n.NUMA, err)
			}
			unlocked = unlocked || !r.Locked
			sum.Bytes, sum.Pin, sum.Memset = sum.Bytes+r.Bytes, sum.Pin+r.Pin, sum.Memset+r.Memset
		}
		n.PinBytesPerSecond, n.MemsetBytesPerSecond, n.Ratio = sum.PinBytesPerSecond(), sum.MemsetBytesPerSecond(), sum.Ratio()
	}
	estimatePin(e, p)
	e.Note = pinNote(p, unlocked)
	return e, nil
}

// givenPin is the estimate at a given rate per node (--pin-rate).
func givenPin(p *sizing.Plan, info *node.Info, rate int64) *pinEstimate {
	e := &pinEstimate{Source: "--pin-rate", Nodes: planNodes(p)}
	workers := sizing.NodeWorkers(info)
	for i := range e.Nodes {
		e.Nodes[i].Workers, _ = workers(e.Nodes[i].NUMA)
		e.Nodes[i].PinBytesPerSecond = float64(rate)
	}
	estimatePin(e, p)
	e.Note = pinNote(p, false)
	return e
}

func pinNote(p *sizing.Plan, unlocked bool) string {
	var note string
	for _, g := range p.GPUs {
		if g.PageSize > int64(os.Getpagesize()) {
			note = "the rate is that of ordinary pages; the plan's huge pages pin faster"
			break
		}
	}
	if unlocked {
		if note != "" {
			note += "; "
		}
		note += "the probe could not lock its memory (memory lock limit): locking adds a little"
	}
	return note
}

func printPinEstimate(out io.Writer, e *pinEstimate, reason string) {
	if e == nil {
		if reason != "" {
			fmt.Fprintf(out, "\npinning estimate: none (%s)\n", reason)
		}
		return
	}
	b := bytesize.Approx
	src := "a rate given by --pin-rate"
	if e.Source == "probe" {
		src = fmt.Sprintf("a %s probe pinned on each NUMA node, against a memset of fresh memory", b(e.ProbeBytes))
	}
	fmt.Fprintf(out, "\npinning estimate (%s):\n", src)
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NUMA\tGPUS\tWORKERS\tBYTES\tPIN RATE\tMEMSET\tRATIO\tREADY IN")
	for _, n := range e.Nodes {
		numa := fmt.Sprint(n.NUMA)
		if n.NUMA < 0 {
			numa = "unknown"
		}
		memset, ratio := "-", "-"
		if n.MemsetBytesPerSecond > 0 {
			memset, ratio = b(int64(n.MemsetBytesPerSecond))+"/s", fmt.Sprintf("%.2f", n.Ratio)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s/s\t%s\t%s\t%.1f s\n", numa, n.GPUs, n.Workers, b(n.Bytes), b(int64(n.PinBytesPerSecond)), memset, ratio, n.ReadySeconds)
	}
	tw.Flush()
	fmt.Fprintf(out, "first chunk in %.2f s, every GPU serving in %.2f s, pool ready in %.1f s (NUMA nodes side by side)\n",
		e.FirstChunkSeconds, e.EveryGPUSeconds, e.ReadySeconds)
	if e.Note != "" {
		fmt.Fprintln(out, "note:", e.Note)
	}
}
