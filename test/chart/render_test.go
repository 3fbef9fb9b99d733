// Package chart_test renders charts/kvpool with the Helm v4 SDK and checks
// the result against the Kubernetes API types. It deliberately imports no
// agent code that links go-nvml (see docs/install.md and the notes on
// external linking), only the chart, the examples and internal/config.
package chart_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/engine"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

	apiruntime "k8s.io/apimachinery/pkg/runtime"
)

const (
	releaseName = "kvpool"
	namespace   = "kvpool-system"
)

// repoRoot is the module root, found from this file's location so the tests
// run from any working directory.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate the test source")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

func chartDir(t testing.TB) string { return filepath.Join(repoRoot(t), "charts", "kvpool") }

// render renders the chart the way `helm install` does: values coalesced with
// the chart's defaults, checked against values.schema.json, then templated.
func render(t testing.TB, vals map[string]any) (map[string]string, error) {
	t.Helper()
	ch, err := loader.Load(chartDir(t))
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	opts := common.ReleaseOptions{Name: releaseName, Namespace: namespace, Revision: 1, IsInstall: true}
	rv, err := util.ToRenderValues(ch, vals, opts, common.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Render(ch, rv)
}

// object is one rendered manifest: where it came from, its raw YAML, and the
// typed object it decoded into (nil for kinds outside client-go's scheme).
type object struct {
	source string
	raw    []byte
	kind   string
	name   string
	typed  apiruntime.Object
	fields map[string]any
}

// strictDecoder decodes YAML into client-go's types and fails on unknown or
// duplicate fields and on wrong types.
var strictDecoder = json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
	json.SerializerOptions{Yaml: true, Strict: true})

// splitDocs splits a multi-document YAML stream, dropping empty documents.
func splitDocs(data []byte) ([][]byte, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		var m map[string]any
		if err := yaml.Unmarshal(doc, &m); err != nil {
			return nil, fmt.Errorf("yaml: %w", err)
		}
		if len(m) == 0 {
			continue
		}
		docs = append(docs, doc)
	}
}

// decodeAll decodes every document of every rendered file. Kinds the client-go
// scheme knows are decoded strictly into their Go types; the rest must be in
// the allow-list of known third-party kinds and are returned as plain maps.
func decodeAll(t testing.TB, files map[string]string) []object {
	t.Helper()
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	var objs []object
	for _, name := range names {
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		docs, err := splitDocs([]byte(files[name]))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, doc := range docs {
			objs = append(objs, decodeDoc(t, name, doc))
		}
	}
	return objs
}

func decodeDoc(t testing.TB, source string, doc []byte) object {
	t.Helper()
	var fields map[string]any
	if err := yaml.Unmarshal(doc, &fields); err != nil {
		t.Fatalf("%s: %v", source, err)
	}
	o := object{source: source, raw: doc, fields: fields}
	o.kind, _ = fields["kind"].(string)
	if md, ok := fields["metadata"].(map[string]any); ok {
		o.name, _ = md["name"].(string)
	}
	apiVersion, _ := fields["apiVersion"].(string)
	if apiVersion == "monitoring.coreos.com/v1" && o.kind == "ServiceMonitor" {
		checkServiceMonitorFields(t, source, fields)
		return o
	}
	if apiVersion == "monitoring.coreos.com/v1" && o.kind == "PodMonitor" {
		checkPodMonitorFields(t, source, fields)
		return o
	}
	obj, gvk, err := strictDecoder.Decode(doc, nil, nil)
	if err != nil {
		t.Fatalf("%s: strict decode of %s %q: %v", source, o.kind, o.name, err)
	}
	if gvk.Kind != o.kind {
		t.Fatalf("%s: decoded kind %s, document says %s", source, gvk.Kind, o.kind)
	}
	o.typed = obj
	return o
}

// checkServiceMonitorFields checks a ServiceMonitor, which client-go has no
// type for, against the fields of monitoring.coreos.com/v1 the chart uses.
func checkServiceMonitorFields(t testing.TB, source string, m map[string]any) {
	t.Helper()
	allowed := map[string][]string{
		"":                       {"apiVersion", "kind", "metadata", "spec"},
		"metadata":               {"name", "namespace", "labels", "annotations"},
		"spec":                   {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"},
		"spec.selector":          {"matchLabels", "matchExpressions"},
		"spec.namespaceSelector": {"matchNames", "any"},
	}
	endpointFields := []string{"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings", "tlsConfig"}
	check := func(path string, v any) {
		obj, ok := v.(map[string]any)
		if !ok {
			t.Fatalf("%s: ServiceMonitor %s is not an object", source, path)
		}
		for k := range obj {
			if !contains(allowed[path], k) {
				t.Errorf("%s: ServiceMonitor has unknown field %s.%s", source, path, k)
			}
		}
	}
	check("", m)
	check("metadata", m["metadata"])
	spec, _ := m["spec"].(map[string]any)
	check("spec", spec)
	check("spec.selector", spec["selector"])
	check("spec.namespaceSelector", spec["namespaceSelector"])
	eps, ok := spec["endpoints"].([]any)
	if !ok || len(eps) == 0 {
		t.Fatalf("%s: ServiceMonitor has no endpoints", source)
	}
	for i, ep := range eps {
		e, ok := ep.(map[string]any)
		if !ok {
			t.Fatalf("%s: endpoint %d is not an object", source, i)
		}
		for k := range e {
			if !contains(endpointFields, k) {
				t.Errorf("%s: ServiceMonitor endpoint %d has unknown field %s", source, i, k)
			}
		}
	}
}

// checkPodMonitorFields checks a PodMonitor against the fields of
// monitoring.coreos.com/v1 the chart uses.
func checkPodMonitorFields(t testing.TB, source string, m map[string]any) {
	t.Helper()
	allowed := map[string][]string{
		"":         {"apiVersion", "kind", "metadata", "spec"},
		"metadata": {"name", "namespace", "labels", "annotations"},
		"spec":     {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels"},
	}
	endpointFields := []string{"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings"}
	check := func(path string, v any, fields []string) {
		obj, ok := v.(map[string]any)
		if !ok {
			t.Fatalf("%s: PodMonitor %s is not an object", source, path)
		}
		for k := range obj {
			if !contains(fields, k) {
				t.Errorf("%s: PodMonitor has unknown field %s.%s", source, path, k)
			}
		}
	}
	check("", m, allowed[""])
	check("metadata", m["metadata"], allowed["metadata"])
	spec, _ := m["spec"].(map[string]any)
	check("spec", spec, allowed["spec"])
	eps, ok := spec["podMetricsEndpoints"].([]any)
	if !ok || len(eps) == 0 {
		t.Fatalf("%s: PodMonitor has no podMetricsEndpoints", source)
	}
	for i, ep := range eps {
		check(fmt.Sprintf("podMetricsEndpoints[%d]", i), ep, endpointFields)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// readFile reads a repository file.
func readFile(t testing.TB, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
