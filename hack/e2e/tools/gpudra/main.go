// Command gpudra is a test-only DRA driver for the e2e node's simulated
// GPUs: it publishes them the way NVIDIA's DRA driver (gpu.nvidia.com)
// publishes full GPUs, so that claims can align kvpool's host KV with a
// GPU as they would on a real node. Devices gpu-<i> carry type "gpu",
// uuid, productName, brand, the standard resource.kubernetes.io/pciBusID
// and resource.kubernetes.io/pcieRoot (and, with -numa, numaNode, which
// NVIDIA's driver does not publish for full GPUs), and capacity memory.
//
// The GPUs are the agent's --simulate-gpus N: UUID GPU-sim-%08d and the
// PCI addresses of internal/gpu.SimulatedPCI (pairs behind one root
// complex). Prepare gives each container of a claim's GPU the CDI edits
// NVIDIA_VISIBLE_DEVICES=<uuid> and KVCLIENT_GPU=<index> (kvclient's GPU);
// no device node (there is none). It keeps no state: a claim's CDI spec,
// named by its UID, is all Unprepare removes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig")
	node := flag.String("node", "", "node name")
	gpus := flag.Int("gpus", 2, "simulated GPUs (the agent's --simulate-gpus)")
	driver := flag.String("driver", "gpu.nvidia.com", "driver name")
	kubeletDir := flag.String("kubelet-dir", "/var/lib/kubelet", "kubelet root directory")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "CDI spec directory")
	numa := flag.Int("numa", -1, "publish resource.kubernetes.io/numaNode with this node for every GPU (-1: none, as NVIDIA's driver)")
	flag.Parse()
	if *node == "" {
		log.Fatal("gpudra: -node is required")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Fatalf("gpudra: kubeconfig: %v", err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Fatalf("gpudra: %v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	d := &gpuDriver{name: *driver, cdiDir: *cdiDir, gpus: *gpus}
	pluginDir := filepath.Join(*kubeletDir, "plugins", *driver)
	if err := os.MkdirAll(pluginDir, 0o750); err != nil {
		log.Fatalf("gpudra: %v", err)
	}
	h, err := kubeletplugin.Start(ctx, d, kubeletplugin.DriverName(*driver), kubeletplugin.NodeName(*node),
		kubeletplugin.KubeClient(cs), kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.RegistrarDirectoryPath(filepath.Join(*kubeletDir, "plugins_registry")), kubeletplugin.HealthService(false))
	if err != nil {
		log.Fatalf("gpudra: start: %v", err)
	}
	if err := h.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		*node: {Slices: []resourceslice.Slice{{Devices: devices(*gpus, *numa)}}}}}); err != nil {
		log.Fatalf("gpudra: publish: %v", err)
	}
	log.Printf("gpudra: serving %d simulated GPUs as driver %s on node %s", *gpus, *driver, *node)
	<-ctx.Done()
	h.Stop()
	log.Printf("gpudra: stopped")
}

// simulatedPCI is internal/gpu.SimulatedPCI (this module cannot import the
// agent's packages): pair p = i/2 behind root bus 0x10*(p%15+1) of domain
// p/15; the pair's GPUs on the next two buses.
func simulatedPCI(i int) (busID, pcieRoot string) {
	p := i / 2
	domain, root := p/15, 0x10*(p%15+1)
	return fmt.Sprintf("%04x:%02x:00.0", domain, root+1+i%2), fmt.Sprintf("pci%04x:%02x", domain, root)
}

func uuid(i int) string { return fmt.Sprintf("GPU-sim-%08d", i) }

func devices(n, numa int) []resourceapi.Device {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: ptr.To(s)} }
	var out []resourceapi.Device
	for i := range n {
		bus, root := simulatedPCI(i)
		attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": str("gpu"), "uuid": str(uuid(i)), "productName": str("kvpool simulated GPU"), "brand": str("Nvidia"),
			"resource.kubernetes.io/pciBusID": str(bus), "resource.kubernetes.io/pcieRoot": str(root),
		}
		if numa >= 0 {
			attrs["resource.kubernetes.io/numaNode"] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(numa))}
		}
		out = append(out, resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i), Attributes: attrs,
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("80Gi")}}})
	}
	return out
}

type gpuDriver struct {
	name, cdiDir string
	gpus         int
}

func (d *gpuDriver) specPath(uid types.UID) string {
	return filepath.Join(d.cdiDir, d.name+"_"+string(uid)+".json")
}

func (d *gpuDriver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, c := range claims {
		out[c.UID] = d.prepare(c)
	}
	return out, nil
}

func (d *gpuDriver) prepare(c *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	spec := cdispec.Spec{Version: "0.6.0", Kind: d.name + "/gpu"}
	var devs []kubeletplugin.Device
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != d.name {
			continue
		}
		var i int
		if _, err := fmt.Sscanf(r.Device, "gpu-%d", &i); err != nil || i < 0 || i >= d.gpus {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("unknown device %s", r.Device)}
		}
		name := string(c.UID) + "-" + r.Device
		spec.Devices = append(spec.Devices, cdispec.Device{Name: name, ContainerEdits: cdispec.ContainerEdits{
			Env: []string{"NVIDIA_VISIBLE_DEVICES=" + uuid(i), fmt.Sprintf("KVCLIENT_GPU=%d", i)}}})
		devs = append(devs, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{spec.Kind + "=" + name}})
	}
	data, err := json.Marshal(spec)
	if err == nil {
		err = os.MkdirAll(d.cdiDir, 0o755)
	}
	if err == nil {
		tmp := d.specPath(c.UID) + ".tmp"
		if err = os.WriteFile(tmp, data, 0o644); err == nil {
			err = os.Rename(tmp, d.specPath(c.UID))
		}
	}
	if err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	log.Printf("gpudra: prepared claim %s/%s: %d GPUs", c.Namespace, c.Name, len(devs))
	return kubeletplugin.PrepareResult{Devices: devs}
}

func (d *gpuDriver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := map[types.UID]error{}
	for _, c := range claims {
		err := os.Remove(d.specPath(c.UID))
		if errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		out[c.UID] = err
	}
	return out, nil
}

func (d *gpuDriver) HandleError(_ context.Context, err error, msg string) {
	log.Printf("gpudra: %s: %v", msg, err)
}

func (d *gpuDriver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
