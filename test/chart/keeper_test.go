package chart_test

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

const keeperDir = "/var/lib/kvpool/keeper"

func envOf(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// TestKeeper: the keeper DaemonSet holds the pool across agent upgrades: it
// never rolls (OnDelete), keeps its own image, shares the socket directory
// with the agent, and runs with IPC_LOCK alone; disabled, nothing of it is
// rendered and the agent gets no keeper socket.
func TestKeeper(t *testing.T) {
	r := renderSet(t, valueSet{})
	k := r.keeper
	if k == nil {
		t.Fatal("no keeper DaemonSet by default")
	}
	if k.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("keeper updateStrategy %q, want OnDelete: an upgrade must not restart it", k.Spec.UpdateStrategy.Type)
	}
	spec := k.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("keeper containers: %d", len(spec.Containers))
	}
	c := spec.Containers[0]
	sock := keeperDir + "/keeper.sock"
	if !slices.Equal(c.Args[:2], []string{"keeper", "--socket=" + sock}) {
		t.Errorf("keeper args %q", c.Args)
	}
	if got, ok := envOf(r.ds.Spec.Template.Spec.Containers[0], "KVPOOL_KEEPER_SOCKET"); !ok || got != sock {
		t.Errorf("agent KVPOOL_KEEPER_SOCKET %q (%v), want %q", got, ok, sock)
	}
	if agentImage := r.ds.Spec.Template.Spec.Containers[0].Image; c.Image != agentImage || !strings.HasSuffix(c.Image, ":"+chartAppVersion(t)) {
		t.Errorf("keeper image %q: want the agent's (%q, the chart's appVersion by default) at first install", c.Image, agentImage)
	}
	// A tag set for the agent is the keeper's too at first install (an
	// image built for this node, as the e2e stage does).
	tagged := renderSet(t, valueSet{values: "image: {repository: kvpool.local/kvpool-agent, tag: e2e-1}"})
	if img := tagged.keeper.Spec.Template.Spec.Containers[0].Image; img != "kvpool.local/kvpool-agent:e2e-1" {
		t.Errorf("image.tag e2e-1: keeper image %q, want the agent's", img)
	}
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Add, []corev1.Capability{"IPC_LOCK"}) || !slices.Contains(sc.Capabilities.Drop, "ALL") ||
		sc.Privileged == nil || *sc.Privileged || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("keeper security context %+v: want IPC_LOCK alone (it holds the pool's lock), unprivileged, read-only root", sc)
	}
	// Its memory: keeper.memory and the page tables of its mapping of the
	// pool (8 bytes a 4 KiB page), nothing more with huge pages.
	for _, tc := range []struct {
		values string
		want   int64
	}{
		{"", 32<<20 + 16<<30/512},
		{"pool: {bytes: 64Gi}\nkeeper: {memory: 16Mi}", 16<<20 + 64<<30/512},
		{"pool: {hugePages: 2Mi}", 32 << 20},
	} {
		kc := renderSet(t, valueSet{values: tc.values}).keeper.Spec.Template.Spec.Containers[0]
		req, lim := kc.Resources.Requests[corev1.ResourceMemory], kc.Resources.Limits[corev1.ResourceMemory]
		if req.Value() != tc.want || lim.Value() != tc.want {
			t.Errorf("values %q: keeper memory request %s, limit %s; want %d bytes", tc.values, req.String(), lim.String(), tc.want)
		}
	}
	if len(c.VolumeMounts) != 1 || c.VolumeMounts[0].MountPath != keeperDir || len(spec.Volumes) != 1 ||
		spec.Volumes[0].HostPath == nil || spec.Volumes[0].HostPath.Path != keeperDir {
		t.Errorf("keeper mounts %+v volumes %+v", c.VolumeMounts, spec.Volumes)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the keeper needs no API access; its token must not be mounted")
	}
	if !slices.Equal(keys(k.Spec.Selector.MatchLabels), keys(k.Spec.Template.Labels)) ||
		k.Spec.Selector.MatchLabels["app.kubernetes.io/component"] != "keeper" {
		t.Errorf("keeper selector %v, template labels %v", k.Spec.Selector.MatchLabels, k.Spec.Template.Labels)
	}
	// The agent's selector must not select keeper pods.
	for key, v := range r.ds.Spec.Selector.MatchLabels {
		if k.Spec.Template.Labels[key] != v {
			return
		}
	}
	if len(r.ds.Spec.Selector.MatchLabels) > 0 {
		t.Error("the agent DaemonSet's selector matches the keeper's pods")
	}

	pinned := renderSet(t, valueSet{values: "keeper: {image: {tag: v9.9.9}}"})
	if img := pinned.keeper.Spec.Template.Spec.Containers[0].Image; !strings.HasSuffix(img, ":v9.9.9") {
		t.Errorf("keeper.image.tag: image %q", img)
	}

	off := renderSet(t, valueSet{values: "keeper: {enabled: false}"})
	if off.keeper != nil {
		t.Error("keeper rendered with keeper.enabled false")
	}
	if _, ok := envOf(off.ds.Spec.Template.Spec.Containers[0], "KVPOOL_KEEPER_SOCKET"); ok {
		t.Error("agent given a keeper socket with keeper.enabled false")
	}
}

func chartAppVersion(t *testing.T) string {
	t.Helper()
	var c struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(readFile(t, "charts/kvpool/Chart.yaml"), &c); err != nil || c.AppVersion == "" {
		t.Fatalf("Chart.yaml appVersion: %q %v", c.AppVersion, err)
	}
	return c.AppVersion
}
