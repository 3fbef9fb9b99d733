package chart_test

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// The default affinity selects GPU nodes by either label: NVIDIA GPU
// Feature Discovery's or Node Feature Discovery's PCI vendor label.
func TestDefaultAffinityMatchesGFDOrNFD(t *testing.T) {
	ds := renderSet(t, defaults()).ds
	a := ds.Spec.Template.Spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		t.Fatalf("no required node affinity: %+v", a)
	}
	var keys []string
	for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		if len(term.MatchExpressions) != 1 {
			t.Fatalf("term %+v: want one expression per term (terms are ORed)", term)
		}
		e := term.MatchExpressions[0]
		if e.Operator != corev1.NodeSelectorOpIn || !slices.Equal(e.Values, []string{"true"}) {
			t.Errorf("expression %+v, want In [true]", e)
		}
		keys = append(keys, e.Key)
	}
	if want := []string{"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}; !slices.Equal(keys, want) {
		t.Errorf("affinity keys %v, want %v", keys, want)
	}
	if len(ds.Spec.Template.Spec.NodeSelector) != 0 {
		t.Errorf("default nodeSelector %v would AND with the affinity", ds.Spec.Template.Spec.NodeSelector)
	}
	// {} runs everywhere.
	vs := defaults()
	vs.values = "affinity: null"
	if a := renderSet(t, vs).ds.Spec.Template.Spec.Affinity; a != nil {
		t.Errorf("affinity: null still renders %+v", a)
	}
}

func agentContainer(ds *appsv1.DaemonSet) corev1.Container {
	return ds.Spec.Template.Spec.Containers[0]
}

// What operators override in device-plugin charts reaches the pod, and the
// chart's own settings survive it.
func TestOperatorValues(t *testing.T) {
	vs := defaults()
	vs.values = `
resources:
  requests: {cpu: 250m, ephemeral-storage: 64Mi}
  limits: {cpu: "2"}
podSecurityContext: {seccompProfile: {type: Localhost, localhostProfile: profiles/kvpool.json}}
securityContext:
  runAsUser: 0
  readOnlyRootFilesystem: true
  allowPrivilegeEscalation: false
  capabilities: {drop: [ALL], add: [IPC_LOCK]}
extraEnv:
  - {name: GODEBUG, value: "madvdontneed=1"}
  - name: HOST_IP
    valueFrom: {fieldRef: {fieldPath: status.hostIP}}
extraArgs: ["--log-level=debug"]
simulateGPUs: 2
updateStrategy: {type: RollingUpdate, rollingUpdate: {maxUnavailable: 25%}}
`
	r := renderSet(t, vs)
	c := agentContainer(r.ds)
	want := map[corev1.ResourceName]string{corev1.ResourceCPU: "250m", corev1.ResourceEphemeralStorage: "64Mi", corev1.ResourceMemory: "17200Mi"} // 16Gi, its page tables (32Mi), the page links (16Mi), 512Mi, the spare's 256Mi
	for name, q := range want {
		got := c.Resources.Requests[name]
		if got.Cmp(resource.MustParse(q)) != 0 {
			t.Errorf("requests.%s = %s, want %s", name, got.String(), q)
		}
	}
	if got := c.Resources.Limits[corev1.ResourceCPU]; got.Cmp(resource.MustParse("2")) != 0 {
		t.Errorf("limits.cpu = %s", got.String())
	}
	if got := c.Resources.Limits[corev1.ResourceMemory]; got.Cmp(resource.MustParse("17200Mi")) != 0 {
		t.Errorf("limits.memory = %s: the chart must still set it from the pool", got.String())
	}
	if sc := r.ds.Spec.Template.Spec.SecurityContext; sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeLocalhost {
		t.Errorf("podSecurityContext not applied: %+v", sc)
	}
	if sc := c.SecurityContext; sc == nil || sc.Capabilities == nil || !reflect.DeepEqual(sc.Capabilities.Add, []corev1.Capability{"IPC_LOCK"}) {
		t.Errorf("securityContext not applied: %+v", sc)
	}
	env := map[string]corev1.EnvVar{}
	var order []string
	for _, e := range c.Env {
		env[e.Name] = e
		order = append(order, e.Name)
	}
	if env["GODEBUG"].Value != "madvdontneed=1" || env["HOST_IP"].ValueFrom == nil || env["NODE_NAME"].ValueFrom == nil {
		t.Errorf("env %v lacks extraEnv or the chart's own", order)
	}
	if slices.Index(order, "GODEBUG") < slices.Index(order, "NODE_NAME") {
		t.Errorf("extraEnv must come after the chart's variables: %v", order)
	}
	if want := []string{"--config=/etc/kvpool/agent.yaml", "--simulate-gpus=2", "--log-level=debug"}; !slices.Equal(c.Args, want) {
		t.Errorf("args %v, want %v", c.Args, want)
	}
	if mu := r.ds.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable; mu.String() != "25%" {
		t.Errorf("maxUnavailable %s", mu.String())
	}
	// Defaults: no simulated GPUs, no extra arguments.
	if args := agentContainer(renderSet(t, defaults()).ds).Args; slices.ContainsFunc(args, func(a string) bool { return strings.Contains(a, "simulate") }) || len(args) != 1 {
		t.Errorf("default args %v", args)
	}
	// OnDelete: no rollingUpdate block.
	od := defaults()
	od.values = "updateStrategy: {type: OnDelete}"
	if us := renderSet(t, od).ds.Spec.UpdateStrategy; us.Type != appsv1.OnDeleteDaemonSetStrategyType || us.RollingUpdate != nil {
		t.Errorf("OnDelete renders %+v", us)
	}
}

// The PodMonitor scrapes the agent pods and names the node in every series.
func TestPodMonitor(t *testing.T) {
	vs := defaults()
	vs.values = `metrics: {podMonitor: {enabled: true, labels: {release: prom}, relabelings: [{action: labeldrop, regex: pod}]}}`
	r := renderSet(t, vs)
	var pm map[string]any
	for _, o := range r.objs {
		if o.kind == "PodMonitor" {
			pm = o.fields
		}
	}
	if pm == nil {
		t.Fatal("podMonitor.enabled but no PodMonitor")
	}
	md := pm["metadata"].(map[string]any)
	if md["labels"].(map[string]any)["release"] != "prom" {
		t.Errorf("labels %v", md["labels"])
	}
	spec := pm["spec"].(map[string]any)
	sel := spec["selector"].(map[string]any)["matchLabels"].(map[string]any)
	for k, v := range sel {
		if r.ds.Spec.Template.Labels[k] != v {
			t.Errorf("PodMonitor selects %s=%v, the agent pods have %q", k, v, r.ds.Spec.Template.Labels[k])
		}
	}
	ep := spec["podMetricsEndpoints"].([]any)[0].(map[string]any)
	if ep["port"] != "metrics" || ep["path"] != "/metrics" {
		t.Errorf("endpoint %v", ep)
	}
	rl := ep["relabelings"].([]any)
	first := rl[0].(map[string]any)
	if first["targetLabel"] != "node" || !reflect.DeepEqual(first["sourceLabels"], []any{"__meta_kubernetes_pod_node_name"}) {
		t.Errorf("first relabeling %v, want the pod's node name into node", first)
	}
	if len(rl) != 2 || rl[1].(map[string]any)["action"] != "labeldrop" {
		t.Errorf("user relabelings not appended: %v", rl)
	}
	if ports := agentContainer(r.ds).Ports; ports[0].Name != "metrics" {
		t.Errorf("the agent's port is %q, the PodMonitor scrapes \"metrics\"", ports[0].Name)
	}
	for _, o := range renderSet(t, defaults()).objs {
		if o.kind == "PodMonitor" {
			t.Error("PodMonitor rendered by default")
		}
	}
}
