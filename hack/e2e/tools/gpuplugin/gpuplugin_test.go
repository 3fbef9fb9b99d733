package gpuplugin

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// registrar is kubelet's Registration service, recording requests.
type registrar struct {
	pluginapi.UnimplementedRegistrationServer
	got chan *pluginapi.RegisterRequest
}

func (r *registrar) Register(_ context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	r.got <- req
	return &pluginapi.Empty{}, nil
}

// The plugin registers nvidia.com/gpu, lists the GPUs by UUID with their
// NUMA nodes, and sets NVIDIA_VISIBLE_DEVICES in Allocate, as the NVIDIA
// device plugin does; an unknown device is refused.
func TestPlugin(t *testing.T) {
	dir, err := os.MkdirTemp("", "gpup")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	l, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	reg := &registrar{got: make(chan *pluginapi.RegisterRequest, 1)}
	srv := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(srv, reg)
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	gpus := []GPU{{"GPU-a", 0}, {"GPU-b", 1}, {"GPU-c", 1}, {"GPU-d", -1}}
	p, err := Start(context.Background(), dir, gpus)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	r := <-reg.got
	if r.ResourceName != ResourceName || r.Version != pluginapi.Version || !r.Options.GetPreferredAllocationAvailable {
		t.Fatalf("registered %+v", r)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, r.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := pluginapi.NewDevicePluginClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	for i, d := range list.Devices {
		numa := int64(-1)
		if d.Topology != nil {
			numa = d.Topology.Nodes[0].ID
		}
		if d.ID != gpus[i].UUID || d.Health != pluginapi.Healthy || numa != int64(gpus[i].NUMA) {
			t.Errorf("device %d: %+v, want %+v", i, d, gpus[i])
		}
	}
	resp, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"GPU-c", "GPU-a"}}}})
	if err != nil || resp.ContainerResponses[0].Envs["NVIDIA_VISIBLE_DEVICES"] != "GPU-c,GPU-a" {
		t.Fatalf("allocate: %v, %v", resp, err)
	}
	if _, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"GPU-x"}}}}); err == nil {
		t.Fatal("an unknown device was allocated")
	}
	pref, err := c.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: []string{"GPU-a", "GPU-b", "GPU-c", "GPU-d"}, MustIncludeDeviceIDs: []string{"GPU-c"}, AllocationSize: 2}}})
	if err != nil || !slices.Equal(pref.ContainerResponses[0].DeviceIDs, []string{"GPU-c", "GPU-b"}) {
		t.Fatalf("preferred: %v, %v", pref, err)
	}
	p.Stop()
	if _, err := os.Stat(p.socket); !os.IsNotExist(err) {
		t.Errorf("socket left after Stop: %v", err)
	}
}
