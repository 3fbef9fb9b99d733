package gpu

import (
	"errors"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

const gib = 1 << 30

func busID(s string) [32]int8 {
	var b [32]int8
	for i := 0; i < len(s); i++ {
		b[i] = int8(s[i])
	}
	return b
}

// shape is one mocked GPU.
type shape struct {
	uuid, name, bus string
	mem             uint64
	numa            int
	numaRet         nvml.Return
}

// fake builds an NVML mock over the given GPUs; broken, when set, replaces
// one call's result on one GPU.
func fake(gpus []shape, shutdowns *int) *mock.Interface {
	devs := make([]nvml.Device, len(gpus))
	for i, g := range gpus {
		devs[i] = &mock.Device{
			GetUUIDFunc:       func() (string, nvml.Return) { return g.uuid, nvml.SUCCESS },
			GetNameFunc:       func() (string, nvml.Return) { return g.name, nvml.SUCCESS },
			GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: g.mem}, nvml.SUCCESS },
			GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
				return nvml.PciInfo{BusId: busID(g.bus)}, nvml.SUCCESS
			},
			GetNumaNodeIdFunc: func() (int, nvml.Return) { return g.numa, g.numaRet },
			GetMigModeFunc:    func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_NOT_SUPPORTED },
		}
	}
	return &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { *shutdowns++; return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
	}
}

func TestDiscoverShapes(t *testing.T) {
	gpus := []shape{
		// NUMA from NVML.
		{"GPU-a", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", 80 * gib, 0, nvml.SUCCESS},
		// Driver without NUMA support: sysfs says node 1.
		{"GPU-b", "NVIDIA H200", "00000000:3B:00.0", 141 * gib, 0, nvml.ERROR_NOT_SUPPORTED},
		// NVML says -1, sysfs says -1: unknown.
		{"GPU-c", "NVIDIA L4", "00000000:86:00.0", 24 * gib, -1, nvml.SUCCESS},
		// NVML has no such function; no sysfs entry at all: unknown.
		{"GPU-d", "Tesla T4", "00000000:5E:00.0", 16 * gib, 0, nvml.ERROR_FUNCTION_NOT_FOUND},
		// No bus ID from NVML: nothing to look up.
		{"GPU-e", "NVIDIA A10", "", 24 * gib, 0, nvml.ERROR_NOT_SUPPORTED},
		// NUMA node 3 from NVML on a second PCI domain.
		{"GPU-f", "NVIDIA B200", "00000001:AF:00.0", 180 * gib, 3, nvml.SUCCESS},
	}
	var shutdowns int
	got, err := Discover(fake(gpus, &shutdowns), "testdata")
	if err != nil {
		t.Fatal(err)
	}
	want := []Device{
		{Index: 0, UUID: "GPU-a", Name: "NVIDIA H100 80GB HBM3", BusID: "0000:18:00.0", Memory: 80 * gib, NUMA: 0},
		{Index: 1, UUID: "GPU-b", Name: "NVIDIA H200", BusID: "0000:3b:00.0", Memory: 141 * gib, NUMA: 1},
		{Index: 2, UUID: "GPU-c", Name: "NVIDIA L4", BusID: "0000:86:00.0", Memory: 24 * gib, NUMA: -1},
		{Index: 3, UUID: "GPU-d", Name: "Tesla T4", BusID: "0000:5e:00.0", Memory: 16 * gib, NUMA: -1},
		{Index: 4, UUID: "GPU-e", Name: "NVIDIA A10", Memory: 24 * gib, NUMA: -1},
		{Index: 5, UUID: "GPU-f", Name: "NVIDIA B200", BusID: "0001:af:00.0", Memory: 180 * gib, NUMA: 3},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d devices, want %d", len(got), len(want))
	}
	for i := range want {
		if !reflect.DeepEqual(got[i], want[i]) {
			t.Errorf("device %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if shutdowns != 1 {
		t.Errorf("nvmlShutdown called %d times, want 1", shutdowns)
	}
}

func TestDiscoverDGXH100(t *testing.T) {
	srv := dgxh100.New()
	for i, d := range srv.Devices {
		dev := d.(*server.Device)
		numa := i / 4
		dev.GetNumaNodeIdFunc = func() (int, nvml.Return) { return numa, nvml.SUCCESS }
	}
	got, err := Discover(srv, "testdata")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 8 {
		t.Fatalf("%d GPUs, want 8", len(got))
	}
	uuids := map[string]bool{}
	for i, d := range got {
		if d.Index != i || d.NUMA != i/4 || d.Memory < 79*gib || d.Memory > 81*gib || !strings.Contains(d.Name, "H100") {
			t.Errorf("GPU %d = %+v", i, d)
		}
		uuids[d.UUID] = true
	}
	if len(uuids) != 8 {
		t.Errorf("UUIDs not distinct: %v", uuids)
	}
}

func TestDiscoverFailures(t *testing.T) {
	two := []shape{
		{"GPU-a", "A", "00000000:18:00.0", 80 * gib, 0, nvml.SUCCESS},
		{"GPU-b", "B", "00000000:3B:00.0", 80 * gib, 0, nvml.SUCCESS},
	}
	cases := []struct {
		name      string
		breakIt   func(*mock.Interface)
		want      string
		wantErr   error
		shutdowns int
	}{
		{"no library", func(m *mock.Interface) {
			m.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
		}, "libnvidia-ml.so.1", ErrNoNVML, 0},
		{"driver not loaded", func(m *mock.Interface) {
			m.InitFunc = func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }
		}, "nvmlInit: ", nil, 0},
		{"count", func(m *mock.Interface) {
			m.DeviceGetCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, "nvmlDeviceGetCount", nil, 1},
		{"handle", func(m *mock.Interface) {
			m.DeviceGetHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_GPU_IS_LOST }
		}, "gpu 0: nvmlDeviceGetHandleByIndex", nil, 1},
		{"memory of second GPU", func(m *mock.Interface) {
			d, _ := m.DeviceGetHandleByIndex(1)
			d.(*mock.Device).GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
		}, "gpu 1: nvmlDeviceGetMemoryInfo", nil, 1},
		{"uuid", func(m *mock.Interface) {
			d, _ := m.DeviceGetHandleByIndex(0)
			d.(*mock.Device).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_UNKNOWN }
		}, "gpu 0: nvmlDeviceGetUUID", nil, 1},
		{"pci", func(m *mock.Interface) {
			d, _ := m.DeviceGetHandleByIndex(1)
			d.(*mock.Device).GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, nvml.ERROR_NO_PERMISSION }
		}, "gpu 1: nvmlDeviceGetPciInfo", nil, 1},
		{"numa call fails", func(m *mock.Interface) {
			d, _ := m.DeviceGetHandleByIndex(0)
			d.(*mock.Device).GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, "gpu 0: nvmlDeviceGetNumaNodeId", nil, 1},
		{"sysfs numa garbage", func(m *mock.Interface) {
			d, _ := m.DeviceGetHandleByIndex(1)
			dev := d.(*mock.Device)
			dev.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
				return nvml.PciInfo{BusId: busID("00000000:99:00.0")}, nvml.SUCCESS
			}
			dev.GetNumaNodeIdFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		}, `gpu 1: testdata/sys/bus/pci/devices/0000:99:00.0/numa_node: bad NUMA node "banana"`, nil, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var shutdowns int
			m := fake(two, &shutdowns)
			c.breakIt(m)
			got, err := Discover(m, "testdata")
			if err == nil || got != nil {
				t.Fatalf("Discover = %+v, %v; want an error", got, err)
			}
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %q does not contain %q", err, c.want)
			}
			if c.wantErr != nil && !errors.Is(err, c.wantErr) {
				t.Errorf("error %v is not %v", err, c.wantErr)
			}
			if shutdowns != c.shutdowns {
				t.Errorf("nvmlShutdown called %d times, want %d", shutdowns, c.shutdowns)
			}
		})
	}
}

// TestDiscoverRealLibrary runs discovery against the real NVML loader: on
// a machine without the NVIDIA driver (CI) it must say so with ErrNoNVML;
// on a GPU machine it must find at least one GPU.
func TestDiscoverRealLibrary(t *testing.T) {
	devs, err := Discover(nvml.New(), "/")
	if errors.Is(err, ErrNoNVML) {
		t.Logf("no NVML here, as expected on CI: %v", err)
		return
	}
	if err != nil {
		t.Fatalf("NVML present but discovery failed: %v", err)
	}
	if len(devs) == 0 {
		t.Fatal("NVML present but no GPUs found")
	}
	for _, d := range devs {
		t.Logf("found %+v", d)
	}
}

func TestSysfsBusID(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:3B:00.0": "0000:3b:00.0",
		"0000:3b:00.0":     "0000:3b:00.0",
		"00000001:AF:00.0": "0001:af:00.0",
		"":                 "",
		"  ":               "",
	} {
		b := busID(in)
		if got := sysfsBusID(b[:]); got != want {
			t.Errorf("sysfsBusID(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestSysfsNUMANode(t *testing.T) {
	cases := []struct {
		bus  string
		want int
		err  string
	}{
		{"0000:3b:00.0", 1, ""},
		{"0000:86:00.0", -1, ""},
		{"0000:00:00.0", -1, ""}, // absent
		{"0000:99:00.0", -1, "bad NUMA node"},
		{"../../../etc", -1, "bad PCI bus id"},
		{"..", -1, "bad PCI bus id"},
	}
	for _, c := range cases {
		got, err := SysfsNUMANode("testdata", c.bus)
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("SysfsNUMANode(%q) = %d, %v; want %d, %q", c.bus, got, err, c.want, c.err)
		}
	}
}

func TestSimulated(t *testing.T) {
	got := Simulated(3, 80*gib, []int{0, 1})
	for i, d := range got {
		if d.Index != i || !d.Simulated || d.Memory != 80*gib || d.NUMA != i%2 {
			t.Errorf("simulated GPU %d = %+v", i, d)
		}
	}
	if got[0].UUID == got[1].UUID {
		t.Error("simulated UUIDs repeat")
	}
	// Pairs behind one root complex each; every address a valid BDF.
	for i, want := range [][2]string{{"0000:11:00.0", "pci0000:10"}, {"0000:12:00.0", "pci0000:10"}, {"0000:21:00.0", "pci0000:20"}} {
		if got[i].BusID != want[0] || got[i].PCIeRoot != want[1] {
			t.Errorf("simulated GPU %d at %s behind %s, want %v", i, got[i].BusID, got[i].PCIeRoot, want)
		}
	}
	seen := map[string]bool{}
	for i := range 64 {
		bus, root := SimulatedPCI(i)
		if seen[bus] || !regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:00\.0$`).MatchString(bus) || !regexp.MustCompile(`^pci[0-9a-f]{4}:[0-9a-f]{2}$`).MatchString(root) {
			t.Errorf("GPU %d: bus %q root %q (repeated or malformed)", i, bus, root)
		}
		seen[bus] = true
	}
	for _, d := range Simulated(2, gib, nil) {
		if d.NUMA != -1 {
			t.Errorf("no NUMA nodes given but GPU %d on node %d", d.Index, d.NUMA)
		}
	}
}
