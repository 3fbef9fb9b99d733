package main

/*
#include <stdint.h>
static inline void *kv_span_ptr(uint64_t a) { return (void *)(uintptr_t)a; }
*/
import "C"

import (
	"fmt"
	"sort"
	"sync"
	"unsafe"

	"github.com/kvpool/kvpool/pkg/cudart"
)

// span is a range of the caller's memory registered with the simulator as
// device memory of one device.
type span struct {
	ordinal    int
	base, size uint64
}

// Registered spans, counted: several handles of one process may serve the
// same tensor (a pool reopened before the old one closed, tests).
var (
	spansMu sync.Mutex
	spanRef = map[span]int{}
)

// spansOf returns the memory the regions touch, overlapping ranges merged.
func spansOf(ordinal int, regions []cudart.Region) ([]span, error) {
	var out []span
	for i, r := range regions {
		if r.Base == 0 || r.Pages <= 0 || r.PageBytes == 0 || r.Stride < r.PageBytes {
			return nil, fmt.Errorf("kvpool: region %d: base %#x, %d pages, %d bytes per page, stride %d", i, uintptr(r.Base), r.Pages, r.PageBytes, r.Stride)
		}
		end := uint64(r.Base) + uint64(r.Pages-1)*r.Stride + r.PageBytes
		if end < uint64(r.Base) {
			return nil, fmt.Errorf("kvpool: region %d overflows the address space", i)
		}
		out = append(out, span{ordinal, uint64(r.Base), end - uint64(r.Base)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].base < out[j].base })
	merged := out[:1]
	for _, s := range out[1:] {
		last := &merged[len(merged)-1]
		if s.base < last.base+last.size {
			last.size = max(last.size, s.base+s.size-last.base)
			continue
		}
		merged = append(merged, s)
	}
	return merged, nil
}

// registerSpans registers the memory of the regions with the simulator.
func (h *handle) registerSpans(regions []cudart.Region) error {
	spans, err := spansOf(h.ordinal, regions)
	if err != nil {
		return err
	}
	spansMu.Lock()
	defer spansMu.Unlock()
	for _, s := range spans {
		if spanRef[s] == 0 {
			mem := unsafe.Slice((*byte)(C.kv_span_ptr(C.uint64_t(s.base))), int(s.size))
			if _, err := h.sim.RegisterDeviceMemory(s.ordinal, mem); err != nil {
				h.unregisterLocked()
				return fmt.Errorf("kvpool: simulator: the KV cache at %#x+%d: %w", s.base, s.size, err)
			}
		}
		spanRef[s]++
		h.spans = append(h.spans, s)
	}
	return nil
}

func (h *handle) unregisterSpans() {
	spansMu.Lock()
	defer spansMu.Unlock()
	h.unregisterLocked()
}

func (h *handle) unregisterLocked() {
	for _, s := range h.spans {
		spanRef[s]--
		if spanRef[s] == 0 {
			delete(spanRef, s)
			_ = h.sim.UnregisterDeviceMemory(s.ordinal, cudart.DevicePtr(s.base)) // the span is gone either way
		}
	}
	h.spans = nil
}
