package gpu

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// dgx is one of go-nvml's mock DGX nodes (8 GPUs) with GPUs 0-3 on NUMA
// node 0 and 4-7 on node 1, as on the real machines.
func dgx(srv *server.Server) *server.Server {
	for i, d := range srv.Devices {
		numa := i / 4
		d.(*server.Device).GetNumaNodeIdFunc = func() (int, nvml.Return) { return numa, nvml.SUCCESS }
	}
	return srv
}

// partition turns MIG mode on for GPU i of srv and creates one GPU instance
// per profile (the mock's own profile tables decide slices and memory),
// each with one compute instance spanning it, as `nvidia-smi mig -cgi ...
// -C` does. The mock has no MIG device handles; partition gives the GPU
// the ones NVML would: one per compute instance, in GPU instance order,
// named and sized from the instance's profile.
func partition(t *testing.T, srv *server.Server, i int, profiles ...int) {
	t.Helper()
	d := srv.Devices[i].(*server.Device)
	if ret, _ := d.SetMigMode(nvml.DEVICE_MIG_ENABLE); ret != nvml.SUCCESS {
		t.Fatalf("GPU %d: SetMigMode: %v", i, ret)
	}
	type inst struct {
		gi, ci, slices int
		memMB          uint64
	}
	var insts []inst
	for _, p := range profiles {
		info, ret := d.GetGpuInstanceProfileInfo(p)
		if ret != nvml.SUCCESS {
			t.Fatalf("GPU %d: profile %d: %v", i, p, ret)
		}
		gi, ret := d.CreateGpuInstance(&info)
		if ret != nvml.SUCCESS {
			t.Fatalf("GPU %d: create GPU instance of profile %d: %v", i, p, ret)
		}
		// The widest compute instance profile of the GPU instance.
		var ciInfo nvml.ComputeInstanceProfileInfo
		for c := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
			if pi, ret := gi.GetComputeInstanceProfileInfo(c, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED); ret == nvml.SUCCESS && pi.SliceCount >= ciInfo.SliceCount {
				ciInfo = pi
			}
		}
		ci, ret := gi.CreateComputeInstance(&ciInfo)
		if ret != nvml.SUCCESS {
			t.Fatalf("GPU %d: create compute instance: %v", i, ret)
		}
		giInfo, _ := gi.GetInfo()
		ciI, _ := ci.GetInfo()
		insts = append(insts, inst{gi: int(giInfo.Id), ci: int(ciI.Id), slices: int(info.SliceCount), memMB: info.MemorySizeMB})
	}
	handles := make([]nvml.Device, len(insts))
	for k, in := range insts {
		uuid := migUUID(i, k)
		name := fmt.Sprintf("%s MIG %dg.%dgb", d.Config.Name, in.slices, int(math.Round(float64(in.memMB)/1024)))
		handles[k] = &mock.Device{
			GetUUIDFunc:                            func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
			GetNameFunc:                            func() (string, nvml.Return) { return name, nvml.SUCCESS },
			GetGpuInstanceIdFunc:                   func() (int, nvml.Return) { return in.gi, nvml.SUCCESS },
			GetComputeInstanceIdFunc:               func() (int, nvml.Return) { return in.ci, nvml.SUCCESS },
			GetMemoryInfoFunc:                      func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: in.memMB << 20}, nvml.SUCCESS },
			IsMigDeviceHandleFunc:                  func() (bool, nvml.Return) { return true, nvml.SUCCESS },
			GetDeviceHandleFromMigDeviceHandleFunc: func() (nvml.Device, nvml.Return) { return d, nvml.SUCCESS },
		}
	}
	d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	d.GetMigDeviceHandleByIndexFunc = func(k int) (nvml.Device, nvml.Return) {
		if k < 0 || k >= 7 {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		if k >= len(handles) {
			return nil, nvml.ERROR_NOT_FOUND
		}
		return handles[k], nvml.SUCCESS
	}
}

func migUUID(gpu, k int) string {
	return fmt.Sprintf("MIG-%08x-0000-4000-8000-%012x", 0xa1000000+gpu, k)
}

// The MIG layouts the tests cover, on go-nvml's mock DGX nodes.
var layouts = []struct {
	name    string
	node    func() *server.Server
	gpu     int
	profile []int
	names   []string // MIG profile names, from the fixture's sizes
}{
	{"DGX A100, GPU 0: 7 x 1g.5gb", dgxa100.New, 0,
		slices.Repeat([]int{nvml.GPU_INSTANCE_PROFILE_1_SLICE}, 7), slices.Repeat([]string{"1g.5gb"}, 7)},
	{"DGX A100, GPU 5: 3g.20gb + 2g.10gb + 2 x 1g.5gb", dgxa100.New, 5,
		[]int{nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.GPU_INSTANCE_PROFILE_2_SLICE, nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.GPU_INSTANCE_PROFILE_1_SLICE},
		[]string{"3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"}},
	{"DGX H100, GPU 2: 2 x 3g.40gb", dgxh100.New, 2,
		[]int{nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.GPU_INSTANCE_PROFILE_3_SLICE}, []string{"3g.40gb", "3g.40gb"}},
	{"DGX H100, GPU 6: 1 x 7g.80gb", dgxh100.New, 6,
		[]int{nvml.GPU_INSTANCE_PROFILE_7_SLICE}, []string{"7g.80gb"}},
	{"DGX H200, GPU 7: 4g.71gb + 3 x 1g.18gb", dgxh200.New, 7,
		[]int{nvml.GPU_INSTANCE_PROFILE_4_SLICE, nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.GPU_INSTANCE_PROFILE_1_SLICE},
		[]string{"4g.71gb", "1g.18gb", "1g.18gb", "1g.18gb"}},
}

// Discovery lists a MIG-partitioned GPU's instances (UUID, IDs, name,
// memory) on the GPU, whose NUMA node they share; the other GPUs have none.
func TestDiscoverMIG(t *testing.T) {
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			srv := dgx(l.node())
			partition(t, srv, l.gpu, l.profile...)
			devs, err := Discover(srv, "testdata")
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range devs {
				if d.Index != l.gpu {
					if d.MIG != nil {
						t.Errorf("GPU %d without MIG mode lists instances %+v", d.Index, d.MIG)
					}
					continue
				}
				if d.NUMA != l.gpu/4 || len(d.MIG) != len(l.profile) {
					t.Fatalf("GPU %d: NUMA %d, %d instances %+v", d.Index, d.NUMA, len(d.MIG), d.MIG)
				}
				gis := map[int]bool{}
				for k, m := range d.MIG {
					if m.UUID != migUUID(l.gpu, k) || !strings.HasSuffix(m.Name, " MIG "+l.names[k]) || m.Memory <= 0 || m.Memory > d.Memory || gis[m.GI] {
						t.Errorf("instance %d: %+v, want %s", k, m, l.names[k])
					}
					gis[m.GI] = true
				}
			}
		})
	}
}

// Every name an engine's CUDA driver, NVML or the NVIDIA device plugin
// gives a device maps to its physical GPU (and so its NUMA node); an
// unknown one is a clear error.
func TestResolve(t *testing.T) {
	srv := dgx(dgxa100.New())
	partition(t, srv, 5, layouts[1].profile...)
	devs, err := Discover(srv, "testdata")
	if err != nil {
		t.Fatal(err)
	}
	r := NewResolver(devs)
	gpu3, mig := devs[3].UUID, devs[5].MIG[2].UUID
	body := strings.TrimPrefix(mig, "MIG-")
	cases := []struct {
		name    string
		gpu     int  // -1: unknown
		isMIG   bool // the target is a MIG instance
		wantKey string
	}{
		{gpu3, 3, false, gpu3},
		{strings.ToUpper(gpu3[4:]), -1, false, ""}, // no prefix, no match: a bare UUID body is no name of ours
		{"GPU-" + strings.ToUpper(gpu3[4:]), 3, false, gpu3},
		{gpu3 + "::0", 3, false, gpu3},  // time-slicing / MPS replica
		{gpu3 + "::17", 3, false, gpu3}, //
		{gpu3 + "::x", -1, false, ""},
		{"::3", -1, false, ""},
		{mig, 5, true, mig},
		{"GPU-" + body, 5, true, mig}, // the CUDA driver's name of the instance
		{mig + "::2", 5, true, mig},
		{"3", 3, false, gpu3}, // deviceIDStrategy=index
		{"5:2", 5, false, devs[5].UUID},
		{"8", -1, false, ""},
		{"03", -1, false, ""},
		{"-1", -1, false, ""},
		{"", -1, false, ""},
		{"GPU-", -1, false, ""},
		{"MIG-GPU-" + devs[5].UUID[4:] + "/1/0", -1, false, ""}, // old form of an instance this node does not have
		{"GPU-00000000-0000-0000-0000-000000000000", -1, false, ""},
	}
	for _, c := range cases {
		tg, err := r.Resolve(c.name)
		if c.gpu < 0 {
			if !errors.Is(err, ErrUnknownDevice) || !strings.Contains(err.Error(), devs[0].UUID) {
				t.Errorf("Resolve(%q) = %+v, %v; want ErrUnknownDevice naming the node's GPUs", c.name, tg, err)
			}
			continue
		}
		if err != nil || tg.GPU.Index != c.gpu || tg.GPU.NUMA != c.gpu/4 || (tg.MIG != nil) != c.isMIG || tg.Key() != c.wantKey {
			t.Errorf("Resolve(%q) = GPU %d (NUMA %d), MIG %v, key %q, %v; want GPU %d, key %q", c.name, tg.GPU.Index, tg.GPU.NUMA, tg.MIG, tg.Key(), err, c.gpu, c.wantKey)
		}
	}
	// Names: every spelling a client may open with.
	names := r.Names()
	for _, n := range []string{gpu3, mig, "GPU-" + body} {
		if g, ok := names[n]; !ok || g != map[bool]int{true: 5, false: 3}[n != gpu3] {
			t.Errorf("Names()[%q] = %d, %v", n, g, ok)
		}
	}
	if len(names) != 8+2*len(devs[5].MIG) {
		t.Errorf("%d names, want %d", len(names), 8+2*len(devs[5].MIG))
	}
}

// Drivers before R470 named MIG instances "MIG-GPU-<gpu uuid>/<gi>/<ci>".
func TestResolveOldMIGNames(t *testing.T) {
	devs := []Device{{Index: 0, UUID: "GPU-abc", NUMA: 1, MIG: []MIG{{UUID: "MIG-GPU-abc/1/0", GI: 1}, {UUID: "MIG-GPU-abc/2/0", GI: 2}}}}
	r := NewResolver(devs)
	for _, n := range []string{"MIG-GPU-abc/2/0", "mig-gpu-ABC/2/0::1"} {
		if tg, err := r.Resolve(n); err != nil || tg.MIG == nil || tg.MIG.GI != 2 || tg.GPU.NUMA != 1 {
			t.Errorf("Resolve(%q) = %+v, %v", n, tg, err)
		}
	}
	if tg, err := r.Resolve("GPU-abc"); err != nil || tg.MIG != nil {
		t.Errorf("the GPU itself: %+v, %v", tg, err)
	}
	if names := r.Names(); len(names) != 3 {
		t.Errorf("names %v", names)
	}
}

// A container's GPU device IDs become its ranks: one per CUDA device, a
// device's replicas once; an ID of no GPU here leaves the count and no GPUs.
func TestRanks(t *testing.T) {
	srv := dgx(dgxh100.New())
	partition(t, srv, 2, layouts[2].profile...)
	devs, err := Discover(srv, "testdata")
	if err != nil {
		t.Fatal(err)
	}
	r := NewResolver(devs)
	u := func(i int) string { return devs[i].UUID }
	m := func(k int) string { return devs[2].MIG[k].UUID }
	cases := []struct {
		ids   []string
		count int
		gpus  []int
		bad   bool
	}{
		{[]string{u(4)}, 1, []int{4}, false},
		{[]string{u(5), u(4)}, 2, []int{4, 5}, false},
		{[]string{u(0) + "::1", u(0) + "::3"}, 1, []int{0}, false}, // two replicas of one GPU: one device
		{[]string{m(0), m(1)}, 2, []int{2, 2}, false},              // two MIG instances of GPU 2
		{[]string{"0", "1", "2", "3", "4", "5", "6", "7"}, 8, []int{0, 1, 2, 3, 4, 5, 6, 7}, false},
		{[]string{u(1), "GPU-elsewhere", "GPU-elsewhere::2"}, 2, nil, true},
		{nil, 0, nil, false},
	}
	for _, c := range cases {
		count, gpus, err := r.Ranks(c.ids)
		if count != c.count || !reflect.DeepEqual(gpus, c.gpus) || (err != nil) != c.bad {
			t.Errorf("Ranks(%q) = %d, %v, %v; want %d, %v (error %v)", c.ids, count, gpus, err, c.count, c.gpus, c.bad)
		}
	}
}

// A failing MIG call fails discovery with the call named.
func TestDiscoverMIGFailures(t *testing.T) {
	cases := []struct {
		name string
		edit func(d *server.Device)
		want string
	}{
		{"mig mode", func(d *server.Device) {
			d.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_UNKNOWN }
		}, "gpu 1: nvmlDeviceGetMigMode"},
		{"max count", func(d *server.Device) {
			d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_GPU_IS_LOST }
		}, "gpu 1: nvmlDeviceGetMaxMigDeviceCount"},
		{"handle", func(d *server.Device) {
			d.GetMigDeviceHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_GPU_IS_LOST }
		}, "gpu 1: MIG device 0: nvmlDeviceGetMigDeviceHandleByIndex"},
		{"uuid", func(d *server.Device) {
			h, _ := d.GetMigDeviceHandleByIndex(1)
			h.(*mock.Device).GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_UNKNOWN }
		}, "gpu 1: MIG device 1: nvmlDeviceGetUUID"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			srv := dgx(dgxa100.New())
			partition(t, srv, 1, nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.GPU_INSTANCE_PROFILE_3_SLICE)
			c.edit(srv.Devices[1].(*server.Device))
			if devs, err := Discover(srv, "testdata"); err == nil || devs != nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Discover = %v, %v; want an error with %q", devs, err, c.want)
			}
		})
	}
}
