// Package gpu finds the node's GPUs through NVML: index, UUID, PCI bus ID,
// device memory and NUMA node. It knows nothing of pools or Kubernetes.
package gpu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Device is one GPU as the sizing policy sees it.
type Device struct {
	Index int    // NVML index (the CUDA ordinal under CUDA_DEVICE_ORDER=PCI_BUS_ID)
	UUID  string // "GPU-..."
	Name  string // product name
	BusID string // PCI address as sysfs writes it, "0000:3b:00.0"; empty if unknown
	// PCIeRoot is the GPU's PCIe root complex, "pci<domain>:<bus>", for
	// simulated GPUs (SimulatedPCI); empty for discovered ones, whose root
	// the DRA driver reads from sysfs by BusID.
	PCIeRoot string
	Memory   int64 // device memory in bytes
	// NUMA is the host NUMA node nearest the GPU, or -1 when the platform
	// does not say (single-node machines, VMs).
	NUMA      int
	Simulated bool  // made up by Simulated, not found on the node
	MIG       []MIG // its MIG instances when MIG mode is on; nil otherwise
}

// MIG is one MIG instance of a GPU: a device of its own to CUDA, to the
// container runtime and to the NVIDIA device plugin, on its GPU's NUMA
// node.
type MIG struct {
	UUID   string // "MIG-<uuid>" (drivers before R470: "MIG-GPU-<gpu uuid>/<gi>/<ci>")
	Name   string // e.g. "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
	GI, CI int    // GPU and compute instance IDs
	Memory int64  // bytes of the instance's device memory
}

// ErrNoNVML means the NVML library could not be loaded: no NVIDIA driver on
// this node, or the container runs without the NVIDIA runtime.
var ErrNoNVML = errors.New("gpu: NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver on this node, or the container was started without the NVIDIA container runtime")

// Discover lists the GPUs through lib (nvml.New() in production; a mock in
// tests). NUMA nodes come from NVML where the driver reports them, else from
// sysRoot/sys/bus/pci/devices/<bus id>/numa_node (sysRoot is "/" on a node).
// It returns ErrNoNVML when the library is missing, and an error naming the
// GPU and call for any other failure.
func Discover(lib nvml.Interface, sysRoot string) ([]Device, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, ErrNoNVML
		}
		return nil, fmt.Errorf("gpu: nvmlInit: %v", errorString(ret))
	}
	defer func() { _ = lib.Shutdown() }() // the device list is read; nothing to undo
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu: nvmlDeviceGetCount: %v", errorString(ret))
	}
	devs := make([]Device, 0, n)
	for i := 0; i < n; i++ {
		d, err := describe(lib, i, sysRoot)
		if err != nil {
			return nil, err
		}
		devs = append(devs, d)
	}
	return devs, nil
}

func describe(lib nvml.Interface, i int, sysRoot string) (Device, error) {
	fail := func(call string, ret nvml.Return) (Device, error) {
		return Device{}, fmt.Errorf("gpu %d: %s: %v", i, call, errorString(ret))
	}
	h, ret := lib.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		return fail("nvmlDeviceGetHandleByIndex", ret)
	}
	d := Device{Index: i, NUMA: -1}
	if d.UUID, ret = h.GetUUID(); ret != nvml.SUCCESS {
		return fail("nvmlDeviceGetUUID", ret)
	}
	if d.Name, ret = h.GetName(); ret != nvml.SUCCESS {
		return fail("nvmlDeviceGetName", ret)
	}
	mem, ret := h.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return fail("nvmlDeviceGetMemoryInfo", ret)
	}
	d.Memory = int64(mem.Total)
	pci, ret := h.GetPciInfo()
	if ret != nvml.SUCCESS {
		return fail("nvmlDeviceGetPciInfo", ret)
	}
	d.BusID = sysfsBusID(pci.BusId[:])
	node, ret := h.GetNumaNodeId()
	switch ret {
	case nvml.SUCCESS:
		if node >= 0 {
			d.NUMA = node
		}
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND:
		// Older drivers: ask sysfs below.
	default:
		return fail("nvmlDeviceGetNumaNodeId", ret)
	}
	if d.NUMA < 0 && d.BusID != "" {
		n, err := SysfsNUMANode(sysRoot, d.BusID)
		if err != nil {
			return Device{}, fmt.Errorf("gpu %d: %w", i, err)
		}
		d.NUMA = n
	}
	var err error
	if d.MIG, err = migInstances(h); err != nil {
		return Device{}, fmt.Errorf("gpu %d: %w", i, err)
	}
	return d, nil
}

// migInstances lists a GPU's MIG instances: none when MIG mode is off or
// the GPU (or driver) has no MIG.
func migInstances(h nvml.Device) ([]MIG, error) {
	mode, _, ret := h.GetMigMode()
	switch {
	case ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_FUNCTION_NOT_FOUND:
		return nil, nil
	case ret != nvml.SUCCESS:
		return nil, fmt.Errorf("nvmlDeviceGetMigMode: %v", errorString(ret))
	case mode != nvml.DEVICE_MIG_ENABLE:
		return nil, nil
	}
	n, ret := h.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetMaxMigDeviceCount: %v", errorString(ret))
	}
	migs := []MIG{}
	for i := range n {
		mh, ret := h.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND {
			continue // no instance in this slot
		}
		fail := func(call string, ret nvml.Return) ([]MIG, error) {
			return nil, fmt.Errorf("MIG device %d: %s: %v", i, call, errorString(ret))
		}
		if ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetMigDeviceHandleByIndex", ret)
		}
		var m MIG
		if m.UUID, ret = mh.GetUUID(); ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetUUID", ret)
		}
		if m.GI, ret = mh.GetGpuInstanceId(); ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetGpuInstanceId", ret)
		}
		if m.CI, ret = mh.GetComputeInstanceId(); ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetComputeInstanceId", ret)
		}
		if m.Name, ret = mh.GetName(); ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetName", ret)
		}
		mem, ret := mh.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return fail("nvmlDeviceGetMemoryInfo", ret)
		}
		m.Memory = int64(mem.Total)
		migs = append(migs, m)
	}
	return migs, nil
}

// sysfsBusID turns NVML's bus ID ("00000000:3B:00.0", NUL-padded) into
// sysfs's form ("0000:3b:00.0"); "" when NVML gave none.
func sysfsBusID(raw []int8) string {
	b := make([]byte, 0, len(raw))
	for _, c := range raw {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	s := strings.ToLower(strings.TrimSpace(string(b)))
	if s == "" {
		return ""
	}
	// NVML pads the PCI domain to 8 hex digits; sysfs uses 4.
	if dom, rest, ok := strings.Cut(s, ":"); ok && len(dom) == 8 && strings.HasPrefix(dom, "0000") {
		s = dom[4:] + ":" + rest
	}
	return s
}

// SysfsNUMANode reads the NUMA node of PCI device busID from
// sysRoot/sys/bus/pci/devices/<busID>/numa_node. A missing file or a value
// of -1 gives -1 (no NUMA information), not an error.
func SysfsNUMANode(sysRoot, busID string) (int, error) {
	if strings.ContainsAny(busID, "/\x00") || busID == "." || busID == ".." {
		return -1, fmt.Errorf("bad PCI bus id %q", busID)
	}
	p := filepath.Join(sysRoot, "sys/bus/pci/devices", busID, "numa_node")
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return -1, nil
	}
	if err != nil {
		return -1, fmt.Errorf("read NUMA node: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < -1 {
		return -1, fmt.Errorf("%s: bad NUMA node %q", p, strings.TrimSpace(string(b)))
	}
	return n, nil
}

// Simulated makes n GPUs of memory bytes each for standalone mode, spread
// round-robin over the given NUMA nodes (all -1 when numaNodes is empty),
// with the PCI addresses of SimulatedPCI.
func Simulated(n int, memory int64, numaNodes []int) []Device {
	devs := make([]Device, n)
	for i := range devs {
		numa := -1
		if len(numaNodes) > 0 {
			numa = numaNodes[i%len(numaNodes)]
		}
		bus, root := SimulatedPCI(i)
		devs[i] = Device{
			Index: i, UUID: fmt.Sprintf("GPU-sim-%08d", i), Name: "kvpool simulated GPU",
			BusID: bus, PCIeRoot: root, Memory: memory, NUMA: numa, Simulated: true,
		}
	}
	return devs
}

// SimulatedPCI is the PCI address and PCIe root complex of simulated GPU
// i: GPUs in pairs behind one root complex each, as two GPUs share a PCIe
// switch on common 8-GPU boards. Pair p (i/2) has root bus 0x10*(p%15+1)
// of PCI domain p/15, and the pair's GPUs the next two buses:
// GPU 0 0000:11:00.0 and GPU 1 0000:12:00.0 behind pci0000:10, GPU 2
// 0000:21:00.0 and GPU 3 0000:22:00.0 behind pci0000:20, and so on. The e2e
// test GPU DRA driver (hack/e2e/tools/cmd/gpudra) publishes the same.
func SimulatedPCI(i int) (busID, pcieRoot string) {
	p := i / 2
	domain, root := p/15, 0x10*(p%15+1)
	return fmt.Sprintf("%04x:%02x:00.0", domain, root+1+i%2), fmt.Sprintf("pci%04x:%02x", domain, root)
}

func errorString(ret nvml.Return) string {
	// nvml.ErrorString needs the library loaded; Return.Error falls back to
	// the constant's name.
	return fmt.Sprintf("%s (NVML code %d)", ret.Error(), int32(ret))
}
