package plugin

import (
	"context"
	"fmt"
	"strings"
)

// Ranks: how many GPUs share an allocation. Kubelet calls each device
// plugin on its own, so the agent never learns in Allocate which GPUs a
// container got; kubelet's PodResources lists them once the container
// runs (which it does by the time its client opens a session). The
// container that holds an allocation's chunks holds its GPUs too.

// ContainerLister says which other devices the container that holds a
// device has. The PodResourcesClient is one; a Holders that is not one
// leaves ContainerGPUs without an answer.
type ContainerLister interface {
	// Companions returns the device IDs of the resources named by want
	// (a trailing "*" matches by prefix) of the container that holds
	// device of resource have; found is false when no container holds it.
	Companions(ctx context.Context, have, device string, want []string) (ids []string, found bool, err error)
}

// MatchResource says whether resource is one of names (a trailing "*"
// matches by prefix).
func MatchResource(resource string, names []string) bool {
	for _, n := range names {
		if p, ok := strings.CutSuffix(n, "*"); ok && strings.HasPrefix(resource, p) || n == resource {
			return true
		}
	}
	return false
}

// ContainerGPUs returns the GPU device IDs (of Options.GPUResources, as the
// GPUs' device plugin names them: UUIDs, MIG UUIDs, replicas "<id>::<n>")
// of the container that holds allocation alloc (a pool allocation ID).
// known is false when kubelet lists no container holding it, or cannot be
// asked; a container without GPUs is known with no IDs. An answer is kept
// for the allocation's life: a container's devices never change.
func (p *Plugin) ContainerGPUs(ctx context.Context, alloc string) (ids []string, known bool, err error) {
	devs, gpus, cached, ok := p.l.gpusOf(alloc)
	switch {
	case !ok:
		return nil, false, fmt.Errorf("container GPUs of %s: unknown allocation", alloc)
	case cached:
		return gpus, true, nil
	}
	lister, ok := p.o.Holders.(ContainerLister)
	if !ok || len(devs) == 0 || len(p.o.GPUResources) == 0 {
		return nil, false, nil
	}
	ids, found, err := lister.Companions(ctx, p.o.ResourceName, devs[0], p.o.GPUResources)
	if err != nil || !found {
		return nil, false, err
	}
	p.l.setGPUs(alloc, ids)
	return ids, true, nil
}

// gpusOf returns an allocation's devices and, when known, its container's
// GPU device IDs.
func (l *ledger) gpusOf(id string) (devices, gpus []string, known, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.allocs {
		if a.ID() == id {
			return append([]string(nil), a.Devices...), append([]string(nil), a.gpus...), a.gpusKnown, true
		}
	}
	return nil, nil, false, false
}

func (l *ledger) setGPUs(id string, gpus []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range l.allocs {
		if a.ID() == id {
			a.gpus, a.gpusKnown = append([]string(nil), gpus...), true
		}
	}
}

// Companions implements ContainerLister over PodResources List.
func (c *PodResourcesClient) Companions(ctx context.Context, have, device string, want []string) ([]string, bool, error) {
	pods, err := c.list(ctx)
	if err != nil {
		return nil, false, err
	}
	for _, pod := range pods.GetPodResources() {
		for _, ctr := range pod.GetContainers() {
			holds := false
			var ids []string
			for _, d := range ctr.GetDevices() {
				switch {
				case d.GetResourceName() == have:
					for _, id := range d.GetDeviceIds() {
						holds = holds || id == device
					}
				case MatchResource(d.GetResourceName(), want):
					ids = append(ids, d.GetDeviceIds()...)
				}
			}
			if holds {
				return ids, true, nil
			}
		}
	}
	return nil, false, nil
}
