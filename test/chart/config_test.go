package chart_test

import (
	"reflect"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/pkg/contract"
)

// TestSampleAgentConfig: config/agent.yaml loads with the agent's loader, is
// exactly the built-in defaults, and names every field of the schema, so it
// documents all of them.
func TestSampleAgentConfig(t *testing.T) {
	data := readFile(t, "config/agent.yaml")
	got, err := config.Parse(data)
	if err != nil {
		t.Fatalf("config/agent.yaml: %v", err)
	}
	if want := config.Default(); !reflect.DeepEqual(*got, want) {
		t.Errorf("config/agent.yaml differs from the defaults:\n got %+v\nwant %+v", *got, want)
	}
	var tree map[string]any
	if err := yaml.Unmarshal(data, &tree); err != nil {
		t.Fatal(err)
	}
	for _, path := range fieldPaths(reflect.TypeOf(config.Config{}), "") {
		if !hasPath(tree, path) {
			t.Errorf("config/agent.yaml does not show %s", path)
		}
	}
}

// fieldPaths lists the dotted JSON names of every leaf field of a struct.
func fieldPaths(t reflect.Type, prefix string) []string {
	var out []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		ft := f.Type
		if ft.Kind() == reflect.Struct && ft.NumField() > 0 && ft.Field(0).IsExported() && ft.Field(0).Tag.Get("json") != "" {
			out = append(out, fieldPaths(ft, prefix+name+".")...)
			continue
		}
		out = append(out, prefix+name)
	}
	return out
}

func hasPath(m map[string]any, path string) bool {
	head, rest, more := strings.Cut(path, ".")
	v, ok := m[head]
	if !ok {
		return false
	}
	if !more {
		return true
	}
	sub, ok := v.(map[string]any)
	return ok && hasPath(sub, rest)
}

// TestExamples: every example decodes strictly into the API types and asks
// for the resource the way kvpool expects.
func TestExamples(t *testing.T) {
	for _, file := range []string{"config/examples/inference-pod.yaml", "config/examples/inference-deployment.yaml"} {
		t.Run(file, func(t *testing.T) {
			docs, err := splitDocs(readFile(t, file))
			if err != nil {
				t.Fatal(err)
			}
			if len(docs) == 0 {
				t.Fatal("no objects")
			}
			for _, doc := range docs {
				o := decodeDoc(t, file, doc)
				var spec corev1.PodSpec
				switch obj := o.typed.(type) {
				case *corev1.Pod:
					spec = obj.Spec
				case *appsv1.Deployment:
					spec = obj.Spec.Template.Spec
					if !reflect.DeepEqual(obj.Spec.Selector.MatchLabels, selectSubset(obj.Spec.Template.Labels, obj.Spec.Selector.MatchLabels)) {
						t.Errorf("selector %v does not match the template labels %v", obj.Spec.Selector.MatchLabels, obj.Spec.Template.Labels)
					}
				default:
					t.Fatalf("unexpected %T", obj)
				}
				checkClientPod(t, spec)
			}
		})
	}
}

func selectSubset(labels, sel map[string]string) map[string]string {
	out := map[string]string{}
	for k := range sel {
		if v, ok := labels[k]; ok {
			out[k] = v
		}
	}
	return out
}

func checkClientPod(t *testing.T, spec corev1.PodSpec) {
	t.Helper()
	var asked bool
	for _, c := range spec.Containers {
		q, ok := c.Resources.Limits[corev1.ResourceName(contract.DefaultResourceName)]
		if !ok {
			continue
		}
		asked = true
		if q.Sign() <= 0 || q.Cmp(*resource.NewQuantity(q.Value(), resource.DecimalSI)) != 0 {
			t.Errorf("%s: %s = %s, want a positive whole number of chunks", c.Name, contract.DefaultResourceName, q.String())
		}
		if r, ok := c.Resources.Requests[corev1.ResourceName(contract.DefaultResourceName)]; ok && r.Cmp(q) != 0 {
			t.Errorf("%s: extended resource request %s != limit %s", c.Name, r.String(), q.String())
		}
		// The socket path and the token come from Allocate; a value in the
		// spec would shadow or contradict them.
		for _, e := range c.Env {
			if e.Name == contract.EnvSocket || e.Name == contract.EnvToken {
				t.Errorf("%s: sets %s itself; Allocate provides it", c.Name, e.Name)
			}
		}
		if !strings.Contains(c.Image, "kvclient") {
			t.Errorf("%s: image %s, want the kvclient example client", c.Name, c.Image)
		}
	}
	if !asked {
		t.Errorf("no container requests %s", contract.DefaultResourceName)
	}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s mounts host path %s; the socket directory comes from Allocate", v.Name, v.HostPath.Path)
		}
	}
}
