package dra

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// dial connects to a Unix socket as kubelet does.
func dial(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// shortTemp is a directory short enough for Unix socket paths.
func shortTemp(t *testing.T) string {
	d, err := os.MkdirTemp("", "kvd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// The driver as kubelet and the API server see it, with the helper's own
// registration and DRA gRPC servers and the ResourceSlice controller over
// a fake clientset: kubelet finds the registration socket, asks for the
// info and registers it; the node's slices appear and follow the chunks;
// NodePrepareResources fetches the claim from the API and answers with the
// CDI device; NodeUnprepareResources (UID only) ends it, and the slices
// offer the chunks again once they are renewed.
func TestDriverWithKubelet(t *testing.T) {
	e := newEnv(t)
	kubelet := shortTemp(t)
	for _, d := range []string{"plugins_registry"} {
		if err := os.MkdirAll(filepath.Join(kubelet, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	claim := claimWith(uid1, shareResult("kv", 0, 2*chunkSz))
	cs := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, UID: "node-uid"}}, claim)
	// The fake has no generateName; the API server would name the slices.
	var made atomic.Int64
	cs.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		s := a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		if s.Name == "" {
			s.Name = fmt.Sprintf("%s%d", s.GenerateName, made.Add(1))
		}
		return false, nil, nil
	})
	d, err := New(Options{DriverName: DefaultDriverName, NodeName: node, KubeClient: cs, KubeletDir: kubelet,
		CDIDir: filepath.Join(e.root, "cdi"), SocketDir: "/run/kvpool-test", GPUs: testGPUs(),
		Ledger: e.p, Chunks: e.chunks, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	// Two chunks of GPU 1 are still being pinned at start.
	e.chunks.set(testChunks()[:6])
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := d.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer d.Stop()

	// Registration, as kubelet's plugin watcher does it.
	reg := registerapi.NewRegistrationClient(dial(t, filepath.Join(kubelet, "plugins_registry", DefaultDriverName+"-reg.sock")))
	var info *registerapi.PluginInfo
	waitFor(t, "the registration socket answers", func() bool {
		info, err = reg.GetInfo(ctx, &registerapi.InfoRequest{})
		return err == nil
	})
	if info.Type != registerapi.DRAPlugin || info.Name != DefaultDriverName || info.Endpoint != filepath.Join(d.PluginDir(), "dra.sock") ||
		!slices.Contains(info.SupportedVersions, drapb.DRAPluginService) {
		t.Errorf("plugin info %+v", info)
	}
	if d.Registered() {
		t.Error("registered before kubelet said so")
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	if !d.Registered() {
		t.Error("not registered after kubelet's notification")
	}

	// The node's slices: 2 counter sets and 10 devices, owned by the Node.
	slicesNow := func() (devices int, shares map[string]int64) {
		list, err := cs.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		shares = map[string]int64{}
		for _, s := range list.Items {
			if s.Spec.Driver != DefaultDriverName || s.Spec.NodeName == nil || *s.Spec.NodeName != node || s.Spec.Pool.Name != node ||
				len(s.OwnerReferences) != 1 || s.OwnerReferences[0].Kind != "Node" || s.OwnerReferences[0].UID != "node-uid" {
				t.Fatalf("slice %s: %+v %+v", s.Name, s.Spec, s.OwnerReferences)
			}
			for _, dev := range s.Spec.Devices {
				devices++
				if dev.Name == ShareDevice(0) || dev.Name == ShareDevice(1) {
					q := dev.Capacity[CapMemory].Value
					shares[dev.Name] = q.Value()
				}
			}
		}
		return devices, shares
	}
	waitFor(t, "the slices published", func() bool { n, shares := slicesNow(); return n == 8 && shares["gpu1-share"] == 2*chunkSz })
	// Capacity grows as chunks are pinned.
	e.chunks.set(testChunks())
	waitFor(t, "the slices grown", func() bool { n, shares := slicesNow(); return n == 10 && shares["gpu1-share"] == 4*chunkSz })

	// kubelet prepares the claim: the helper reads it from the API.
	plug := drapb.NewDRAPluginClient(dial(t, filepath.Join(d.PluginDir(), "dra.sock")))
	pr, err := plug.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: claim.Namespace, Name: claim.Name, Uid: string(claim.UID)}}})
	if err != nil {
		t.Fatal(err)
	}
	got := pr.Claims[uid1]
	if got == nil || got.Error != "" || len(got.Devices) != 1 || got.Devices[0].DeviceName != "gpu0-share" ||
		!slices.Equal(got.Devices[0].CdiDeviceIds, []string{"kvpool.io/host-kv=" + uid1 + "-kv"}) || got.Devices[0].GetShareId() == "" {
		t.Fatalf("NodePrepareResources: %+v", pr)
	}
	if !e.specExists(uid1) {
		t.Error("no CDI spec after NodePrepareResources")
	}
	// Slices do not change for a grant (a claim's chunks stay offered).
	if _, shares := slicesNow(); shares["gpu0-share"] != 4*chunkSz {
		t.Errorf("share capacity after the grant: %v", shares)
	}

	// Unprepare: the chunks renew; meanwhile they are not offered. Hold the
	// renewals to see it.
	e.renewMu.Lock()
	ur, err := plug.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: claim.Namespace, Name: claim.Name, Uid: string(claim.UID)}}})
	if err != nil || ur.Claims[uid1] == nil || ur.Claims[uid1].Error != "" {
		e.renewMu.Unlock()
		t.Fatalf("NodeUnprepareResources: %+v, %v", ur, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, shares := slicesNow()
		if n == 8 && shares["gpu0-share"] == 2*chunkSz {
			break
		}
		if time.Now().After(deadline) {
			e.renewMu.Unlock()
			t.Fatalf("renewing chunks still offered: %d devices, shares %v", n, shares)
		}
		time.Sleep(10 * time.Millisecond)
	}
	e.renewMu.Unlock()
	waitFor(t, "the renewed chunks offered again", func() bool {
		n, shares := slicesNow()
		return n == 10 && shares["gpu0-share"] == 4*chunkSz
	})
	if e.specExists(uid1) {
		t.Error("CDI spec left after NodeUnprepareResources")
	}
	// A claim the API does not know: the helper fails the call.
	if _, err := plug.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: "ns", Name: "gone", Uid: uid2}}}); err == nil {
		t.Error("NodePrepareResources of a claim the API does not have succeeded")
	}
}
