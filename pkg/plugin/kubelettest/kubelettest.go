// Package kubelettest stands in for kubelet in tests: a Registration server
// that, like kubelet's device manager, dials a registering plugin and
// consumes its ListAndWatch stream, and a PodResources v1 server with a
// settable table. Both speak kubelet's real gRPC API on Unix sockets.
package kubelettest

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Kubelet stands in for kubelet's device manager: it serves the
// Registration service on kubelet.sock in dir and, on Register, dials the
// plugin's endpoint and consumes its ListAndWatch stream. Restart behaves as
// kubelet does: it removes every socket in the directory and starts again.
type Kubelet struct {
	t   testing.TB
	Dir string

	pluginapi.UnimplementedRegistrationServer

	mu      sync.Mutex
	srv     *grpc.Server
	cancel  context.CancelFunc
	ctx     context.Context
	regs    chan *pluginapi.RegisterRequest
	lists   chan []*pluginapi.Device
	clients []*grpc.ClientConn
	plugin  pluginapi.DevicePluginClient
}

// NewKubelet serves kubelet.sock in dir until the test ends.
func NewKubelet(t testing.TB, dir string) *Kubelet {
	k := &Kubelet{t: t, Dir: dir, regs: make(chan *pluginapi.RegisterRequest, 16), lists: make(chan []*pluginapi.Device, 64)}
	k.Start()
	t.Cleanup(k.Stop)
	return k
}

// Start serves kubelet.sock again.
func (k *Kubelet) Start() {
	k.mu.Lock()
	defer k.mu.Unlock()
	lis, err := net.Listen("unix", filepath.Join(k.Dir, "kubelet.sock"))
	if err != nil {
		k.t.Fatalf("test kubelet: %v", err)
	}
	k.ctx, k.cancel = context.WithCancel(context.Background())
	k.srv = grpc.NewServer()
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(lis) }() // ends with Stop at clean-up
}

// Stop stops serving and drops the connections to plugins.
func (k *Kubelet) Stop() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.srv == nil {
		return
	}
	k.cancel()
	k.srv.Stop()
	for _, c := range k.clients {
		c.Close()
	}
	k.srv, k.clients, k.plugin = nil, nil, nil
}

// Restart stops, removes every socket in the directory (kubelet's device
// manager does this at start) and serves a new kubelet.sock.
func (k *Kubelet) Restart() {
	k.Stop()
	ents, err := os.ReadDir(k.Dir)
	if err != nil {
		k.t.Fatal(err)
	}
	for _, e := range ents {
		os.Remove(filepath.Join(k.Dir, e.Name()))
	}
	k.Start()
}

// Register implements the Registration service.
func (k *Kubelet) Register(_ context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.Dir, req.Endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	k.clients = append(k.clients, conn)
	client := pluginapi.NewDevicePluginClient(conn)
	k.plugin = client
	ctx := k.ctx
	go func() {
		stream, err := client.ListAndWatch(ctx, &pluginapi.Empty{})
		if err != nil {
			return
		}
		for {
			resp, err := stream.Recv()
			if err != nil {
				return
			}
			select {
			case k.lists <- resp.Devices:
			case <-ctx.Done():
				return
			}
		}
	}()
	k.regs <- req
	return &pluginapi.Empty{}, nil
}

// Client is a client of the last registered plugin.
func (k *Kubelet) Client() pluginapi.DevicePluginClient {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.plugin
}

// WaitRegister returns the next registration, failing the test after within.
func (k *Kubelet) WaitRegister(within time.Duration) *pluginapi.RegisterRequest {
	k.t.Helper()
	select {
	case r := <-k.regs:
		return r
	case <-time.After(within):
		k.t.Fatalf("no registration within %v", within)
		return nil
	}
}

// WaitList returns the first list received for which ok holds.
func (k *Kubelet) WaitList(ok func([]*pluginapi.Device) bool) []*pluginapi.Device {
	k.t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case l := <-k.lists:
			if ok(l) {
				return l
			}
		case <-deadline:
			k.t.Fatal("no matching ListAndWatch update within 10s")
			return nil
		}
	}
}

// PodResources serves PodResources v1 List from a settable table.
type PodResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	mu      sync.Mutex
	pods    []*podresourcesv1.PodResources
	fail    error
	gate    chan struct{} // while not nil, List waits for it to close
	waiting chan struct{} // a List that waits at the gate sends here (non-blocking)
}

// NewPodResources serves PodResources v1 on socket until the test ends.
func NewPodResources(t testing.TB, socket string) *PodResources {
	s := &PodResources{}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, s)
	go func() { _ = srv.Serve(lis) }() // ends with Stop at clean-up
	t.Cleanup(srv.Stop)
	return s
}

// List implements the PodResources service.
func (s *PodResources) List(ctx context.Context, _ *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	s.mu.Lock()
	gate, waiting := s.gate, s.waiting
	s.mu.Unlock()
	if gate != nil {
		select {
		case waiting <- struct{}{}:
		default:
		}
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return nil, s.fail
	}
	return &podresourcesv1.ListPodResourcesResponse{PodResources: s.pods}, nil
}

// SetPods replaces the table: pod name → resource → device IDs.
func (s *PodResources) SetPods(pods map[string]map[string][]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pods = nil
	for name, res := range pods {
		ctr := &podresourcesv1.ContainerResources{Name: "main"}
		for r, ids := range res {
			ctr.Devices = append(ctr.Devices, &podresourcesv1.ContainerDevices{ResourceName: r, DeviceIds: ids})
		}
		s.pods = append(s.pods, &podresourcesv1.PodResources{Name: name, Namespace: "default", Containers: []*podresourcesv1.ContainerResources{ctr}})
	}
}

// SetFail makes List fail with err (nil: succeed again).
func (s *PodResources) SetFail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = err
}

// Block makes every List wait (as a stuck kubelet would) until release is
// called; release may be called more than once. Blocked returns a channel
// that receives once for each List that starts waiting (when nobody is
// receiving, the signal is dropped).
func (s *PodResources) Block() (release func(), blocked <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gate, waiting := make(chan struct{}), make(chan struct{}, 16)
	s.gate, s.waiting = gate, waiting
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			if s.gate == gate {
				s.gate, s.waiting = nil, nil
			}
			s.mu.Unlock()
			close(gate)
		})
	}, waiting
}
