package gpu

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// ErrUnknownDevice is a GPU name that is none of the node's GPUs or MIG
// instances.
var ErrUnknownDevice = errors.New("not a GPU of this node")

// Target is what a GPU name resolves to: a physical GPU and, for a MIG
// instance, the instance.
type Target struct {
	GPU Device
	MIG *MIG // nil for a whole GPU
}

// Key names the CUDA device a target is: the MIG instance's UUID, else the
// GPU's. Replicas of one device (time-slicing, MPS) share their key.
func (t Target) Key() string {
	if t.MIG != nil {
		return t.MIG.UUID
	}
	return t.GPU.UUID
}

// Resolver maps the names a GPU goes by to the node's GPUs: the UUIDs a
// client's CUDA driver and NVML give it and its MIG instances, and the
// device IDs the NVIDIA device plugin advertises (and kubelet's
// PodResources lists) under deviceIDStrategy uuid (the default) or index,
// replicated or not.
type Resolver struct {
	devs  []Device
	byKey map[string]Target // uuidKey -> target
	byIdx map[int]Target
}

// NewResolver indexes devs.
func NewResolver(devs []Device) *Resolver {
	r := &Resolver{devs: devs, byKey: map[string]Target{}, byIdx: map[int]Target{}}
	for i := range devs {
		d := devs[i]
		if k, ok := uuidKey(d.UUID); ok {
			r.byKey[k] = Target{GPU: d}
		}
		r.byIdx[d.Index] = Target{GPU: d}
		for j := range d.MIG {
			if k, ok := uuidKey(d.MIG[j].UUID); ok {
				r.byKey[k] = Target{GPU: d, MIG: &d.MIG[j]}
			}
		}
	}
	return r
}

// uuidKey is a UUID without its "GPU-" or "MIG-" prefix, in lower case:
// the CUDA driver names a MIG instance's UUID bytes "GPU-...", NVML names
// them "MIG-...". A drivers-before-R470 MIG name, "MIG-GPU-<uuid>/<gi>/<ci>",
// keeps its "gpu-" after the cut, so it never matches a whole GPU. A name
// with neither prefix, or nothing after it, is no UUID (ok false).
func uuidKey(u string) (key string, ok bool) {
	l := strings.ToLower(u)
	if rest, ok := strings.CutPrefix(l, "gpu-"); ok && rest != "" {
		return rest, true
	}
	if rest, ok := strings.CutPrefix(l, "mig-"); ok && rest != "" {
		return rest, true
	}
	return "", false
}

// Resolve maps a GPU name to its target:
//
//   - a GPU's UUID, "GPU-..." (any case);
//   - a MIG instance's UUID, "MIG-...", or its bytes as the CUDA driver
//     formats them, "GPU-...", or a pre-R470 "MIG-GPU-<uuid>/<gi>/<ci>";
//   - any of those with the NVIDIA device plugin's replica suffix
//     "::<n>" (time-slicing and MPS sharing: the replica is the device it
//     replicates);
//   - a GPU's NVML index, "3", or a MIG device's "3:1" (the NVIDIA device
//     plugin's deviceIDStrategy=index): the GPU of that index.
//
// Anything else is an error wrapping ErrUnknownDevice that names the
// node's GPUs.
func (r *Resolver) Resolve(name string) (Target, error) {
	id := name
	if base, rep, ok := strings.Cut(name, "::"); ok {
		if _, err := strconv.ParseUint(rep, 10, 31); err != nil || base == "" {
			return Target{}, r.unknown(name, " (a replica is <device>::<number>)")
		}
		id = base
	}
	if k, ok := uuidKey(id); ok {
		if t, ok := r.byKey[k]; ok {
			return t, nil
		}
	}
	if gpu, mig, ok := strings.Cut(id, ":"); isIndex(gpu) && (!ok || isIndex(mig)) {
		i, _ := strconv.Atoi(gpu)
		if t, ok := r.byIdx[i]; ok {
			return t, nil
		}
	}
	return Target{}, r.unknown(name, "")
}

func (r *Resolver) unknown(name, why string) error {
	return fmt.Errorf("%w: %q is none of its %d GPUs (%s) or their MIG instances%s", ErrUnknownDevice, name, len(r.devs), r.list(), why)
}

func isIndex(s string) bool {
	if s == "" || len(s) > 4 || (len(s) > 1 && s[0] == '0') {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

func (r *Resolver) list() string {
	var names []string
	for _, d := range r.devs {
		names = append(names, d.UUID)
		if len(names) == 8 && len(r.devs) > 8 {
			names = append(names, "...")
			break
		}
	}
	return strings.Join(names, ", ")
}

// Names maps every UUID a client may name a device by, in an Open, to its
// GPU's index: each GPU's UUID, and each MIG instance's as NVML and as the
// CUDA driver write it.
func (r *Resolver) Names() map[string]int {
	out := map[string]int{}
	for _, d := range r.devs {
		out[d.UUID] = d.Index
		for _, m := range d.MIG {
			out[m.UUID] = d.Index
			if k, ok := uuidKey(m.UUID); ok && !strings.HasPrefix(k, "gpu-") {
				out["GPU-"+k] = d.Index
				out["MIG-"+k] = d.Index
			}
		}
	}
	return out
}

// Ranks turns the GPU device IDs of one container (what PodResources lists
// for it) into its ranks: one per CUDA device, replicas of one device
// counted once. gpus holds each rank's GPU index, sorted; it is nil when
// some ID is not this node's (a count alone is then known).
func (r *Resolver) Ranks(ids []string) (count int, gpus []int, err error) {
	seen := map[string]bool{}
	var errs []error
	for _, id := range ids {
		t, e := r.Resolve(id)
		if e != nil {
			errs = append(errs, e)
			base, _, _ := strings.Cut(id, "::")
			if !seen["?"+base] {
				seen["?"+base] = true
				count++
			}
			continue
		}
		if seen[t.Key()] {
			continue
		}
		seen[t.Key()] = true
		count++
		gpus = append(gpus, t.GPU.Index)
	}
	if len(errs) > 0 {
		return count, nil, errors.Join(errs...)
	}
	sort.Ints(gpus)
	return count, gpus, nil
}
