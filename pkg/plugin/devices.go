package plugin

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvpool/kvpool/pkg/pool"
)

// Device is one advertised device: a ready chunk of the pool.
type Device struct {
	ID      string // the chunk ID, gpu<G>-numa<N>-<index>
	NUMA    int    // NUMA node of the chunk's memory, -1 when unknown
	Healthy bool
}

// Source produces full device snapshots. The plugin never asks what changed;
// it diffs the snapshots itself.
type Source interface {
	// Devices returns the current snapshot and a channel that is closed at
	// the next change. The caller must not modify the returned slice.
	Devices() ([]Device, <-chan struct{})
}

// Feed is a Source the agent fills: Set publishes a full snapshot, SetHealth
// flips one device. Setting a snapshot equal to the current one wakes no one.
type Feed struct {
	mu      sync.Mutex
	devs    []Device
	changed chan struct{}
}

// NewFeed returns a Feed with an empty snapshot.
func NewFeed() *Feed { return &Feed{changed: make(chan struct{})} }

// Devices implements Source.
func (f *Feed) Devices() ([]Device, <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.devs, f.changed
}

// Set replaces the snapshot. Devices are kept in the order given; IDs must
// be unique.
func (f *Feed) Set(devs []Device) error {
	seen := make(map[string]bool, len(devs))
	for _, d := range devs {
		if d.ID == "" {
			return errors.New("feed: device with empty ID")
		}
		if seen[d.ID] {
			return fmt.Errorf("feed: device %s listed twice", d.ID)
		}
		seen[d.ID] = true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if slices.Equal(f.devs, devs) {
		return nil
	}
	f.devs = slices.Clone(devs)
	f.notifyLocked()
	return nil
}

// SetHealth marks one device healthy or unhealthy.
func (f *Feed) SetHealth(id string, healthy bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := slices.IndexFunc(f.devs, func(d Device) bool { return d.ID == id })
	if i < 0 {
		return fmt.Errorf("feed: set health of %s: unknown device", id)
	}
	if f.devs[i].Healthy == healthy {
		return nil
	}
	devs := slices.Clone(f.devs) // readers may hold the old slice
	devs[i].Healthy = healthy
	f.devs = devs
	f.notifyLocked()
	return nil
}

func (f *Feed) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

// PoolDevices turns the pool's chunk listing into a snapshot in which every
// chunk is healthy; the pool only holds chunks that are ready.
func PoolDevices(chunks []pool.ChunkInfo) []Device {
	out := make([]Device, len(chunks))
	for i, c := range chunks {
		out[i] = Device{ID: c.ID, NUMA: c.NUMA, Healthy: true}
	}
	return out
}
