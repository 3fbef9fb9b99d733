package chart_test

import (
	"fmt"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/action"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

// valueSet is one way to install the chart, with what it must produce.
type valueSet struct {
	name   string
	values string // YAML, as a user would pass with -f

	pool, headroom string // what memory (and huge pages) must add up to
	noSpare        bool   // no spare reads the books ahead: no memory for it
	hugePages      string // "" or the page size
	resourceName   string
	socketDir      string
	kubeletDir     string
	stateDir       string
	serviceMonitor bool
	dashboard      bool
	rbac           bool
	tokenBinding   string // security.tokenBinding
	netPolicy      bool
	tolerations    []corev1.Toleration
	nodeSelector   map[string]string
	mode           string // "devicePlugin" or "dra"
	cdiDir         string // mode dra
}

func defaults() valueSet {
	return valueSet{
		pool: "16Gi", headroom: "512Mi",
		resourceName: "kvpool.io/host-kv",
		socketDir:    "/var/lib/kvpool/sock",
		kubeletDir:   "/var/lib/kubelet",
		stateDir:     "/var/lib/kvpool/state",
		rbac:         true,
		tokenBinding: "pod",
		mode:         "devicePlugin",
		cdiDir:       "/var/run/cdi",
		tolerations: []corev1.Toleration{
			{Key: "nvidia.com/gpu", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
		},
	}
}

func valueSets() []valueSet {
	def := defaults()
	def.name = "defaults"

	hp2 := defaults()
	hp2.name = "hugepages-2Mi"
	hp2.values = "pool: {bytes: 32Gi, hugePages: 2Mi}"
	hp2.pool, hp2.hugePages = "32Gi", "2Mi"

	hp1 := defaults()
	hp1.name = "hugepages-1Gi"
	hp1.values = "pool: {bytes: 96Gi, headroom: 1Gi, hugePages: 1Gi}"
	hp1.pool, hp1.headroom, hp1.hugePages = "96Gi", "1Gi", "1Gi"

	custom := defaults()
	custom.name = "custom-resource-and-paths"
	custom.values = `
resourceName: example.com/kv-cache
pool: {bytes: 100G, headroom: 300M}
paths: {socketDir: /run/kv/sock, kubeletDir: /data/kubelet/, stateDir: /data/kvpool}
`
	custom.resourceName = "example.com/kv-cache"
	custom.pool, custom.headroom = "100G", "300M"
	custom.socketDir, custom.kubeletDir, custom.stateDir = "/run/kv/sock", "/data/kubelet", "/data/kvpool"

	sm := defaults()
	sm.name = "servicemonitor"
	sm.values = "metrics: {serviceMonitor: {enabled: true, labels: {release: prometheus}}}"
	sm.serviceMonitor = true

	dash := defaults()
	dash.name = "grafana-dashboard"
	dash.values = "grafanaDashboard: {enabled: true}"
	dash.dashboard = true

	tol := defaults()
	tol.name = "custom-tolerations"
	tol.values = `
nodeSelector: {node.kubernetes.io/instance-type: p5.48xlarge}
tolerations:
  - {key: dedicated, operator: Equal, value: inference, effect: NoSchedule}
  - {key: nvidia.com/gpu, operator: Exists, effect: NoExecute}
`
	tol.tolerations = []corev1.Toleration{
		{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "inference", Effect: corev1.TaintEffectNoSchedule},
		{Key: "nvidia.com/gpu", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
	}
	tol.nodeSelector = map[string]string{"node.kubernetes.io/instance-type": "p5.48xlarge"}

	norbac := defaults()
	norbac.name = "existing-service-account"
	norbac.values = "serviceAccount: {create: false, name: kv-agent}\nrbac: {create: false}"
	norbac.rbac = false

	open := defaults()
	open.name = "no-token-binding-with-network-policy"
	open.values = `
security:
  tokenBinding: none
  goMemLimitPercent: 50
  networkPolicy:
    enabled: true
    metricsFrom: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]
    healthFrom: [{ipBlock: {cidr: 10.0.0.0/16}}]
`
	open.tokenBinding, open.netPolicy = "none", true

	dra := defaults()
	dra.name = "dra"
	dra.values = "mode: dra"
	dra.mode = "dra"

	draCustom := defaults()
	draCustom.name = "dra-custom-paths"
	draCustom.values = `
mode: dra
resourceName: example.com/kv-cache
paths: {kubeletDir: /data/kubelet/}
dra: {driverName: kv.example.com, cdiDir: /etc/cdi, deviceClasses: {chunks: kv-chunks.example.com, bytes: kv-bytes.example.com}}
`
	draCustom.mode, draCustom.cdiDir, draCustom.kubeletDir, draCustom.resourceName = "dra", "/etc/cdi", "/data/kubelet", "example.com/kv-cache"

	draNoRBAC := defaults()
	draNoRBAC.name = "dra-existing-service-account"
	draNoRBAC.values = "mode: dra\nserviceAccount: {create: false, name: kv-agent}\nrbac: {create: false}"
	draNoRBAC.mode, draNoRBAC.rbac = "dra", false

	return []valueSet{def, hp2, hp1, custom, sm, dash, tol, norbac, open, dra, draCustom, draNoRBAC}
}

func parseValues(t testing.TB, s string) map[string]any {
	t.Helper()
	vals := map[string]any{}
	if err := yaml.Unmarshal([]byte(s), &vals); err != nil {
		t.Fatalf("values: %v", err)
	}
	return vals
}

// rendered is one rendering, indexed by kind.
type rendered struct {
	objs      []object
	ds        *appsv1.DaemonSet
	keeper    *appsv1.DaemonSet // nil with keeper.enabled false
	cm        *corev1.ConfigMap
	dashboard *corev1.ConfigMap
	sa        *corev1.ServiceAccount
	svc       *corev1.Service
	role      *rbacv1.ClusterRole
	binding   *rbacv1.ClusterRoleBinding
	vap       *admissionv1.ValidatingAdmissionPolicy
	vapb      *admissionv1.ValidatingAdmissionPolicyBinding
	sliceVap  *admissionv1.ValidatingAdmissionPolicy // mode dra
	sliceVapb *admissionv1.ValidatingAdmissionPolicyBinding
	classes   []*resourcev1.DeviceClass
	netpol    *networkingv1.NetworkPolicy
	evRole    *rbacv1.Role
	evBinding *rbacv1.RoleBinding
	serviceMo map[string]any
}

func renderSet(t *testing.T, vs valueSet) rendered {
	t.Helper()
	files, err := render(t, parseValues(t, vs.values))
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	r := rendered{objs: decodeAll(t, files)}
	for _, o := range r.objs {
		if o.typed == nil {
			if o.kind == "ServiceMonitor" {
				r.serviceMo = o.fields
			}
			continue
		}
		switch obj := o.typed.(type) {
		case *appsv1.DaemonSet:
			if strings.HasSuffix(obj.Name, "-keeper") {
				r.keeper = obj
			} else {
				r.ds = obj
			}
		case *corev1.ConfigMap:
			if strings.HasSuffix(obj.Name, "-dashboard") {
				r.dashboard = obj
			} else {
				r.cm = obj
			}
		case *corev1.ServiceAccount:
			r.sa = obj
		case *corev1.Service:
			r.svc = obj
		case *rbacv1.ClusterRole:
			r.role = obj
		case *rbacv1.ClusterRoleBinding:
			r.binding = obj
		case *rbacv1.Role:
			r.evRole = obj
		case *rbacv1.RoleBinding:
			r.evBinding = obj
		case *admissionv1.ValidatingAdmissionPolicy:
			if strings.HasSuffix(obj.Name, "-own-slices") {
				r.sliceVap = obj
			} else {
				r.vap = obj
			}
		case *admissionv1.ValidatingAdmissionPolicyBinding:
			if strings.HasSuffix(obj.Name, "-own-slices") {
				r.sliceVapb = obj
			} else {
				r.vapb = obj
			}
		case *resourcev1.DeviceClass:
			r.classes = append(r.classes, obj)
		case *networkingv1.NetworkPolicy:
			r.netpol = obj
		default:
			t.Errorf("%s: unexpected kind %T", o.source, obj)
		}
	}
	if r.ds == nil || r.cm == nil {
		t.Fatalf("rendering lacks the DaemonSet or the ConfigMap: %d objects", len(r.objs))
	}
	return r
}

func TestRender(t *testing.T) {
	for _, vs := range valueSets() {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			checkNamespaces(t, r)
			checkDaemonSet(t, vs, r.ds)
			checkSecurity(t, r.ds)
			checkMounts(t, vs, r)
			checkProbesAndPorts(t, r.ds)
			checkResources(t, vs, r.ds)
			checkRBAC(t, vs, r)
			checkMonitoring(t, vs, r)
			checkConfig(t, vs, r.cm)
			checkTenantBoundary(t, vs, r)
			checkDRA(t, vs, r)
		})
	}
}

func checkNamespaces(t *testing.T, r rendered) {
	t.Helper()
	for _, o := range r.objs {
		md, _ := o.fields["metadata"].(map[string]any)
		ns, _ := md["namespace"].(string)
		clusterScoped := o.kind == "ClusterRole" || o.kind == "ClusterRoleBinding" ||
			o.kind == "ValidatingAdmissionPolicy" || o.kind == "ValidatingAdmissionPolicyBinding" || o.kind == "DeviceClass"
		// Events about a Node live in "default"; so do the rights to write them.
		eventRights := o.kind == "Role" || o.kind == "RoleBinding"
		switch {
		case clusterScoped && ns != "":
			t.Errorf("%s %s: cluster-scoped object has namespace %q", o.kind, o.name, ns)
		case eventRights && ns != "default":
			t.Errorf("%s %s: namespace %q, want default (where Node events are recorded)", o.kind, o.name, ns)
		case !clusterScoped && !eventRights && ns != namespace:
			t.Errorf("%s %s: namespace %q, want the release namespace %q", o.kind, o.name, ns, namespace)
		}
	}
}

func checkDaemonSet(t *testing.T, vs valueSet, ds *appsv1.DaemonSet) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if got := spec.PriorityClassName; got != "system-node-critical" {
		t.Errorf("priorityClassName = %q", got)
	}
	if len(spec.NodeSelector) != len(vs.nodeSelector) || (len(vs.nodeSelector) > 0 && !reflect.DeepEqual(spec.NodeSelector, vs.nodeSelector)) {
		t.Errorf("nodeSelector = %v, want %v", spec.NodeSelector, vs.nodeSelector)
	}
	if !reflect.DeepEqual(spec.Tolerations, vs.tolerations) {
		t.Errorf("tolerations = %+v, want %+v", spec.Tolerations, vs.tolerations)
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil {
		t.Fatalf("updateStrategy = %+v, want RollingUpdate", us)
	}
	if mu := us.RollingUpdate.MaxUnavailable; mu == nil || mu.String() != "1" {
		t.Errorf("maxUnavailable = %v, want 1", mu)
	}
	if ms := us.RollingUpdate.MaxSurge; ms == nil || ms.String() != "0" {
		t.Errorf("maxSurge = %v, want 0 (two agents must never share a node)", ms)
	}
	if spec.HostNetwork || spec.HostPID != (vs.tokenBinding == "pod") || spec.HostIPC {
		t.Errorf("host namespaces shared: network=%v pid=%v ipc=%v", spec.HostNetwork, spec.HostPID, spec.HostIPC)
	}
	sel := ds.Spec.Selector.MatchLabels
	for k, v := range sel {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod template", k, v)
		}
	}
	if _, ok := ds.Spec.Template.Annotations["checksum/config"]; !ok {
		t.Error("pod template lacks checksum/config: a config change would not roll the agents")
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]
	if !contains(c.Args, "--config=/etc/kvpool/agent.yaml") {
		t.Errorf("args %v do not point the agent at its config file", c.Args)
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	if e, ok := env["NODE_NAME"]; !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("NODE_NAME must come from spec.nodeName, got %+v", e)
	}
	if env["NVIDIA_VISIBLE_DEVICES"].Value != "all" || env["NVIDIA_DRIVER_CAPABILITIES"].Value != "utility" {
		t.Errorf("NVIDIA env = %+v %+v, want all/utility so the runtime injects NVML", env["NVIDIA_VISIBLE_DEVICES"], env["NVIDIA_DRIVER_CAPABILITIES"])
	}
}

func checkSecurity(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if spec.SecurityContext == nil || spec.SecurityContext.SeccompProfile == nil ||
		spec.SecurityContext.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod seccomp profile is not RuntimeDefault: %+v", spec.SecurityContext)
	}
	sc := spec.Containers[0].SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatal("container has no securityContext.capabilities")
	}
	if got, want := capNames(sc.Capabilities.Add), []string{"IPC_LOCK", "SYS_NICE"}; !reflect.DeepEqual(got, want) {
		t.Errorf("capabilities.add = %v, want exactly %v", got, want)
	}
	if got, want := capNames(sc.Capabilities.Drop), []string{"ALL"}; !reflect.DeepEqual(got, want) {
		t.Errorf("capabilities.drop = %v, want exactly %v", got, want)
	}
	mustBool := func(name string, p *bool, want bool) {
		if p == nil || *p != want {
			t.Errorf("securityContext.%s = %v, want %v", name, p, want)
		}
	}
	mustBool("privileged", sc.Privileged, false)
	mustBool("allowPrivilegeEscalation", sc.AllowPrivilegeEscalation, false)
	mustBool("readOnlyRootFilesystem", sc.ReadOnlyRootFilesystem, true)
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Errorf("runAsUser = %v, want 0 (kubelet's sockets are root-only)", sc.RunAsUser)
	}
}

func capNames(cs []corev1.Capability) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = string(c)
	}
	sort.Strings(out)
	return out
}

func checkMounts(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	spec := r.ds.Spec.Template.Spec
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	type want struct {
		hostPath string
		typ      corev1.HostPathType
		readOnly bool
	}
	// Each host path is mounted at the same path in the container, so the
	// socket directory the agent names in Allocate is the host's.
	wantHost := map[string]want{
		vs.kubeletDir + "/pod-resources": {vs.kubeletDir + "/pod-resources", corev1.HostPathDirectory, true},
		vs.socketDir:                     {vs.socketDir, corev1.HostPathDirectoryOrCreate, false},
		vs.stateDir:                      {vs.stateDir, corev1.HostPathDirectoryOrCreate, false},
	}
	if vs.mode == "dra" {
		// The DRA driver's sockets where kubelet looks for them, and the
		// CDI specs where the runtime reads them; no device plugin socket.
		wantHost[vs.kubeletDir+"/plugins"] = want{vs.kubeletDir + "/plugins", corev1.HostPathDirectoryOrCreate, false}
		wantHost[vs.kubeletDir+"/plugins_registry"] = want{vs.kubeletDir + "/plugins_registry", corev1.HostPathDirectory, false}
		wantHost[vs.cdiDir] = want{vs.cdiDir, corev1.HostPathDirectoryOrCreate, false}
	} else {
		wantHost[vs.kubeletDir+"/device-plugins"] = want{vs.kubeletDir + "/device-plugins", corev1.HostPathDirectory, false}
	}
	if vs.tokenBinding == "pod" {
		wantHost["/var/log/pods"] = want{"/var/log/pods", corev1.HostPathDirectory, true}
	}
	if r.keeper != nil {
		wantHost[keeperDir] = want{keeperDir, corev1.HostPathDirectoryOrCreate, false}
	}
	seenHost := map[string]bool{}
	var configMounted, tmpMounted bool
	for _, m := range spec.Containers[0].VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			t.Errorf("mount %s names no volume %q", m.MountPath, m.Name)
			continue
		}
		switch {
		case v.HostPath != nil:
			w, ok := wantHost[m.MountPath]
			if !ok {
				t.Errorf("unexpected hostPath mount %s <- %s", m.MountPath, v.HostPath.Path)
				continue
			}
			seenHost[m.MountPath] = true
			if v.HostPath.Path != w.hostPath || v.HostPath.Type == nil || *v.HostPath.Type != w.typ || m.ReadOnly != w.readOnly {
				t.Errorf("mount %s: hostPath %s type %v readOnly %v, want %s %s %v",
					m.MountPath, v.HostPath.Path, v.HostPath.Type, m.ReadOnly, w.hostPath, w.typ, w.readOnly)
			}
		case v.ConfigMap != nil:
			configMounted = m.MountPath == "/etc/kvpool" && m.ReadOnly && v.ConfigMap.Name == r.cm.Name
		case v.EmptyDir != nil:
			tmpMounted = m.MountPath == "/tmp"
		default:
			t.Errorf("mount %s: unexpected volume source %+v", m.MountPath, v.VolumeSource)
		}
	}
	for p := range wantHost {
		if !seenHost[p] {
			t.Errorf("missing hostPath mount %s", p)
		}
	}
	if !configMounted {
		t.Error("the ConfigMap is not mounted read-only at /etc/kvpool")
	}
	if !tmpMounted {
		t.Error("no writable /tmp (the root filesystem is read-only)")
	}
	if len(volumes) != len(spec.Containers[0].VolumeMounts) {
		t.Errorf("%d volumes but %d mounts: a volume is unused", len(volumes), len(spec.Containers[0].VolumeMounts))
	}
}

func checkProbesAndPorts(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	c := ds.Spec.Template.Spec.Containers[0]
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["metrics"] != 9464 || ports["health"] != 8081 {
		t.Errorf("ports = %v, want metrics 9464 and health 8081", ports)
	}
	probe := func(name string, p *corev1.Probe, path string) {
		if p == nil || p.HTTPGet == nil {
			t.Errorf("%s probe missing or not HTTP", name)
			return
		}
		if p.HTTPGet.Path != path || p.HTTPGet.Port.String() != "health" {
			t.Errorf("%s probe = %s on %s, want %s on the health port", name, p.HTTPGet.Path, p.HTTPGet.Port.String(), path)
		}
	}
	probe("liveness", c.LivenessProbe, "/livez")
	probe("readiness", c.ReadinessProbe, "/readyz")
	probe("startup", c.StartupProbe, "/livez")
}

func checkResources(t *testing.T, vs valueSet, ds *appsv1.DaemonSet) {
	t.Helper()
	res := ds.Spec.Template.Spec.Containers[0].Resources
	pool := resource.MustParse(vs.pool)
	headroom := resource.MustParse(vs.headroom)
	pt := *resource.NewQuantity(pageTables(vs), resource.BinarySI)
	spare := *resource.NewQuantity(spareBytes(vs), resource.BinarySI)
	links := *resource.NewQuantity(linkBytes(pool.Value()), resource.BinarySI)
	wantMemory := headroom.DeepCopy()
	wantMemory.Add(spare)
	wantMemory.Add(links)
	if vs.hugePages == "" {
		wantMemory.Add(pool)
		wantMemory.Add(pt)
	}
	for _, side := range []struct {
		name string
		list corev1.ResourceList
	}{{"requests", res.Requests}, {"limits", res.Limits}} {
		mem, ok := side.list[corev1.ResourceMemory]
		if !ok || mem.Cmp(wantMemory) != 0 {
			t.Errorf("memory %s = %s, want %s (pool %s + its page tables %s + page links %s + headroom %s + the spare's %s, huge pages %q)",
				side.name, mem.String(), wantMemory.String(), vs.pool, pt.String(), links.String(), vs.headroom, spare.String(), vs.hugePages)
		}
		for name, q := range side.list {
			if !strings.HasPrefix(string(name), corev1.ResourceHugePagesPrefix) {
				continue
			}
			if string(name) != corev1.ResourceHugePagesPrefix+vs.hugePages || q.Cmp(pool) != 0 {
				t.Errorf("%s has %s=%s, want %s=%s", side.name, name, q.String(), corev1.ResourceHugePagesPrefix+vs.hugePages, vs.pool)
			}
		}
		if vs.hugePages != "" {
			if _, ok := side.list[corev1.ResourceName(corev1.ResourceHugePagesPrefix+vs.hugePages)]; !ok {
				t.Errorf("%s lack hugepages-%s", side.name, vs.hugePages)
			}
		}
	}
	// Everything the pod reserves adds up to pool plus headroom (and the
	// page tables of a pool of 4 KiB pages, the page links and the
	// spare's), once.
	total := resource.Quantity{}
	for name, q := range res.Limits {
		if name == corev1.ResourceMemory || strings.HasPrefix(string(name), corev1.ResourceHugePagesPrefix) {
			total.Add(q)
		}
	}
	want := pool.DeepCopy()
	want.Add(headroom)
	want.Add(pt)
	want.Add(links)
	want.Add(spare)
	if total.Cmp(want) != 0 {
		t.Errorf("memory plus huge pages = %s, want pool + page tables + page links + headroom + the spare's = %s", total.String(), want.String())
	}
}

// spareBytes is what the chart adds to the agent's memory for a spare
// that reads the books ahead: half the headroom (rounded down).
func spareBytes(vs valueSet) int64 {
	if vs.noSpare {
		return 0
	}
	h := resource.MustParse(vs.headroom)
	return h.Value() / 2
}

// The spare's memory is reserved exactly where a spare reads the books
// ahead: restarts in place on, a spare kept, reading ahead. It is the
// agent's own (kept out of the pool's plan), with 4 KiB pages or huge.
func TestSpareMemory(t *testing.T) {
	for _, c := range []struct {
		name, values string
		spare        bool
	}{
		{"defaults", "", true},
		{"huge pages", "pool: {bytes: 32Gi, hugePages: 2Mi}", true},
		{"no read ahead", "restartInPlace: {readAhead: false}", false},
		{"no spare", "restartInPlace: {spare: false}", false},
		{"no restarts in place", "restartInPlace: {max: 0}", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			vs := defaults()
			vs.values, vs.noSpare = c.values, !c.spare
			if strings.Contains(c.values, "hugePages") {
				vs.pool, vs.hugePages = "32Gi", "2Mi"
			}
			r := renderSet(t, vs)
			checkResources(t, vs, r.ds)
			// sizing.cgroupHeadroomBytes: the headroom and the spare's;
			// restartInPlace.spareMemory: the spare's, which it keeps to.
			checkConfig(t, vs, r.cm)
		})
	}
}

// pageTables is what the chart adds to the agent's and the keeper's memory
// for the page tables of a mapping of the pool: 8 bytes a 4 KiB page,
// rounded up; none with huge pages.
func pageTables(vs valueSet) int64 {
	if vs.hugePages != "" {
		return 0
	}
	pool := resource.MustParse(vs.pool)
	return (pool.Value() + 511) / 512
}

// linkBytes is what the chart adds to the agent's memory for the sessions'
// page links in a pool of b bytes: b/1024 rounded up, at least 16 MiB (the
// agent's default limits.maxPages: pages of 4 KiB over the pool, at least
// 4 Mi of them, 4 bytes each).
func linkBytes(b int64) int64 { return max((b+1023)/1024, 16<<20) }

// clusterRules is every cluster-wide (group, resource, verb) the agent calls:
// its Node, and its KVPoolNode through a client without a cache. The
// ClusterRole must grant exactly these.
var clusterRules = []string{
	"/nodes/get",
	"kvpool.io/kvpoolnodes/get", "kvpool.io/kvpoolnodes/create", "kvpool.io/kvpoolnodes/update",
	"kvpool.io/kvpoolnodes/status/get", "kvpool.io/kvpoolnodes/status/update",
}

// draRules is what the DRA driver adds in mode dra: the ResourceSlice
// controller's informer and writes, and Prepare's read of each claim.
var draRules = []string{
	"resource.k8s.io/resourceslices/get", "resource.k8s.io/resourceslices/list", "resource.k8s.io/resourceslices/watch",
	"resource.k8s.io/resourceslices/create", "resource.k8s.io/resourceslices/update", "resource.k8s.io/resourceslices/delete",
	"resource.k8s.io/resourceclaims/get",
}

// eventRules is what client-go's event recorder calls, in "default".
var eventRules = []string{"/events/create", "/events/patch"}

// grants flattens RBAC rules into group/resource/verb strings, failing on
// wildcards, resource names and non-resource URLs.
func grants(t *testing.T, rules []rbacv1.PolicyRule) []string {
	t.Helper()
	var got []string
	for _, rule := range rules {
		if len(rule.ResourceNames) > 0 || len(rule.NonResourceURLs) > 0 {
			t.Errorf("unexpected rule shape %+v", rule)
		}
		for _, g := range rule.APIGroups {
			for _, res := range rule.Resources {
				for _, v := range rule.Verbs {
					if g == "*" || res == "*" || v == "*" {
						t.Errorf("wildcard in rule %+v", rule)
					}
					got = append(got, g+"/"+res+"/"+v)
				}
			}
		}
	}
	sort.Strings(got)
	return got
}

func sorted(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

func checkRBAC(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	saName := r.ds.Spec.Template.Spec.ServiceAccountName
	if !vs.rbac {
		if r.role != nil || r.binding != nil || r.evRole != nil || r.evBinding != nil || r.sa != nil {
			t.Errorf("rbac.create=false and serviceAccount.create=false still rendered RBAC or a ServiceAccount")
		}
		if saName != "kv-agent" {
			t.Errorf("serviceAccountName = %q, want the existing kv-agent", saName)
		}
		return
	}
	if r.role == nil || r.binding == nil || r.evRole == nil || r.evBinding == nil || r.sa == nil {
		t.Fatal("missing ClusterRole, ClusterRoleBinding, events Role, RoleBinding or ServiceAccount")
	}
	wantRules := clusterRules
	if vs.mode == "dra" {
		wantRules = append(slices.Clone(clusterRules), draRules...)
	}
	if got, want := grants(t, r.role.Rules), sorted(wantRules); !reflect.DeepEqual(got, want) {
		t.Errorf("ClusterRole grants\n  %v\nwant exactly\n  %v", got, want)
	}
	if got, want := grants(t, r.evRole.Rules), sorted(eventRules); !reflect.DeepEqual(got, want) {
		t.Errorf("events Role grants\n  %v\nwant exactly\n  %v", got, want)
	}
	for _, b := range []struct {
		kind, name, wantKind, wantName string
		subjects                       []rbacv1.Subject
	}{
		{"ClusterRoleBinding", r.binding.Name, r.binding.RoleRef.Kind, r.binding.RoleRef.Name, r.binding.Subjects},
		{"RoleBinding", r.evBinding.Name, r.evBinding.RoleRef.Kind, r.evBinding.RoleRef.Name, r.evBinding.Subjects},
	} {
		wantRole := map[string][2]string{"ClusterRoleBinding": {"ClusterRole", r.role.Name}, "RoleBinding": {"Role", r.evRole.Name}}[b.kind]
		if b.wantKind != wantRole[0] || b.wantName != wantRole[1] {
			t.Errorf("%s %s refers to %s %s, want %s %s", b.kind, b.name, b.wantKind, b.wantName, wantRole[0], wantRole[1])
		}
		if len(b.subjects) != 1 || b.subjects[0].Kind != "ServiceAccount" || b.subjects[0].Name != r.sa.Name || b.subjects[0].Namespace != namespace {
			t.Errorf("%s subjects = %+v, want the chart's ServiceAccount in %s", b.kind, b.subjects, namespace)
		}
	}
	if saName != r.sa.Name {
		t.Errorf("pod runs as %q, chart created %q", saName, r.sa.Name)
	}
}

func checkMonitoring(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	if r.svc == nil {
		t.Fatal("no metrics Service")
	}
	if r.svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("metrics Service clusterIP = %q, want headless", r.svc.Spec.ClusterIP)
	}
	if !reflect.DeepEqual(r.svc.Spec.Selector, r.ds.Spec.Selector.MatchLabels) {
		t.Errorf("Service selector %v does not select the agents %v", r.svc.Spec.Selector, r.ds.Spec.Selector.MatchLabels)
	}
	checkDashboard(t, vs, r)
	if !vs.serviceMonitor {
		if r.serviceMo != nil {
			t.Error("ServiceMonitor rendered although disabled")
		}
		return
	}
	if r.serviceMo == nil {
		t.Fatal("ServiceMonitor enabled but not rendered")
	}
	spec := r.serviceMo["spec"].(map[string]any)
	ep := spec["endpoints"].([]any)[0].(map[string]any)
	if ep["port"] != r.svc.Spec.Ports[0].Name || ep["path"] != "/metrics" {
		t.Errorf("ServiceMonitor endpoint %v does not scrape the Service's %q port at /metrics", ep, r.svc.Spec.Ports[0].Name)
	}
	sel := spec["selector"].(map[string]any)["matchLabels"].(map[string]any)
	for k, v := range sel {
		if r.svc.Labels[k] != v {
			t.Errorf("ServiceMonitor selects %s=%v, the Service has %q", k, v, r.svc.Labels[k])
		}
	}
	labels := r.serviceMo["metadata"].(map[string]any)["labels"].(map[string]any)
	if labels["release"] != "prometheus" {
		t.Errorf("ServiceMonitor labels %v lack the user's release=prometheus", labels)
	}
}

func checkConfig(t *testing.T, vs valueSet, cm *corev1.ConfigMap) {
	t.Helper()
	data, ok := cm.Data["agent.yaml"]
	if !ok {
		t.Fatalf("ConfigMap has no agent.yaml: keys %v", keys(cm.Data))
	}
	cfg := loadAgentConfig(t, []byte(data))
	hp := "never"
	if vs.hugePages != "" {
		hp = "require"
	}
	want := renderedConfig{
		ResourceName: vs.resourceName,
		SocketDir:    vs.socketDir,
		KubeletDir:   strings.TrimSuffix(vs.kubeletDir, "/"),
		StateDir:     vs.stateDir,
		PoolBytes:    mustBytes(t, vs.pool),
		Headroom:     mustBytes(t, vs.headroom) + spareBytes(vs),
		SpareMemory:  spareBytes(vs),
		HugePages:    hp,
		MetricsAddr:  ":9464",
		HealthAddr:   ":8081",
		Mode:         vs.mode,
		DRADriver:    "kvpool.io",
		CDIDir:       vs.cdiDir,
	}
	if vs.name == "dra-custom-paths" {
		want.DRADriver = "kv.example.com"
	}
	// kubeletDir is passed through as given; compare it cleaned.
	cfg.KubeletDir = strings.TrimSuffix(cfg.KubeletDir, "/")
	if cfg != want {
		t.Errorf("agent config read back as\n  %+v\nwant\n  %+v", cfg, want)
	}
}

func mustBytes(t *testing.T, s string) int64 {
	t.Helper()
	q := resource.MustParse(s)
	return q.Value()
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestConfigChecksum: a change to the agent config changes the pod template,
// so `helm upgrade` rolls the agents onto the new config.
func TestConfigChecksum(t *testing.T) {
	sum := func(values string) string {
		files, err := render(t, parseValues(t, values))
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range decodeAll(t, files) {
			if ds, ok := o.typed.(*appsv1.DaemonSet); ok {
				return ds.Spec.Template.Annotations["checksum/config"]
			}
		}
		t.Fatal("no DaemonSet")
		return ""
	}
	a, b, c := sum(""), sum("reclaim: {gracePeriod: 5m}"), sum("")
	if a == b {
		t.Error("config change left checksum/config unchanged")
	}
	if a != c {
		t.Error("same values gave different checksums")
	}
}

// TestLint runs Helm's own linter, strict (warnings fail), on every value set.
func TestLint(t *testing.T) {
	for _, vs := range valueSets() {
		t.Run(vs.name, func(t *testing.T) {
			l := action.NewLint()
			l.Strict = true
			l.Namespace = namespace
			res := l.Run([]string{chartDir(t)}, parseValues(t, vs.values))
			for _, m := range res.Messages {
				t.Logf("lint: %s", m)
			}
			if len(res.Errors) > 0 {
				t.Errorf("lint errors: %v", res.Errors)
			}
			if res.TotalChartsLinted != 1 {
				t.Errorf("linted %d charts, want 1", res.TotalChartsLinted)
			}
		})
	}
}

// TestRejectsBadValues: every bad value is refused with a message that names
// it, by values.schema.json or by the templates' own checks, before anything
// would reach the cluster.
func TestRejectsBadValues(t *testing.T) {
	cases := []struct {
		name, values, wantErr string
	}{
		{"unknown top-level key", "pooll: {bytes: 1Gi}", "pooll"},
		{"state dir is the socket dir", "paths: {socketDir: /var/lib/kvpool, stateDir: /var/lib/kvpool/}", "must not overlap"},
		{"state dir inside the socket dir", "paths: {socketDir: /var/lib/kvpool/sock, stateDir: /var/lib/kvpool/sock/state}", "must not overlap"},
		{"socket dir inside the state dir", "paths: {socketDir: /var/lib/kvpool/state/sock, stateDir: /var/lib/kvpool/state}", "must not overlap"},
		{"keeper socket in the socket dir", "keeper: {socketDir: /var/lib/kvpool/sock}", "keeper.socketDir (/var/lib/kvpool/sock) must not be paths.socketDir"},
		{"keeper socket below the socket dir", "keeper: {socketDir: /var/lib/kvpool/sock/keeper/}", "must not be paths.socketDir"},
		{"token binding unknown", "security: {tokenBinding: uid}", "tokenBinding"},
		{"GOMEMLIMIT share too small", "security: {goMemLimitPercent: 5}", "goMemLimitPercent"},
		{"relative pod logs dir", "security: {podLogsDir: var/log/pods}", "podLogsDir"},
		{"unknown pool key", "pool: {size: 1Gi}", "size"},
		{"pool bytes not a quantity", "pool: {bytes: lots}", "bytes"},
		{"pool bytes with a unit Kubernetes lacks", "pool: {bytes: 16GB}", "bytes"},
		{"pool bytes as a number", "pool: {bytes: 1073741824}", "bytes"},
		{"pool bytes fractional", "pool: {bytes: 1.5Gi}", "bytes"},
		{"pool bytes zero", "pool: {bytes: \"0\"}", "pool.bytes must be greater than zero"},
		{"pool bytes leading zero", "pool: {bytes: 010Gi}", "bytes"},
		{"pool bytes overflow", "pool: {bytes: 999999999999999999Pi}", "too large"},
		{"headroom zero", "pool: {headroom: \"0\"}", "pool.headroom must be greater than zero"},
		{"headroom missing unit sanity", "pool: {headroom: 512mb}", "headroom"},
		{"huge page size unknown", "pool: {hugePages: 4Mi}", "hugePages"},
		{"pool not whole huge pages", "pool: {bytes: 1536Mi, hugePages: 1Gi}", "whole number of 1Gi huge pages"},
		{"split unknown", "pool: {split: random}", "split"},
		{"chunk bytes empty", "pool: {chunkBytes: \"\"}", "chunkBytes"},
		{"resource name without domain", "resourceName: host-kv", "resourceName"},
		{"resource name in kubernetes.io", "resourceName: kubernetes.io/host-kv", "resourceName"},
		{"resource name upper-case domain", "resourceName: KVPool.io/host-kv", "resourceName"},
		{"relative socket dir", "paths: {socketDir: var/lib/kvpool}", "socketDir"},
		{"log format", "log: {format: xml}", "format"},
		{"log level", "log: {level: verbose}", "level"},
		{"metrics port zero", "metrics: {port: 0}", "port"},
		{"health port too big", "health: {port: 70000}", "port"},
		{"reclaim grace not a duration", "reclaim: {gracePeriod: soon}", "gracePeriod"},
		{"toleration operator", "tolerations: [{key: a, operator: In}]", "operator"},
		{"toleration unknown field", "tolerations: [{key: a, opertor: Exists}]", "opertor"},
		{"maxUnavailable zero", "updateStrategy: {rollingUpdate: {maxUnavailable: 0}}", "maxUnavailable"},
		{"maxSurge", "updateStrategy: {rollingUpdate: {maxSurge: 1}}", "maxSurge"},
		{"update strategy type", "updateStrategy: {type: Recreate}", "type"},
		{"memory in resources", "resources: {limits: {memory: 1Gi}}", "memory"},
		{"huge pages in resources", "resources: {requests: {hugepages-2Mi: 1Gi}}", "hugepages-2Mi"},
		{"simulated GPUs negative", "simulateGPUs: -1", "simulateGPUs"},
		{"extra args not strings", "extraArgs: [{a: b}]", "extraArgs"},
		{"extra env without name", "extraEnv: [{value: x}]", "name"},
		{"pod monitor interval", "metrics: {podMonitor: {enabled: true, interval: often}}", "interval"},
		{"image digest malformed", "image: {digest: sha256:abc}", "digest"},
		{"pull policy", "image: {pullPolicy: Sometimes}", "pullPolicy"},
		{"service monitor flag not boolean", "metrics: {serviceMonitor: {enabled: \"yes\"}}", "enabled"},
		{"cpu request", "resources: {requests: {cpu: lots}}", "cpu"},
		{"old cpu value", "cpu: {request: 100m}", "cpu"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := render(t, parseValues(t, tc.values))
			if err == nil {
				t.Fatalf("values %q rendered without error", tc.values)
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("error %q does not mention %q", err, tc.wantErr)
			}
		})
	}
}

// TestQuantityHelper checks the chart's own quantity arithmetic against
// apimachinery's parser on values that reach the memory request.
func TestQuantityHelper(t *testing.T) {
	cases := []struct{ pool, headroom string }{
		{"2Mi", "1"}, {"2Mi", "1Ki"}, {"2097153", "24"}, {"3Mi", "1Ki"}, {"1G", "1M"}, {"7Ti", "512Mi"}, {"2P", "1k"}, {"8Pi", "1Gi"},
	}
	for _, tc := range cases {
		t.Run(tc.pool+"+"+tc.headroom, func(t *testing.T) {
			vs := defaults()
			vs.values = fmt.Sprintf("pool: {bytes: %q, headroom: %q, chunkBytes: 2Mi}", tc.pool, tc.headroom)
			vs.pool, vs.headroom = tc.pool, tc.headroom
			r := renderSet(t, vs)
			checkResources(t, vs, r.ds)
		})
	}
}

func checkDashboard(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	if !vs.dashboard {
		if r.dashboard != nil {
			t.Error("dashboard ConfigMap rendered although disabled")
		}
		return
	}
	if r.dashboard == nil {
		t.Fatal("grafanaDashboard.enabled but no dashboard ConfigMap")
	}
	if r.dashboard.Labels["grafana_dashboard"] != "1" {
		t.Errorf("dashboard labels %v lack the sidecar's grafana_dashboard=1", r.dashboard.Labels)
	}
	got := r.dashboard.Data["kvpool-dashboard.json"]
	want := string(readFile(t, "charts/kvpool/dashboards/kvpool-dashboard.json"))
	if strings.TrimSpace(got) != strings.TrimSpace(want) {
		t.Error("dashboard ConfigMap does not carry the chart's dashboard JSON unchanged")
	}
	var v map[string]any
	if err := yaml.Unmarshal([]byte(got), &v); err != nil || v["panels"] == nil {
		t.Errorf("dashboard is not a Grafana dashboard JSON: %v", err)
	}
}
