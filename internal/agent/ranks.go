package agent

import (
	"context"
	"time"

	"github.com/kvpool/kvpool/internal/server"
)

// ranks is the copy server's Options.Ranks: how many ranks (GPUs) of one
// container share an allocation, and on which host GPUs they run.
//
//   - A standalone token's allocation: not known (0), so the pool shares it
//     one rank per GPU its chunks were sized under, the split the token was
//     made with.
//   - An allocation of the device plugin: kubelet's PodResources lists the
//     GPU devices (gpuResources) of the container holding it; each CUDA
//     device is a rank (a MIG instance is one; replicas of a shared GPU are
//     one device), on the GPU the Resolver maps it to. A container without
//     GPU devices runs one rank. When kubelet cannot say (no listing yet, a
//     failed call) the count is not known.
//
// A client that declares its ranks in its Open wins over the count.
func (a *agent) ranks(ctx context.Context) func(alloc string) server.Ranks {
	return func(alloc string) server.Ranks {
		if a.plug == nil || a.isStatic(alloc) {
			return server.Ranks{}
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		ids, known, err := a.plug.Plugin.ContainerGPUs(cctx, alloc)
		switch {
		case err != nil:
			a.log.Warn("cannot tell the GPUs of the container holding the allocation; its sessions share it by the GPUs its chunks were sized for", "allocation", alloc, "err", err)
			return server.Ranks{}
		case !known:
			return server.Ranks{}
		case len(ids) == 0:
			return server.Ranks{Count: 1}
		}
		count, gpus, err := a.gpuNames.Ranks(ids)
		if err != nil {
			a.log.Warn("the container holding the allocation has GPU devices of no GPU the agent knows; sharing among their count", "allocation", alloc, "devices", ids, "err", err)
		}
		a.log.Debug("allocation's ranks", "allocation", alloc, "devices", ids, "ranks", count, "gpus", gpus)
		return server.Ranks{Count: count, GPUs: gpus}
	}
}

// isStatic reports whether alloc is a standalone token's allocation.
func (a *agent) isStatic(alloc string) bool {
	for _, s := range a.static {
		if s == alloc {
			return true
		}
	}
	return false
}
