package cudart

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// In a pod, the GPUs a process sees are the container's: the NVIDIA
// device plugin's Allocate sets NVIDIA_VISIBLE_DEVICES to the UUIDs (or
// indices) of the devices kubelet gave the container, the NVIDIA container
// runtime exposes exactly those, and CUDA numbers them 0, 1, ... in that
// order; CUDA_VISIBLE_DEVICES, when set, narrows and reorders them again.
// A real engine's GPU is one of these, fixed before it talks to kvpool; the
// real backend learns its UUID from the driver. VisibleDevices does the
// same arithmetic for a process that has no driver to ask (the simulator
// playing a container, kvclient), so that it takes the GPU it was given.

// Environment variables that say which GPUs a container's process sees.
const (
	EnvNVIDIAVisible = "NVIDIA_VISIBLE_DEVICES"
	EnvCUDAVisible   = "CUDA_VISIBLE_DEVICES"
)

// ErrNoVisibleList means the environment names the visible GPUs by no list
// of their own: NVIDIA_VISIBLE_DEVICES is unset, empty or "all".
var ErrNoVisibleList = errors.New("cudart: the environment lists no visible GPUs")

// VisibleDevices returns the GPUs a container's process sees, in CUDA
// ordinal order, as NVIDIA_VISIBLE_DEVICES (nvidia) and then
// CUDA_VISIBLE_DEVICES (cuda) name them:
//
//   - nvidia is a comma-separated list of GPU or MIG UUIDs (or indices, as
//     the NVIDIA device plugin writes with deviceIDStrategy=index), given
//     back as written; "none" or "void" means no GPU (an empty list);
//     empty or "all" is ErrNoVisibleList (the list is the node's, which
//     only a driver can read); a device named twice is an error;
//   - cuda, when not empty, picks from that list as CUDA does: each entry
//     an ordinal into it or a prefix of a UUID in it ("GPU-5f3c", "MIG-"
//     UUIDs whole), in the order written; the first entry that matches
//     nothing ends the list (CUDA ignores it and everything after it); an
//     entry that names a device twice is an error (CUDA fails to start).
func VisibleDevices(nvidia, cuda string) ([]string, error) {
	nv := strings.TrimSpace(nvidia)
	switch strings.ToLower(nv) {
	case "", "all":
		return nil, fmt.Errorf("%w (%s=%q)", ErrNoVisibleList, EnvNVIDIAVisible, nvidia)
	case "none", "void":
		return []string{}, nil
	}
	var list []string
	named := map[string]bool{}
	for _, d := range strings.Split(nv, ",") {
		d = strings.TrimSpace(d)
		switch {
		case d == "":
			return nil, fmt.Errorf("cudart: %s=%q has an empty entry", EnvNVIDIAVisible, nvidia)
		case named[strings.ToLower(d)]:
			return nil, fmt.Errorf("cudart: %s=%q names %s twice", EnvNVIDIAVisible, nvidia, d)
		}
		named[strings.ToLower(d)] = true
		list = append(list, d)
	}
	if strings.TrimSpace(cuda) == "" {
		return list, nil
	}
	out := []string{}
	taken := map[int]bool{}
	for _, e := range strings.Split(cuda, ",") {
		i := visibleIndex(list, strings.TrimSpace(e))
		if i < 0 {
			break
		}
		if taken[i] {
			return nil, fmt.Errorf("cudart: %s=%q names device %s twice", EnvCUDAVisible, cuda, list[i])
		}
		taken[i] = true
		out = append(out, list[i])
	}
	return out, nil
}

// visibleIndex is the index in list of a CUDA_VISIBLE_DEVICES entry: an ordinal,
// or a UUID prefix matching exactly one entry; -1 when it matches nothing.
func visibleIndex(list []string, e string) int {
	if n, err := strconv.Atoi(e); err == nil {
		if n < 0 || n >= len(list) {
			return -1
		}
		return n
	}
	if e == "" {
		return -1
	}
	found := -1
	for i, d := range list {
		if strings.HasPrefix(strings.ToLower(d), strings.ToLower(e)) {
			if found >= 0 {
				return -1 // ambiguous: CUDA refuses it
			}
			found = i
		}
	}
	return found
}

// VisibleFromEnv is VisibleDevices of this process's environment.
func VisibleFromEnv() ([]string, error) {
	return VisibleDevices(os.Getenv(EnvNVIDIAVisible), os.Getenv(EnvCUDAVisible))
}
