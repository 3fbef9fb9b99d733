// Command kvpool-helm is the Helm SDK for the e2e stage, without the helm
// binary:
//
//	kvpool-helm render -chart charts/kvpool [-namespace NS] [-values extra.yaml]
//	kvpool-helm install|upgrade -chart charts/kvpool [-namespace NS] [-values extra.yaml]
//	kvpool-helm uninstall [-name kvpool] [-namespace NS]
//
// render writes the manifests `helm install` would create to stdout as one
// multi-document YAML stream, in the order of their template paths (the e2e
// test sends them to the apiserver with a server-side dry run); install,
// upgrade and uninstall are those Helm actions against $KUBECONFIG.
//
// It lives in its own module so that the Helm SDK does not change the
// dependency versions that kube-apiserver and the kubelet are built with.
package main

import (
	"errors"
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
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, errUsage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	var err error
	switch cmd {
	case "render":
		err = render(args)
	case "install", "upgrade", "uninstall":
		err = runRelease(cmd, args)
	default:
		fmt.Fprintln(os.Stderr, errUsage)
		os.Exit(2)
	}
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvpool-helm %s: %v\n", cmd, err)
		os.Exit(1)
	}
}

func render(args []string) error {
	fs := flag.NewFlagSet("render", flag.ContinueOnError)
	dir := fs.String("chart", "", "chart directory")
	name := fs.String("name", "kvpool", "release name")
	ns := fs.String("namespace", "kvpool-system", "release namespace")
	valuesFile := fs.String("values", "", "optional values file merged over the chart's defaults")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return run(*dir, *name, *ns, *valuesFile)
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
