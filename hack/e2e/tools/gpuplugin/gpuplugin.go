// Package gpuplugin is a test-only stand-in for the NVIDIA device plugin:
// it advertises GPUs to kubelet as nvidia.com/gpu devices named by their
// UUIDs (the NVIDIA plugin's default deviceIDStrategy), each with the
// TopologyInfo of its NUMA node, and its Allocate sets
// NVIDIA_VISIBLE_DEVICES to the allocated UUIDs, as the NVIDIA plugin's
// default (envvar) device list strategy does; the NVIDIA container runtime
// would then expose exactly those GPUs, which here are simulated. It offers
// GetPreferredAllocation (must-include devices, then the others on their
// NUMA nodes, then the rest), as the NVIDIA plugin does.
package gpuplugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// ResourceName is the NVIDIA device plugin's resource.
const ResourceName = "nvidia.com/gpu"

// GPU is one advertised GPU.
type GPU struct {
	UUID string
	NUMA int // -1: no TopologyInfo
}

// Plugin serves the device plugin API for a fixed set of GPUs.
type Plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	gpus   []GPU
	dir    string // kubelet's device-plugins directory
	socket string
	srv    *grpc.Server
	stop   chan struct{}
}

// Start serves the plugin on a socket in kubelet's device-plugins
// directory and registers it with kubelet. Stop ends it.
func Start(ctx context.Context, devicePluginDir string, gpus []GPU) (*Plugin, error) {
	if len(gpus) == 0 {
		return nil, errors.New("gpuplugin: no GPUs")
	}
	p := &Plugin{gpus: gpus, dir: devicePluginDir, socket: filepath.Join(devicePluginDir, "e2e-nvidia-gpu.sock"), stop: make(chan struct{})}
	_ = os.Remove(p.socket) // a socket a killed run left behind
	l, err := net.Listen("unix", p.socket)
	if err != nil {
		return nil, fmt.Errorf("gpuplugin: %w", err)
	}
	p.srv = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.srv, p)
	go func() { _ = p.srv.Serve(l) }() // ends with Stop
	if err := p.register(ctx); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

func (p *Plugin) register(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+filepath.Join(p.dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("gpuplugin: %w", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: filepath.Base(p.socket), ResourceName: ResourceName,
		Options: &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	if err != nil {
		return fmt.Errorf("gpuplugin: register with kubelet: %w", err)
	}
	return nil
}

// Stop withdraws the plugin: the server stops and its socket goes (kubelet
// then marks the GPUs unhealthy).
func (p *Plugin) Stop() {
	select {
	case <-p.stop:
		return
	default:
	}
	close(p.stop)
	p.srv.Stop()
	_ = os.Remove(p.socket)
}

// GetDevicePluginOptions implements the device plugin API.
func (p *Plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// ListAndWatch sends the GPUs once, all healthy, and holds the stream.
func (p *Plugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	var devs []*pluginapi.Device
	for _, g := range p.gpus {
		d := &pluginapi.Device{ID: g.UUID, Health: pluginapi.Healthy}
		if g.NUMA >= 0 {
			d.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(g.NUMA)}}}
		}
		devs = append(devs, d)
	}
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
		return err
	}
	select {
	case <-p.stop:
	case <-s.Context().Done():
	}
	return nil
}

// Allocate gives each container NVIDIA_VISIBLE_DEVICES: its GPUs' UUIDs,
// comma-separated, in the order kubelet names them.
func (p *Plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, cr := range req.GetContainerRequests() {
		for _, id := range cr.GetDevicesIds() {
			if !slices.ContainsFunc(p.gpus, func(g GPU) bool { return g.UUID == id }) {
				return nil, fmt.Errorf("gpuplugin: unknown device %q", id)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(cr.GetDevicesIds(), ",")},
		})
	}
	return resp, nil
}

// GetPreferredAllocation prefers the must-include GPUs, then GPUs on their
// NUMA nodes, then the rest in the order advertised.
func (p *Plugin) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	numa := map[string]int{}
	for _, g := range p.gpus {
		numa[g.UUID] = g.NUMA
	}
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, cr := range req.GetContainerRequests() {
		out := slices.Clone(cr.GetMustIncludeDeviceIDs())
		nodes := map[int]bool{}
		for _, id := range out {
			nodes[numa[id]] = true
		}
		avail := cr.GetAvailableDeviceIDs()
		for _, near := range []bool{true, false} {
			for _, id := range avail {
				if len(out) < int(cr.GetAllocationSize()) && !slices.Contains(out, id) && (!near || nodes[numa[id]]) {
					out = append(out, id)
				}
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: out})
	}
	return resp, nil
}

// PreStartContainer is not required (DevicePluginOptions says so).
func (p *Plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
