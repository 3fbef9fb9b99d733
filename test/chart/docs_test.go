package chart_test

import (
	"regexp"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// valuePaths lists the dotted paths of values.yaml: leaves, empty maps and
// lists (a list or a free-form map is documented as one value).
func valuePaths(m map[string]any, prefix string) []string {
	var out []string
	for k, v := range m {
		p := prefix + k
		if sub, ok := v.(map[string]any); ok && len(sub) > 0 && !freeForm[p] {
			out = append(out, valuePaths(sub, p+".")...)
			continue
		}
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// freeForm values are maps passed through as a whole (labels, probe timing).
var freeForm = map[string]bool{
	"nodeSelector":            true,
	"affinity":                true,
	"resources":               true,
	"podSecurityContext":      true,
	"securityContext":         true,
	"grafanaDashboard.labels": true,
	"health.livenessProbe":    true,
	"health.readinessProbe":   true,
	"health.startupProbe":     true,
}

// TestValuesDocumented: every value in values.yaml has a row in the chart
// README's table, and every row names a real value.
func TestValuesDocumented(t *testing.T) {
	var vals map[string]any
	if err := yaml.Unmarshal(readFile(t, "charts/kvpool/values.yaml"), &vals); err != nil {
		t.Fatal(err)
	}
	readme := string(readFile(t, "charts/kvpool/README.md"))
	_, readme, ok := strings.Cut(readme, "\n## Values\n")
	if !ok {
		t.Fatal("charts/kvpool/README.md has no Values section")
	}
	readme, _, _ = strings.Cut(readme, "\n## ")
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([A-Za-z0-9_.]+)` \\|").FindAllStringSubmatch(readme, -1) {
		rows[m[1]] = true
	}
	paths := valuePaths(vals, "")
	known := map[string]bool{}
	for _, p := range paths {
		known[p] = true
		if !rows[p] {
			t.Errorf("value %s is not documented in charts/kvpool/README.md", p)
		}
	}
	for r := range rows {
		if !known[r] {
			t.Errorf("README documents %s, which values.yaml does not have", r)
		}
	}
	if len(paths) < 40 {
		t.Errorf("only %d values found; the walk is broken", len(paths))
	}
}
