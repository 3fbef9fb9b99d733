package dra

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// devicesOf lists the devices of every slice, and the counter sets.
func devicesOf(t *testing.T, node string, gpus []GPU, chunks []Chunk, held map[string]plugin.Holder) ([]resourceapi.Device, map[string]int64) {
	t.Helper()
	res := Resources(node, gpus, chunks, held, false)
	pool, ok := res.Pools[node]
	if !ok || len(res.Pools) != 1 {
		t.Fatalf("pools %v", res.Pools)
	}
	var devs []resourceapi.Device
	counters := map[string]int64{}
	for _, s := range pool.Slices {
		if len(s.Devices) > 0 && len(s.SharedCounters) > 0 {
			t.Fatal("a slice with both devices and counters (the API allows one of them)")
		}
		if len(s.Devices) > devicesPerSlice || len(s.SharedCounters) > counterSetsPerSlice {
			t.Fatalf("slice over the API's limits: %d devices, %d counter sets", len(s.Devices), len(s.SharedCounters))
		}
		for _, d := range s.Devices {
			// The API server's rule (resource validation, 1.37): min plus
			// one step within the capacity, or the slice is refused whole.
			c := d.Capacity[CapMemory]
			if r := c.RequestPolicy; r != nil && r.ValidRange != nil && r.ValidRange.Step != nil {
				added := r.ValidRange.Min.DeepCopy()
				added.Add(*r.ValidRange.Step)
				if added.Cmp(c.Value) > 0 {
					t.Fatalf("device %s: min %s and a step %s pass its capacity %s", d.Name, r.ValidRange.Min, r.ValidRange.Step, &c.Value)
				}
			}
		}
		devs = append(devs, s.Devices...)
		for _, cs := range s.SharedCounters {
			q := cs.Counters[counterMemory].Value
			counters[cs.Name] = q.Value()
		}
	}
	return devs, counters
}

func names(devs []resourceapi.Device) []string {
	var out []string
	for _, d := range devs {
		out = append(out, d.Name)
	}
	return out
}

func attr(d resourceapi.Device, name resourceapi.QualifiedName) string {
	a, ok := d.Attributes[name]
	switch {
	case !ok:
		return "<none>"
	case a.StringValue != nil:
		return *a.StringValue
	case a.IntValue != nil:
		return fmt.Sprint(*a.IntValue)
	case a.BoolValue != nil:
		return fmt.Sprint(*a.BoolValue)
	}
	return "?"
}

// What a chunk's state makes of the slices: free and claimed chunks are
// offered (a device each, counted in the GPU's counter and share device);
// a device plugin allocation's and a renewing one are not.
func TestResourcesPerChunkState(t *testing.T) {
	chunks := testChunks()
	held := map[string]plugin.Holder{
		"gpu0-numa0-1": plugin.HeldClaim,
		"gpu0-numa0-2": plugin.HeldRenewing,
		"gpu1-numa0-0": plugin.HeldDevicePlugin,
		"gpu1-numa0-3": plugin.HeldRenewing,
	}
	devs, counters := devicesOf(t, node, testGPUs(), chunks, held)
	wantNames := []string{"gpu0-share", "gpu1-share", "gpu0-numa0-0", "gpu0-numa0-1", "gpu0-numa0-3", "gpu1-numa0-1", "gpu1-numa0-2"}
	if !slices.Equal(names(devs), wantNames) {
		t.Fatalf("devices %v, want %v", names(devs), wantNames)
	}
	if counters["gpu0"] != 3*chunkSz || counters["gpu1"] != 2*chunkSz || len(counters) != 2 {
		t.Errorf("counters %v", counters)
	}
	for _, d := range devs {
		kind := attr(d, AttrKind)
		g := attr(d, AttrGPU)
		if attr(d, deviceattribute.StandardDeviceAttributePCIeRoot) != "pci0000:10" || attr(d, deviceattribute.StandardDeviceAttributeNUMANode) != "0" ||
			attr(d, AttrGPUUUID) != "GPU-sim-0000000"+g || attr(d, AttrPageSize) != "4096" || attr(d, AttrHugePages) != "false" {
			t.Errorf("device %s attributes %v", d.Name, d.Attributes)
		}
		if len(d.ConsumesCounters) != 1 || d.ConsumesCounters[0].CounterSet != "gpu"+g {
			t.Errorf("device %s consumes %v", d.Name, d.ConsumesCounters)
		}
		consumes := d.ConsumesCounters[0].Counters[counterMemory].Value
		capacity := d.Capacity[CapMemory]
		switch kind {
		case KindChunk:
			if d.AllowMultipleAllocations != nil || capacity.Value.Value() != chunkSz || capacity.RequestPolicy != nil || consumes.Value() != chunkSz {
				t.Errorf("chunk device %s: %+v", d.Name, d)
			}
		case KindShare:
			total := counters["gpu"+g]
			p := capacity.RequestPolicy
			if !ptr.Deref(d.AllowMultipleAllocations, false) || capacity.Value.Value() != total || consumes.Value() != total ||
				p == nil || p.Default.Value() != chunkSz || p.ValidRange.Min.Value() != chunkSz || p.ValidRange.Step.Value() != chunkSz ||
				attr(d, AttrChunkSize) != fmt.Sprint(chunkSz) {
				t.Errorf("share device %s: %+v", d.Name, d)
			}
		default:
			t.Errorf("device %s of kind %q", d.Name, kind)
		}
	}
}

// The slices' edge cases: no chunk yet (an empty pool, still published),
// a GPU whose every chunk is taken by the device plugin (no counter set,
// no device), unknown NUMA node and PCIe root (no standard attribute, the
// device name lower case), chunks of two sizes on one GPU (no share
// device), and many chunks (slices of at most 64 devices, 8 counter sets).
func TestResourcesEdges(t *testing.T) {
	empty := Resources(node, nil, nil, nil, false)
	if s := empty.Pools[node].Slices; len(s) != 1 || len(s[0].Devices) != 0 {
		t.Errorf("no chunks: %+v", empty)
	}
	taken := map[string]plugin.Holder{}
	for _, c := range testChunks()[4:] {
		taken[c.ID] = plugin.HeldDevicePlugin
	}
	devs, counters := devicesOf(t, node, testGPUs(), testChunks(), taken)
	if len(devs) != 5 || counters["gpu1"] != 0 || len(counters) != 1 {
		t.Errorf("GPU 1 all taken: %v, %v", names(devs), counters)
	}
	// One chunk left on a GPU: its share is that chunk, with no step (the
	// API server refused every slice of the node for one with a step).
	for _, c := range testChunks()[1:4] {
		taken[c.ID] = plugin.HeldDevicePlugin
	}
	devs, counters = devicesOf(t, node, testGPUs(), testChunks(), taken)
	if len(devs) != 2 || counters["gpu0"] != chunkSz || devs[0].Name != ShareDevice(0) {
		t.Errorf("one chunk left: %v, %v", names(devs), counters)
	} else if r := devs[0].Capacity[CapMemory].RequestPolicy.ValidRange; r.Step != nil || r.Min.Value() != chunkSz {
		t.Errorf("one chunk left: the share's range %+v", r)
	}
	odd := []Chunk{{ID: "gpu3-numaX-0", GPU: 3, NUMA: -1, Size: chunkSz, PageSize: 2 << 20, HugePages: true},
		{ID: "gpu3-numaX-1", GPU: 3, NUMA: -1, Size: 2 * chunkSz, PageSize: 2 << 20, HugePages: true}}
	devs, _ = devicesOf(t, node, []GPU{{Index: 3}}, odd, nil)
	if !slices.Equal(names(devs), []string{"gpu3-numax-0", "gpu3-numax-1"}) {
		t.Errorf("mixed sizes: %v", names(devs))
	}
	for _, d := range devs {
		if attr(d, deviceattribute.StandardDeviceAttributeNUMANode) != "<none>" || attr(d, deviceattribute.StandardDeviceAttributePCIeRoot) != "<none>" ||
			attr(d, AttrGPUUUID) != "<none>" || attr(d, AttrHugePages) != "true" {
			t.Errorf("device %s: %v", d.Name, d.Attributes)
		}
	}
	var many []Chunk
	var gpus []GPU
	for g := range 10 {
		gpus = append(gpus, GPU{Index: g})
		for i := range 20 {
			many = append(many, Chunk{ID: contract.ChunkID(g, 0, i), GPU: g, NUMA: 0, Size: chunkSz, PageSize: 4096})
		}
	}
	devs, counters = devicesOf(t, node, gpus, many, nil)
	if len(devs) != 210 || len(counters) != 10 {
		t.Errorf("10 GPUs of 20 chunks: %d devices, %d counter sets", len(devs), len(counters))
	}
	// Chunks in index order, not text order: gpu0-numa0-10 after -9.
	if i, j := slices.Index(names(devs), "gpu0-numa0-9"), slices.Index(names(devs), "gpu0-numa0-10"); i < 0 || j != i+1 {
		t.Errorf("order: %v", names(devs)[:25])
	}
}

// The device model on the scheduler's own allocator (the structured
// package kube-scheduler 1.37 runs, with 1.37's default features): the
// three ways to ask for host KV, and the counters that keep the two doors
// off each other's memory.
func TestDeviceModelOnTheAllocator(t *testing.T) {
	ctx := context.Background()
	gpuDriver := "gpu.example.com"
	// The node's GPUs as a GPU driver publishes them: GPU 0 and 1 on one
	// PCIe root, GPU 2 and 3 on another.
	var gpuDevs []resourceapi.Device
	var gpus []GPU
	var chunks []Chunk
	for g := range 4 {
		root := fmt.Sprintf("pci0000:%02x", 0x10*(g/2+1))
		gpus = append(gpus, GPU{Index: g, UUID: fmt.Sprintf("GPU-%d", g), PCIeRoot: root})
		gpuDevs = append(gpuDevs, resourceapi.Device{Name: fmt.Sprintf("gpu-%d", g), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"uuid": {StringValue: ptr.To(fmt.Sprintf("GPU-%d", g))}, deviceattribute.StandardDeviceAttributePCIeRoot: {StringValue: ptr.To(root)},
		}})
		for i := range 4 {
			chunks = append(chunks, Chunk{ID: contract.ChunkID(g, 0, i), GPU: g, NUMA: 0, Size: chunkSz, PageSize: 4096})
		}
	}
	kv := sliceObjects(DefaultDriverName, Resources(node, gpus, chunks, nil, false))
	gpuSlice := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "gpus"}, Spec: resourceapi.ResourceSliceSpec{
		Driver: gpuDriver, NodeName: ptr.To(node), Pool: resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1}, Devices: gpuDevs}}
	all := append(kv, gpuSlice)
	classes := classLister{
		"host-kv.kvpool.io":       `device.driver == "kvpool.io" && device.attributes["kvpool.io"].kind == "chunk"`,
		"host-kv-bytes.kvpool.io": `device.driver == "kvpool.io" && device.attributes["kvpool.io"].kind == "share"`,
		"gpu.example.com":         `device.driver == "gpu.example.com"`,
	}
	state := structured.AllocatedState{AllocatedDevices: sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](), AggregatedCapacity: structured.NewConsumedCapacityCollection()}
	allocate := func(claim *resourceapi.ResourceClaim) []resourceapi.DeviceRequestAllocationResult {
		t.Helper()
		a, err := structured.NewAllocator(ctx, structured.Features{AdminAccess: true, PrioritizedList: true, PartitionableDevices: true,
			DeviceTaints: true, DeviceBindingAndStatus: true, ConsumableCapacity: true}, state, classes, all, cel.NewCache(10, cel.Features{}))
		if err != nil {
			t.Fatal(err)
		}
		res, err := a.Allocate(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, []*resourceapi.ResourceClaim{claim})
		if err != nil {
			t.Fatal(err)
		}
		if len(res) == 0 {
			return nil
		}
		for _, r := range res[0].Devices.Results {
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			if r.ShareID != nil {
				state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
				state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
			} else {
				state.AllocatedDevices.Insert(id)
			}
		}
		return res[0].Devices.Results
	}
	devicesOfResult := func(rs []resourceapi.DeviceRequestAllocationResult) string {
		var out []string
		for _, r := range rs {
			s := r.Device
			if q, ok := r.ConsumedCapacity[CapMemory]; ok {
				s += "=" + q.String()
			}
			out = append(out, s)
		}
		return strings.Join(out, ",")
	}

	// (1) The extended resource: the scheduler turns kvpool.io/host-kv: 3
	// into a request for exactly 3 devices of the class.
	ext := claimOf("ext", request("container-0-request-0", "host-kv.kvpool.io", 3, nil))
	if got := devicesOfResult(allocate(ext)); got != "gpu0-numa0-0,gpu0-numa0-1,gpu0-numa0-2" {
		t.Errorf("extended resource: %s", got)
	}
	// (2) Bytes: 20 MiB of 8 MiB chunks is rounded up to 3 chunks; GPU 0
	// has chunks taken by (1), so its share device cannot start (it would
	// book the whole GPU): GPU 1's takes it.
	bytes20 := claimOf("bytes", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("20Mi"))))
	if got := devicesOfResult(allocate(bytes20)); got != "gpu1-share=24Mi" {
		t.Errorf("bytes: %s", got)
	}
	// A second share fits beside the first on GPU 1 (8 MiB left).
	if got := devicesOfResult(allocate(claimOf("bytes2", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("1Mi")))))); got != "gpu1-share=8Mi" {
		t.Errorf("second share: %s", got)
	}
	// GPU 1's chunks are booked by its share device: chunk requests go to
	// GPU 0's last chunk and then GPU 2.
	if got := devicesOfResult(allocate(claimOf("ext2", request("r", "host-kv.kvpool.io", 2, nil)))); got != "gpu0-numa0-3,gpu2-numa0-0" {
		t.Errorf("chunks beside the shares: %s", got)
	}
	// (3) A GPU and host KV on its PCIe root: GPU 3 asked by UUID, 16 MiB
	// beside it (GPU 2 has a chunk taken, so GPU 3's share).
	aligned := claimOf("aligned", request("gpu", "gpu.example.com", 1, nil), request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("16Mi"))))
	aligned.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.example.com"].uuid == "GPU-3"`}}}
	aligned.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpu", "kv"}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(deviceattribute.StandardDeviceAttributePCIeRoot))}}
	if got := devicesOfResult(allocate(aligned)); got != "gpu-3,gpu3-share=16Mi" {
		t.Errorf("aligned: %s", got)
	}
	// Beyond capacity: nothing allocates (GPU 3's share has 16 MiB left;
	// GPU 0, 1 and 2 hold chunks or shares that exclude a new share of 40).
	if got := allocate(claimOf("huge", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("40Mi"))))); got != nil {
		t.Errorf("beyond capacity allocated %s", devicesOfResult(got))
	}
	// 16 chunk devices in all, 5 taken, 4 under GPU 1's shares and 4
	// under GPU 3's: 3 left.
	if got := allocate(claimOf("four", request("r", "host-kv.kvpool.io", 4, nil))); got != nil {
		t.Errorf("4 chunks allocated where 3 are left: %s", devicesOfResult(got))
	}
	if got := devicesOfResult(allocate(claimOf("three", request("r", "host-kv.kvpool.io", 3, nil)))); got != "gpu2-numa0-1,gpu2-numa0-2,gpu2-numa0-3" {
		t.Errorf("the last three chunks: %s", got)
	}
	// A GPU that offers one chunk: its share has no step (the API server's
	// rule), gives that chunk to a claim in bytes, and nothing more.
	one := []Chunk{{ID: contract.ChunkID(0, 0, 0), GPU: 0, NUMA: 0, Size: chunkSz, PageSize: 4096}}
	all = append(sliceObjects(DefaultDriverName, Resources(node, gpus[:1], one, nil, false)), gpuSlice)
	state = structured.AllocatedState{AllocatedDevices: sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](), AggregatedCapacity: structured.NewConsumedCapacityCollection()}
	if got := allocate(claimOf("one-over", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("9Mi"))))); got != nil {
		t.Errorf("one chunk's share gave %s for 9 MiB", devicesOfResult(got))
	}
	if got := devicesOfResult(allocate(claimOf("one", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("1Mi")))))); got != "gpu0-share=8Mi" {
		t.Errorf("one chunk's share: %s", got)
	}
	if got := allocate(claimOf("one-more", request("kv", "host-kv-bytes.kvpool.io", 1, ptr.To(resource.MustParse("1Mi"))))); got != nil {
		t.Errorf("one chunk's share gave a second claim %s", devicesOfResult(got))
	}
}

// sliceObjects turns published resources into ResourceSlice objects as
// the controller writes them (one generation, the slice count).
func sliceObjects(driver string, res resourceslice.DriverResources) []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for name, pool := range res.Pools {
		for i, s := range pool.Slices {
			out = append(out, &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%d", name, i)},
				Spec: resourceapi.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(name),
					Pool:    resourceapi.ResourcePool{Name: name, Generation: 1, ResourceSliceCount: int64(len(pool.Slices))},
					Devices: s.Devices, SharedCounters: s.SharedCounters}})
		}
	}
	return out
}

type classLister map[string]string

func (c classLister) List() ([]*resourceapi.DeviceClass, error) {
	var out []*resourceapi.DeviceClass
	for name := range c {
		cl, _ := c.Get(name)
		out = append(out, cl)
	}
	return out, nil
}

func (c classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	expr, ok := c[name]
	if !ok {
		return nil, fmt.Errorf("no class %s", name)
	}
	return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}}}}, nil
}

func request(name, class string, count int64, memory *resource.Quantity) resourceapi.DeviceRequest {
	r := resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class,
		AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}}
	if memory != nil {
		r.Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{CapMemory: *memory}}
	}
	return r
}

func claimOf(name string, reqs ...resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name)},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: reqs}}}
}

// Without partitionable devices or consumable capacity on the API server
// the driver publishes chunk devices only: no counter set, no share device,
// no counter consumption; each free or claimed chunk still a device.
func TestResourcesChunksOnly(t *testing.T) {
	held := map[string]plugin.Holder{"gpu0-numa0-2": plugin.HeldRenewing}
	devs, counters := devicesOf(t, node, testGPUs(), testChunks(), nil)
	if len(devs) != 10 || len(counters) != 2 {
		t.Fatalf("full model: %d devices, %d counter sets", len(devs), len(counters))
	}
	res := Resources(node, testGPUs(), testChunks(), held, true)
	var names []string
	for _, s := range res.Pools[node].Slices {
		if len(s.SharedCounters) > 0 {
			t.Errorf("counter sets %v", s.SharedCounters)
		}
		for _, d := range s.Devices {
			names = append(names, d.Name)
			if len(d.ConsumesCounters) > 0 || d.AllowMultipleAllocations != nil || attr(d, AttrKind) != KindChunk {
				t.Errorf("device %s: %+v", d.Name, d)
			}
		}
	}
	if len(names) != 7 || slices.Contains(names, "gpu0-numa0-2") {
		t.Errorf("chunks-only devices %v", names)
	}
}

// The driver falls back to chunk devices when the helper reports that the
// API server dropped the counters or the shares' fields, and not for other
// dropped fields or errors.
func TestFallBackOnDroppedFields(t *testing.T) {
	e := newEnv(t)
	full := sliceObjects(DefaultDriverName, Resources(node, testGPUs(), testChunks(), nil, false))
	withoutCounters := full[0].DeepCopy()
	withoutCounters.Spec.SharedCounters = nil
	ctx := context.Background()
	taints := full[1].DeepCopy()
	taints.Spec.Devices[0].Taints = []resourceapi.DeviceTaint{{Key: "k", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	e.d.HandleError(ctx, &resourceslice.DroppedFieldsError{DesiredSlice: taints, ActualSlice: full[1]}, "dropped taints")
	e.d.HandleError(ctx, errors.New("create resource slice: forbidden"), "other")
	if e.d.ChunksOnly() {
		t.Fatal("fell back for another dropped field or error")
	}
	e.d.HandleError(ctx, &resourceslice.DroppedFieldsError{DesiredSlice: full[0], ActualSlice: withoutCounters}, "processing ResourceSlice objects")
	if !e.d.ChunksOnly() {
		t.Fatal("no fall back when the counter sets were dropped")
	}
	for _, s := range e.d.Resources().Pools[node].Slices {
		for _, d := range s.Devices {
			if attr(d, AttrKind) != KindChunk || len(d.ConsumesCounters) > 0 {
				t.Errorf("after the fall back: %s", d.Name)
			}
		}
	}
}
