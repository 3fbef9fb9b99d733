// Command render-chart renders a Helm chart the way `helm install` would and
// writes the manifests to stdout as one multi-document YAML stream, in the
// order of their template paths. The e2e test sends them to a real
// kube-apiserver with a server-side dry run.
//
// It lives in its own module so that the Helm SDK does not change the
// dependency versions that kube-apiserver and the kubelet are built with.
//
//	render-chart -chart charts/kvpool -namespace kvpool-system [-values extra.yaml]
package main

import (
	"flag"
	"fmt"
	"os"
	"path"
	"sort"
	"strings"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/engine"
	"sigs.k8s.io/yaml"
)

func main() {
	dir := flag.String("chart", "", "chart directory")
	name := flag.String("name", "kvpool", "release name")
	ns := flag.String("namespace", "kvpool-system", "release namespace")
	valuesFile := flag.String("values", "", "optional values file merged over the chart's defaults")
	flag.Parse()
	if err := run(*dir, *name, *ns, *valuesFile); err != nil {
		fmt.Fprintln(os.Stderr, "render-chart:", err)
		os.Exit(1)
	}
}

func run(dir, name, ns, valuesFile string) error {
	if dir == "" {
		return fmt.Errorf("-chart is required")
	}
	ch, err := loader.Load(dir)
	if err != nil {
		return fmt.Errorf("load chart %s: %w", dir, err)
	}
	vals := map[string]any{}
	if valuesFile != "" {
		b, err := os.ReadFile(valuesFile)
		if err != nil {
			return err
		}
		if err := yaml.Unmarshal(b, &vals); err != nil {
			return fmt.Errorf("values %s: %w", valuesFile, err)
		}
	}
	opts := common.ReleaseOptions{Name: name, Namespace: ns, Revision: 1, IsInstall: true}
	rv, err := util.ToRenderValues(ch, vals, opts, common.DefaultCapabilities)
	if err != nil {
		return fmt.Errorf("values: %w", err)
	}
	out, err := engine.Render(ch, rv)
	if err != nil {
		return fmt.Errorf("render: %w", err)
	}
	paths := make([]string, 0, len(out))
	for p := range out {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		body := strings.TrimSpace(out[p])
		if body == "" || path.Ext(p) == ".txt" || strings.HasPrefix(path.Base(p), "_") {
			continue
		}
		fmt.Printf("---\n# Source: %s\n%s\n", p, body)
	}
	return nil
}
