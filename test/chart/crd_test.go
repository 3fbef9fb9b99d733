package chart_test

import (
	"bytes"
	stdjson "encoding/json"
	"os"
	"path/filepath"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
)

// crdPath is the status CRD the chart installs (Helm's crds/ directory: applied
// before the templates on install, never templated).
const crdPath = "charts/kvpool/crds/kvpool.io_kvpoolnodes.yaml"

// sourceCRDPath is where the observability code generates the CRD.
const sourceCRDPath = "config/crd/kvpool.io_kvpoolnodes.yaml"

// TestChartCRD: the chart ships the KVPoolNode CRD, so one `helm install`
// is the whole install; it is the resource the ClusterRole grants, with the
// status subresource the role's kvpoolnodes/status rule refers to; and it is
// byte for byte the CRD generated from the Go types.
func TestChartCRD(t *testing.T) {
	data := readFile(t, crdPath)
	sch := apiruntime.NewScheme()
	if err := apiextensionsv1.AddToScheme(sch); err != nil {
		t.Fatal(err)
	}
	dec := json.NewSerializerWithOptions(json.DefaultMetaFactory, sch, sch, json.SerializerOptions{Yaml: true, Strict: true})
	docs, err := splitDocs(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) != 1 {
		t.Fatalf("%s holds %d objects, want 1", crdPath, len(docs))
	}
	obj, _, err := dec.Decode(docs[0], nil, nil)
	if err != nil {
		t.Fatalf("%s: strict decode: %v", crdPath, err)
	}
	crd, ok := obj.(*apiextensionsv1.CustomResourceDefinition)
	if !ok {
		t.Fatalf("%s is a %T", crdPath, obj)
	}
	if crd.Name != "kvpoolnodes.kvpool.io" || crd.Spec.Group != "kvpool.io" || crd.Spec.Names.Plural != "kvpoolnodes" ||
		crd.Spec.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("CRD is %s (group %s, plural %s, scope %s), want the cluster-scoped kvpoolnodes.kvpool.io",
			crd.Name, crd.Spec.Group, crd.Spec.Names.Plural, crd.Spec.Scope)
	}
	var served int
	for _, v := range crd.Spec.Versions {
		if !v.Served {
			continue
		}
		served++
		if v.Subresources == nil || v.Subresources.Status == nil {
			t.Errorf("version %s has no status subresource; the agent updates kvpoolnodes/status", v.Name)
		}
	}
	if served == 0 {
		t.Error("no served version")
	}

	src, err := os.ReadFile(filepath.Join(repoRoot(t), sourceCRDPath))
	if os.IsNotExist(err) {
		t.Logf("%s is not in this tree; the chart's copy is not compared", sourceCRDPath)
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, data) {
		t.Errorf("%s differs from %s: copy the generated CRD into the chart (cp %s %s)", crdPath, sourceCRDPath, sourceCRDPath, crdPath)
	}
}

// TestChartDashboard: the chart's dashboard is the repository's one copy
// (internal/metrics checks its queries against the metrics the agent exports),
// and it is a Grafana dashboard: valid JSON with its uid and panels.
func TestChartDashboard(t *testing.T) {
	const chartCopy, old = "charts/kvpool/dashboards/kvpool-dashboard.json", "config/grafana/kvpool-dashboard.json"
	if _, err := os.Stat(filepath.Join(repoRoot(t), old)); !os.IsNotExist(err) {
		t.Errorf("%s is back (%v): the dashboard has one copy, %s", old, err, chartCopy)
	}
	var d struct {
		UID    string               `json:"uid"`
		Title  string               `json:"title"`
		Panels []stdjson.RawMessage `json:"panels"`
	}
	if err := stdjson.Unmarshal(readFile(t, chartCopy), &d); err != nil {
		t.Fatalf("%s: %v", chartCopy, err)
	}
	if d.UID != "kvpool-overview" || d.Title == "" || len(d.Panels) == 0 {
		t.Errorf("%s: uid %q, title %q, %d panels; want uid kvpool-overview, a title and panels", chartCopy, d.UID, d.Title, len(d.Panels))
	}
}
