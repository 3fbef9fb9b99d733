package v1alpha1_test

import (
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/util/jsonpath"
	"k8s.io/kube-openapi/pkg/validation/spec"
	"k8s.io/kube-openapi/pkg/validation/strfmt"
	"k8s.io/kube-openapi/pkg/validation/validate"
	"sigs.k8s.io/yaml"

	"github.com/kvpool/kvpool/api/v1alpha1"
)

const crdPath = "../../config/crd/kvpool.io_kvpoolnodes.yaml"

func loadCRD(t *testing.T) *apiextensionsv1.CustomResourceDefinition {
	t.Helper()
	b, err := os.ReadFile(crdPath)
	if err != nil {
		t.Fatal(err)
	}
	crd := &apiextensionsv1.CustomResourceDefinition{}
	if err := yaml.UnmarshalStrict(b, crd); err != nil {
		t.Fatalf("strict decode %s: %v", crdPath, err)
	}
	return crd
}

// full is a KVPoolNode with every field set, so that a field the schema
// lacks would be pruned, and one the Go type lacks would be missing.
func full() *v1alpha1.KVPoolNode {
	q := resource.MustParse
	ts := metav1.NewTime(time.Date(2026, 11, 29, 8, 0, 0, 0, time.UTC))
	chunks := v1alpha1.ChunkCounts{Free: 3, Granted: 4, Dirty: 1, Unhealthy: 2}
	return &v1alpha1.KVPoolNode{
		TypeMeta:   metav1.TypeMeta{APIVersion: "kvpool.io/v1alpha1", Kind: "KVPoolNode"},
		ObjectMeta: metav1.ObjectMeta{Name: "node-a", CreationTimestamp: ts},
		Status: v1alpha1.KVPoolNodeStatus{
			NodeName: "node-a", ResourceName: "kvpool.io/host-kv", AgentVersion: "v0.1.0", Mode: "dra", DRADriver: "kvpool.io",
			Capacity: q("16Gi"), Ready: q("8Gi"), Allocated: q("4Gi"), Used: q("1536Mi"),
			Chunks: chunks, Sessions: 2, Health: v1alpha1.HealthDegraded, Message: "GPU 1 unhealthy",
			GPUs: []v1alpha1.GPUPool{{Index: 1, NUMANode: -1, Capacity: q("8Gi"), Ready: q("4Gi"),
				Allocated: q("2Gi"), Used: q("512Mi"), Chunks: chunks, Healthy: true}},
			Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue,
				ObservedGeneration: 1, LastTransitionTime: ts, Reason: "ChecksPassed", Message: "ok"}},
			Restart: &v1alpha1.RestartStatus{AdoptedChunks: 3, FreshChunks: 1, LastGapMilliseconds: 120,
				KeeperConnected: true, KeeperLockedChunks: 4, KeeperLosses: 2, PoolLost: true},
			Claims: []v1alpha1.PreparedClaim{{Namespace: "ns", Name: "kv", UID: "0b5a3b0e-5d5c-4cf4-9f43-2f0b9f6d0a11",
				Requests: 1, Chunks: 3, Bytes: q("3Gi"), GPUs: []int32{1}}},
			LastUpdateTime: ts,
		},
	}
}

func toMap(t *testing.T, v any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func version(t *testing.T, crd *apiextensionsv1.CustomResourceDefinition) *apiextensionsv1.CustomResourceDefinitionVersion {
	t.Helper()
	for i, v := range crd.Spec.Versions {
		if v.Name == v1alpha1.GroupVersion.Version {
			return &crd.Spec.Versions[i]
		}
	}
	t.Fatalf("CRD has no version %s", v1alpha1.GroupVersion.Version)
	return nil
}

func TestCRDNames(t *testing.T) {
	crd := loadCRD(t)
	s := crd.Spec
	if crd.Name != "kvpoolnodes.kvpool.io" || s.Group != v1alpha1.GroupVersion.Group || s.Names.Plural != "kvpoolnodes" ||
		s.Names.Kind != "KVPoolNode" || s.Names.ListKind != "KVPoolNodeList" || s.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("names: %s %+v scope %s", crd.Name, s.Names, s.Scope)
	}
	v := version(t, crd)
	if !v.Served || !v.Storage || v.Subresources == nil || v.Subresources.Status == nil {
		t.Errorf("version %s: served %v storage %v subresources %+v", v.Name, v.Served, v.Storage, v.Subresources)
	}
	// The Go type's kind must be what the scheme registers.
	gvks, _, err := scheme().ObjectKinds(&v1alpha1.KVPoolNode{})
	if err != nil || len(gvks) != 1 || gvks[0].Kind != s.Names.Kind || gvks[0].Group != s.Group {
		t.Errorf("scheme kinds %v, %v", gvks, err)
	}
}

func structural(t *testing.T, v *apiextensionsv1.CustomResourceDefinitionVersion) (*structuralschema.Structural, *apiextensions.JSONSchemaProps) {
	t.Helper()
	internal := &apiextensions.JSONSchemaProps{}
	if err := apiextensionsv1.Convert_v1_JSONSchemaProps_To_apiextensions_JSONSchemaProps(v.Schema.OpenAPIV3Schema, internal, nil); err != nil {
		t.Fatal(err)
	}
	ss, err := structuralschema.NewStructural(internal)
	if err != nil {
		t.Fatalf("schema is not structural: %v", err)
	}
	if errs := structuralschema.ValidateStructural(field.NewPath("openAPIV3Schema"), ss); len(errs) > 0 {
		t.Fatalf("schema is not structural: %v", errs.ToAggregate())
	}
	return ss, internal
}

// The apiserver prunes fields its schema does not name. Every field of the
// Go type must survive, or the agent's writes would silently lose data.
func TestCRDSchemaKeepsEveryField(t *testing.T) {
	crd := loadCRD(t)
	ss, _ := structural(t, version(t, crd))
	obj := toMap(t, full())
	pruned := toMap(t, full())
	dropped := pruning.PruneWithOptions(pruned, ss, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
	if len(dropped) > 0 {
		t.Errorf("schema drops fields of the Go type: %v", dropped)
	}
	if !reflect.DeepEqual(obj, pruned) {
		t.Errorf("pruning changed the object")
	}
	// And the other way: every property the schema names is a field of the
	// Go type (the full object sets them all).
	var missing []string
	var walk func(path string, s *structuralschema.Structural, v any)
	walk = func(path string, s *structuralschema.Structural, v any) {
		switch s.Type {
		case "object":
			m, _ := v.(map[string]any)
			for name, p := range s.Properties {
				if path == "" && name == "metadata" {
					continue
				}
				child, ok := m[name]
				if !ok {
					missing = append(missing, path+"."+name)
					continue
				}
				walk(path+"."+name, &p, child)
			}
		case "array":
			for i, e := range v.([]any) {
				walk(fmt.Sprintf("%s[%d]", path, i), s.Items, e)
			}
		}
	}
	walk("", ss, obj)
	slices.Sort(missing)
	if len(missing) > 0 {
		t.Errorf("schema names fields the Go type does not write: %v", missing)
	}
}

func validator(t *testing.T, v *apiextensionsv1.CustomResourceDefinitionVersion) *validate.SchemaValidator {
	t.Helper()
	b, err := json.Marshal(v.Schema.OpenAPIV3Schema)
	if err != nil {
		t.Fatal(err)
	}
	s := &spec.Schema{}
	if err := json.Unmarshal(b, s); err != nil {
		t.Fatal(err)
	}
	return validate.NewSchemaValidator(s, nil, "", strfmt.Default)
}

// Objects the agent writes pass the schema; bad ones do not.
func TestCRDValidatesObjects(t *testing.T) {
	crd := loadCRD(t)
	val := validator(t, version(t, crd))
	if res := val.Validate(toMap(t, full())); !res.IsValid() {
		t.Fatalf("full object rejected: %v", res.Errors)
	}
	for _, c := range []struct {
		name string
		mut  func(st map[string]any)
	}{
		{"health outside the enum", func(st map[string]any) { st["health"] = "Fine" }},
		{"negative sessions", func(st map[string]any) { st["sessions"] = -1 }},
		{"capacity not a quantity", func(st map[string]any) { st["capacity"] = "lots" }},
		{"missing health", func(st map[string]any) { delete(st, "health") }},
		{"negative free chunks", func(st map[string]any) { st["chunks"].(map[string]any)["free"] = -3 }},
		{"condition status", func(st map[string]any) {
			st["conditions"].([]any)[0].(map[string]any)["status"] = "Maybe"
		}},
		{"gpu NUMA below -1", func(st map[string]any) { st["gpus"].([]any)[0].(map[string]any)["numaNode"] = -2 }},
	} {
		obj := toMap(t, full())
		c.mut(obj["status"].(map[string]any))
		if res := val.Validate(obj); res.IsValid() {
			t.Errorf("%s: accepted", c.name)
		}
	}
}

// Every printer column's JSONPath finds a value in an object the agent
// writes, of the column's type.
func TestCRDPrinterColumns(t *testing.T) {
	crd := loadCRD(t)
	v := version(t, crd)
	obj := toMap(t, full())
	var names []string
	for _, col := range v.AdditionalPrinterColumns {
		names = append(names, col.Name)
		jp := jsonpath.New(col.Name)
		if err := jp.Parse("{" + col.JSONPath + "}"); err != nil {
			t.Errorf("column %s: bad JSONPath %q: %v", col.Name, col.JSONPath, err)
			continue
		}
		res, err := jp.FindResults(obj)
		if err != nil || len(res) != 1 || len(res[0]) != 1 {
			t.Errorf("column %s: JSONPath %s finds nothing: %v", col.Name, col.JSONPath, err)
			continue
		}
		val := res[0][0].Interface()
		ok := false
		switch col.Type {
		case "string", "date":
			s, isStr := val.(string)
			ok = isStr && s != ""
		case "integer", "number":
			_, ok = val.(float64)
		}
		if !ok {
			t.Errorf("column %s (%s): value %#v", col.Name, col.Type, val)
		}
	}
	for _, want := range []string{"Capacity", "Ready", "Allocated", "Health", "Age"} {
		if !slices.Contains(names, want) {
			t.Errorf("no %s column (have %s)", want, strings.Join(names, ", "))
		}
	}
}
