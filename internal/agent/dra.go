package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/dra"
	"github.com/kvpool/kvpool/internal/report"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// startDRA is the step "dra" (mode dra): the device plugin's ledger runs
// its loops without registering (reclaims of device plugin allocations
// left from before the move, renewals), and the DRA driver registers with
// kubelet and publishes the node's ResourceSlices. stopDRA unregisters the
// driver and waits for the loops.
func (a *agent) startDRA(ctx context.Context) error {
	if a.kube == nil || a.kube.cs == nil {
		return errors.New("mode dra needs the API server (in a pod's service account, --kubeconfig or $KUBECONFIG): the DRA driver publishes ResourceSlices and reads ResourceClaims")
	}
	d, err := dra.New(dra.Options{
		DriverName: a.cfg.DRA.DriverName,
		NodeName:   a.kube.node,
		KubeClient: a.kube.cs,
		KubeletDir: a.cfg.KubeletDir,
		CDIDir:     a.cfg.DRA.CDIDir,
		SocketDir:  a.cfg.SocketDir,
		GPUs:       a.draGPUs(),
		Ledger:     a.plug.Plugin,
		Chunks:     draChunks{a},
		Observer:   a.obs.Observer,
		Logger:     a.log,
		Fatal: func(err error) {
			a.log.Error("fatal: shutting down", "err", err)
			a.cancel()
		},
	})
	if err != nil {
		return err
	}
	a.draDriver = d
	a.plug.run(ctx, a.plug.Plugin.Maintain)
	return d.Start(ctx)
}

func (a *agent) stopDRA() error {
	if a.draDriver != nil {
		a.draDriver.Stop()
	}
	a.plug.Wait()
	return nil
}

// draGPUs names the plan's GPUs for the slices: index, UUID and PCIe root
// (a simulated GPU's own; a real one's read from sysfs by its bus ID, left
// out with a warning when it cannot be).
func (a *agent) draGPUs() []dra.GPU {
	byIndex := map[int]int{}
	for i, d := range a.devs {
		byIndex[d.Index] = i
	}
	var out []dra.GPU
	for _, g := range a.plan.GPUs {
		gpu := dra.GPU{Index: g.GPU, UUID: g.UUID}
		if i, ok := byIndex[g.GPU]; ok {
			d := a.devs[i]
			gpu.PCIeRoot = d.PCIeRoot
			if gpu.PCIeRoot == "" && d.BusID != "" {
				root, err := dra.PCIeRoot(a.opts.Root, d.BusID)
				if err != nil {
					a.log.Warn("the GPU's PCIe root is unknown: its host KV carries no resource.kubernetes.io/pcieRoot", "gpu", g.GPU, "busID", d.BusID, "err", err)
				}
				gpu.PCIeRoot = root
			}
		}
		out = append(out, gpu)
	}
	return out
}

// draChunks is the DRA driver's view of the pool's ready chunks.
type draChunks struct{ a *agent }

func (s draChunks) Chunks() ([]dra.Chunk, <-chan struct{}) {
	// The feed changes as chunks join; renewals (a fresh memfd, maybe
	// another page size) change the ledger, which the driver also watches.
	_, changed := s.a.plug.Feed.Devices()
	page := int64(os.Getpagesize())
	var out []dra.Chunk
	for _, c := range s.a.pool.Chunks() {
		ch := dra.Chunk{ID: c.ID, GPU: c.GPU, NUMA: c.NUMA, Size: c.Size, PageSize: page}
		if hc, ok := s.a.chunk(c.ID); ok {
			ch.PageSize, ch.HugePages = hc.PageSize, hc.PageSize > page
		}
		out = append(out, ch)
	}
	return out, changed
}

// draDriverName is the DRA driver's name in mode dra, "" otherwise.
func (a *agent) draDriverName() string {
	if a.draDriver == nil {
		return ""
	}
	return a.cfg.DRA.DriverName
}

// claims lists the ResourceClaims the ledger holds chunks for (mode dra,
// or left from it), with their chunks' bytes and GPUs.
func (a *agent) claims() []report.Claim {
	if a.plug == nil {
		return nil
	}
	recs := a.plug.Plugin.Claims()
	if len(recs) == 0 {
		return nil
	}
	size, gpuOf := map[string]int64{}, map[string]int{}
	for _, c := range a.pool.Chunks() {
		size[c.ID], gpuOf[c.ID] = c.Size, c.GPU
	}
	var out []report.Claim
	for _, r := range recs {
		c := r.Claim
		if n := len(out); n == 0 || out[n-1].UID != c.UID {
			out = append(out, report.Claim{Namespace: c.Namespace, Name: c.Name, UID: c.UID, Pods: slices.Clone(c.PodUIDs)})
		}
		cl := &out[len(out)-1]
		req := report.ClaimRequest{Name: c.Request, Allocation: r.ID(), Chunks: slices.Clone(r.Devices)}
		for _, id := range r.Devices {
			req.Bytes += size[id]
			if g, ok := gpuOf[id]; ok && !slices.Contains(cl.GPUs, g) {
				cl.GPUs = append(cl.GPUs, g)
			}
		}
		slices.Sort(cl.GPUs)
		cl.Requests = append(cl.Requests, req)
		cl.Chunks += len(r.Devices)
		cl.Bytes += req.Bytes
	}
	return out
}

// checkDRAMode refuses mode dra where it cannot work: standalone has no
// API server or kubelet to serve.
func checkDRAMode(o Options) error {
	if o.Standalone && o.Config.Mode == config.ModeDRA {
		return fmt.Errorf("mode dra is for cluster mode: the DRA driver needs kubelet and the API server (use --device-plugin with --standalone)")
	}
	return nil
}

var _ dra.Ledger = (*plugin.Plugin)(nil)
