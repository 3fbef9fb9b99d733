package chart_test

import (
	corev1 "k8s.io/api/core/v1"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// checkDRA: in mode dra the chart installs the two DeviceClasses (the
// chunk class maps resourceName to the chunk devices, the bytes class
// selects the share devices, both of the configured driver) and, with
// RBAC, the policy that keeps each agent to its own node's slices; in mode
// devicePlugin none of it (a DeviceClass naming the extended resource on a
// node whose allocatable lacks it would send pods to DRA).
func checkDRA(t *testing.T, vs valueSet, r rendered) {
	t.Helper()
	if vs.mode != "dra" {
		if len(r.classes) > 0 || r.sliceVap != nil || r.sliceVapb != nil {
			t.Errorf("mode %s rendered DeviceClasses %d, slice policy %v", vs.mode, len(r.classes), r.sliceVap != nil)
		}
		return
	}
	driver, chunks, bytes := "kvpool.io", "host-kv.kvpool.io", "host-kv-bytes.kvpool.io"
	if vs.name == "dra-custom-paths" {
		driver, chunks, bytes = "kv.example.com", "kv-chunks.example.com", "kv-bytes.example.com"
	}
	byName := map[string]*resourcev1.DeviceClass{}
	for _, c := range r.classes {
		byName[c.Name] = c
	}
	if len(byName) != 2 || byName[chunks] == nil || byName[bytes] == nil {
		t.Fatalf("DeviceClasses %v, want %s and %s", byName, chunks, bytes)
	}
	for name, kind := range map[string]string{chunks: "chunk", bytes: "share"} {
		c := byName[name]
		if len(c.Spec.Selectors) != 1 || c.Spec.Selectors[0].CEL == nil {
			t.Fatalf("class %s selectors %+v", name, c.Spec.Selectors)
		}
		expr := c.Spec.Selectors[0].CEL.Expression
		if !strings.Contains(expr, `device.driver == "`+driver+`"`) || !strings.Contains(expr, `device.attributes["`+driver+`"].kind == "`+kind+`"`) {
			t.Errorf("class %s selects %q, want driver %s and kind %s", name, expr, driver, kind)
		}
	}
	if got := byName[chunks].Spec.ExtendedResourceName; got == nil || *got != vs.resourceName {
		t.Errorf("chunk class extendedResourceName %v, want %s", got, vs.resourceName)
	}
	if byName[bytes].Spec.ExtendedResourceName != nil {
		t.Errorf("bytes class maps an extended resource: %v", *byName[bytes].Spec.ExtendedResourceName)
	}
	if (r.sliceVap != nil) != vs.rbac || (r.sliceVapb != nil) != vs.rbac {
		t.Fatalf("slice policy rendered %v, binding %v, want %v", r.sliceVap != nil, r.sliceVapb != nil, vs.rbac)
	}
	if r.sliceVap == nil {
		return
	}
	p := r.sliceVap.Spec
	if r.sliceVapb.Spec.PolicyName != r.sliceVap.Name || len(r.sliceVapb.Spec.ValidationActions) != 1 || r.sliceVapb.Spec.ValidationActions[0] != "Deny" {
		t.Errorf("slice policy binding %+v", r.sliceVapb.Spec)
	}
	sa := "system:serviceaccount:" + namespace + ":" + r.sa.Name
	if len(p.MatchConditions) != 1 || !strings.Contains(p.MatchConditions[0].Expression, `"`+sa+`"`) {
		t.Errorf("slice policy match conditions %+v", p.MatchConditions)
	}
	rules := p.MatchConstraints.ResourceRules
	if len(rules) != 1 || strings.Join(rules[0].APIGroups, ",") != "resource.k8s.io" || strings.Join(rules[0].Resources, ",") != "resourceslices" ||
		len(rules[0].Operations) != 3 {
		t.Errorf("slice policy rules %+v", rules)
	}
	if len(p.Validations) != 1 || !strings.Contains(p.Validations[0].Expression, `variables.slice.spec.driver == "`+driver+`"`) ||
		!strings.Contains(p.Validations[0].Expression, "variables.nodes.exists(n, n == variables.slice.spec.nodeName)") ||
		!strings.Contains(p.Validations[0].Expression, "oldObject.spec.nodeName") {
		t.Errorf("slice policy validations %+v", p.Validations)
	}
}

// TestDRAExamples: the three ways to ask for host KV in mode dra decode
// strictly into the API types and ask for it as the chart's DeviceClasses
// serve it: the extended resource unchanged, bytes from the bytes class,
// and a GPU with host KV on its PCIe root.
func TestDRAExamples(t *testing.T) {
	values := parseValues(t, string(readFile(t, "charts/kvpool/values.yaml")))
	dra := values["dra"].(map[string]any)
	classes := dra["deviceClasses"].(map[string]any)
	bytesClass := classes["bytes"].(string)
	resourceName := values["resourceName"].(string)

	objs := func(file string) []any {
		t.Helper()
		docs, err := splitDocs(readFile(t, file))
		if err != nil || len(docs) == 0 {
			t.Fatalf("%s: %d documents, %v", file, len(docs), err)
		}
		var out []any
		for _, d := range docs {
			out = append(out, decodeDoc(t, file, d).typed)
		}
		return out
	}
	// (1) The extended resource: the pod spec of today.
	o := objs("config/examples/dra-extended-resource.yaml")
	pod, ok := o[0].(*corev1.Pod)
	if !ok || len(o) != 1 {
		t.Fatalf("dra-extended-resource.yaml: %T", o[0])
	}
	q := pod.Spec.Containers[0].Resources.Limits[corev1.ResourceName(resourceName)]
	if q.Value() != 16 || len(pod.Spec.ResourceClaims) != 0 {
		t.Errorf("extended resource pod asks %s of %s, claims %v", q.String(), resourceName, pod.Spec.ResourceClaims)
	}

	// (2) and (3): a template and a pod that uses it.
	for _, c := range []struct {
		file     string
		memory   string
		requests []string
		aligned  bool
	}{
		{"config/examples/dra-bytes-claim.yaml", "20Gi", []string{"kv"}, false},
		{"config/examples/dra-gpu-aligned.yaml", "64Gi", []string{"gpu", "kv"}, true},
	} {
		t.Run(c.file, func(t *testing.T) {
			o := objs(c.file)
			if len(o) != 2 {
				t.Fatalf("%d objects, want a template and a pod", len(o))
			}
			tmpl, ok1 := o[0].(*resourcev1.ResourceClaimTemplate)
			pod, ok2 := o[1].(*corev1.Pod)
			if !ok1 || !ok2 {
				t.Fatalf("objects %T, %T", o[0], o[1])
			}
			reqs := tmpl.Spec.Spec.Devices.Requests
			var names []string
			for _, r := range reqs {
				names = append(names, r.Name)
			}
			if strings.Join(names, ",") != strings.Join(c.requests, ",") {
				t.Fatalf("requests %v, want %v", names, c.requests)
			}
			kv := reqs[len(reqs)-1].Exactly
			var mem resource.Quantity
			if kv != nil && kv.Capacity != nil {
				mem = kv.Capacity.Requests["memory"]
			}
			if kv == nil || kv.DeviceClassName != bytesClass || mem.String() != c.memory {
				t.Errorf("kv request %+v, want %s of class %s", kv, c.memory, bytesClass)
			}
			cons := tmpl.Spec.Spec.Devices.Constraints
			if c.aligned {
				if reqs[0].Exactly == nil || reqs[0].Exactly.DeviceClassName != "gpu.nvidia.com" || len(cons) != 1 ||
					cons[0].MatchAttribute == nil || string(*cons[0].MatchAttribute) != "resource.kubernetes.io/pcieRoot" ||
					strings.Join(cons[0].Requests, ",") != "gpu,kv" {
					t.Errorf("GPU request %+v, constraints %+v", reqs[0], cons)
				}
			} else if len(cons) != 0 {
				t.Errorf("constraints %+v", cons)
			}
			if len(pod.Spec.ResourceClaims) != 1 || pod.Spec.ResourceClaims[0].ResourceClaimTemplateName == nil ||
				*pod.Spec.ResourceClaims[0].ResourceClaimTemplateName != tmpl.Name {
				t.Fatalf("pod claims %+v, want the template %s", pod.Spec.ResourceClaims, tmpl.Name)
			}
			cl := pod.Spec.Containers[0].Resources.Claims
			if len(cl) != 1 || cl[0].Name != pod.Spec.ResourceClaims[0].Name {
				t.Errorf("container claims %+v", cl)
			}
		})
	}
}
