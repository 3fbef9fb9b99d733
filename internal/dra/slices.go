package dra

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// The device model (docs/dra.md). Every GPU's host KV is published twice
// over the same memory, and a counter set per GPU keeps the two from
// booking it twice:
//
//   - a chunk device per ready chunk (kind "chunk", capacity memory = the
//     chunk's bytes), consuming its bytes of the GPU's counter: what
//     `resources.limits: kvpool.io/host-kv: N` asks for through the
//     DeviceClass with extendedResourceName (N devices), and what a claim's
//     `count: N` takes;
//   - a share device per GPU (kind "share", allowMultipleAllocations,
//     capacity memory = the GPU's offered bytes with a request policy of
//     whole chunks), consuming the GPU's whole counter: what a claim asks
//     for in bytes (`capacity.requests.memory: 20Gi`, rounded up to whole
//     chunks); every share is carved out of its capacity, and the ledger
//     picks the chunks at Prepare.
//
// The scheduler charges a multi-allocatable device's counters once, at its
// first share, so a GPU serves either door at a time: chunks while any
// chunk device is allocated, shares while the share device has one. A
// chunk is offered while it is free or a claim's; one a device plugin
// allocation holds (a node moving between the doors) or one being renewed
// is not, and the GPU's counter and share capacity shrink by it.

// Attribute names (in the driver's domain unless qualified) and the
// capacity name.
const (
	AttrKind      = "kind"      // "chunk" or "share"
	AttrGPU       = "gpu"       // the GPU's index (NVML's)
	AttrGPUUUID   = "gpuUUID"   // the GPU's UUID ("GPU-...")
	AttrPageSize  = "pageSize"  // bytes per page of the chunk's memory
	AttrHugePages = "hugePages" // the chunk's memory is huge pages
	AttrChunkSize = "chunkSize" // bytes of one chunk (share devices)
	CapMemory     = "memory"    // bytes

	KindChunk = "chunk"
	KindShare = "share"

	// counterMemory is the counter of a GPU's counter set: bytes.
	counterMemory = "memory"
)

// Slice limits of resource.k8s.io/v1: devices per slice when devices
// consume counters, and counter sets per slice.
const (
	devicesPerSlice     = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures
	counterSetsPerSlice = resourceapi.ResourceSliceMaxCounterSets
)

// GPU is what the slices say about one GPU.
type GPU struct {
	Index    int
	UUID     string
	PCIeRoot string // "pci<domain>:<bus>"; "" when unknown
}

// Chunk is one ready chunk of the pool.
type Chunk struct {
	ID        string // the pool's chunk ID, gpu<G>-numa<N>-<i>
	GPU       int
	NUMA      int // -1 when unknown
	Size      int64
	PageSize  int64
	HugePages bool
}

// DeviceName is the chunk's device name: its ID in lower case (a device
// name is a DNS label; "numaX", the unknown NUMA node, has a capital).
func DeviceName(chunkID string) string { return strings.ToLower(chunkID) }

// ShareDevice is the name of GPU g's share device.
func ShareDevice(g int) string { return fmt.Sprintf("gpu%d-share", g) }

// counterSet is the name of GPU g's counter set.
func counterSet(g int) string { return fmt.Sprintf("gpu%d", g) }

// offered says whether a chunk held by h is published: a free chunk and a
// claim's are; a device plugin allocation's and a renewing one are not.
func offered(h plugin.Holder) bool { return h == plugin.HeldFree || h == plugin.HeldClaim }

// Resources is what the node publishes: one pool named after the node,
// whose first slices hold the GPUs' counter sets and the rest the devices
// (share devices first, then chunks in GPU and index order: the scheduler
// takes the first that fits). held says which chunks are held or renewing
// (ledger's ChunkHolders); gpus names the GPUs the chunks belong to.
//
// chunksOnly leaves out the counter sets and the share devices: chunk
// devices alone, which the scheduler can never book twice. It is the model
// for an API server without partitionable devices or consumable capacity
// (Kubernetes 1.34 and 1.35 by default), which would drop the counters (a
// share and a chunk device could then book the same memory) or the shares'
// request policy.
func Resources(node string, gpus []GPU, chunks []Chunk, held map[string]plugin.Holder, chunksOnly bool) resourceslice.DriverResources {
	byGPU := map[int]*GPU{}
	for i := range gpus {
		byGPU[gpus[i].Index] = &gpus[i]
	}
	var offer []Chunk
	for _, c := range chunks {
		if offered(held[c.ID]) && c.Size > 0 {
			offer = append(offer, c)
		}
	}
	slices.SortFunc(offer, func(a, b Chunk) int { return cmp.Or(cmp.Compare(a.GPU, b.GPU), compareChunkID(a.ID, b.ID)) })
	total := map[int]int64{}
	first := map[int]Chunk{} // the GPU's first chunk, as the others must be
	uniform := map[int]bool{}
	numa := map[int]int{}
	var order []int
	for _, c := range offer {
		f, ok := first[c.GPU]
		if !ok {
			order = append(order, c.GPU)
			first[c.GPU], f = c, c
			uniform[c.GPU] = true
			numa[c.GPU] = c.NUMA
		}
		total[c.GPU] += c.Size
		if c.Size != f.Size || c.PageSize != f.PageSize || c.HugePages != f.HugePages {
			uniform[c.GPU] = false
		}
		if c.NUMA != numa[c.GPU] {
			numa[c.GPU] = -1
		}
	}
	var counters []resourceapi.CounterSet
	var devices []resourceapi.Device
	for _, g := range order {
		if chunksOnly {
			break
		}
		counters = append(counters, resourceapi.CounterSet{Name: counterSet(g),
			Counters: map[string]resourceapi.Counter{counterMemory: {Value: bytesQ(total[g])}}})
		// Shares are whole chunks of one size: a GPU whose chunks differ
		// (never planned so) offers chunk devices only.
		if uniform[g] {
			devices = append(devices, shareDevice(first[g], byGPU[g], total[g], numa[g]))
		}
	}
	for _, c := range offer {
		d := chunkDevice(c, byGPU[c.GPU])
		if chunksOnly {
			d.ConsumesCounters = nil
		}
		devices = append(devices, d)
	}
	var out []resourceslice.Slice
	for cs := range slices.Chunk(counters, counterSetsPerSlice) {
		out = append(out, resourceslice.Slice{SharedCounters: cs})
	}
	for ds := range slices.Chunk(devices, devicesPerSlice) {
		out = append(out, resourceslice.Slice{Devices: ds})
	}
	if len(out) == 0 {
		// An empty pool, not no pool: the driver runs and has nothing yet.
		out = []resourceslice.Slice{{}}
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{node: {Slices: out}}}
}

// compareChunkID orders chunk IDs by GPU, then index (gpu0-numa0-10 after
// gpu0-numa0-9); IDs that do not parse sort by text after the others.
func compareChunkID(a, b string) int {
	ga, _, ia, ea := contract.ParseChunkID(a)
	gb, _, ib, eb := contract.ParseChunkID(b)
	if ea != nil || eb != nil {
		return cmp.Or(cmp.Compare(boolInt(ea != nil), boolInt(eb != nil)), strings.Compare(a, b))
	}
	return cmp.Or(cmp.Compare(ga, gb), cmp.Compare(ia, ib), strings.Compare(a, b))
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func bytesQ(n int64) resource.Quantity { return *resource.NewQuantity(n, resource.BinarySI) }

// gpuAttributes are the attributes a device of GPU g carries: its index and
// UUID, the standard NUMA node (of the memory) and PCIe root (of the GPU).
func gpuAttributes(g int, gpu *GPU, numa int) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	a := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrGPU: {IntValue: ptr.To(int64(g))},
	}
	if gpu != nil && gpu.UUID != "" {
		a[AttrGPUUUID] = resourceapi.DeviceAttribute{StringValue: ptr.To(gpu.UUID)}
	}
	if gpu != nil && gpu.PCIeRoot != "" {
		a[deviceattribute.StandardDeviceAttributePCIeRoot] = resourceapi.DeviceAttribute{StringValue: ptr.To(gpu.PCIeRoot)}
	}
	if numa >= 0 {
		a[deviceattribute.StandardDeviceAttributeNUMANode] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(numa))}
	}
	return a
}

func chunkDevice(c Chunk, gpu *GPU) resourceapi.Device {
	attrs := gpuAttributes(c.GPU, gpu, c.NUMA)
	attrs[AttrKind] = resourceapi.DeviceAttribute{StringValue: ptr.To(KindChunk)}
	attrs[AttrPageSize] = resourceapi.DeviceAttribute{IntValue: ptr.To(c.PageSize)}
	attrs[AttrHugePages] = resourceapi.DeviceAttribute{BoolValue: ptr.To(c.HugePages)}
	return resourceapi.Device{
		Name:       DeviceName(c.ID),
		Attributes: attrs,
		Capacity:   map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{CapMemory: {Value: bytesQ(c.Size)}},
		ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: counterSet(c.GPU),
			Counters: map[string]resourceapi.Counter{counterMemory: {Value: bytesQ(c.Size)}}}},
	}
}

// shareDevice is the share device of the GPU of like's chunks: total
// bytes, taken in whole chunks of like's size (one chunk when a request
// names no capacity), on numa (-1: unknown or mixed).
func shareDevice(like Chunk, gpu *GPU, total int64, numa int) resourceapi.Device {
	g, chunk := like.GPU, like.Size
	valid := &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(bytesQ(chunk))}
	if total > chunk {
		// The API server refuses a range whose min and one step pass the
		// capacity (the whole slice with it): a share of one chunk has no
		// step, its min is all there is.
		valid.Step = ptr.To(bytesQ(chunk))
	}
	attrs := gpuAttributes(g, gpu, numa)
	attrs[AttrKind] = resourceapi.DeviceAttribute{StringValue: ptr.To(KindShare)}
	attrs[AttrChunkSize] = resourceapi.DeviceAttribute{IntValue: ptr.To(chunk)}
	attrs[AttrPageSize] = resourceapi.DeviceAttribute{IntValue: ptr.To(like.PageSize)}
	attrs[AttrHugePages] = resourceapi.DeviceAttribute{BoolValue: ptr.To(like.HugePages)}
	return resourceapi.Device{
		Name:                     ShareDevice(g),
		Attributes:               attrs,
		AllowMultipleAllocations: ptr.To(true),
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{CapMemory: {
			Value: bytesQ(total),
			RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    ptr.To(bytesQ(chunk)),
				ValidRange: valid,
			},
		}},
		ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: counterSet(g),
			Counters: map[string]resourceapi.Counter{counterMemory: {Value: bytesQ(total)}}}},
	}
}
