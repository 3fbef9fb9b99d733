package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/cli"
	"helm.sh/helm/v4/pkg/kube"
	"sigs.k8s.io/yaml"
)

// releaseFlags are the flags install, upgrade and uninstall share.
type releaseFlags struct {
	chart, name, namespace, values, kubeconfig string
	timeout                                    time.Duration
}

func parseRelease(cmd string, args []string, needChart bool) (*releaseFlags, error) {
	f := &releaseFlags{}
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.StringVar(&f.chart, "chart", "", "chart directory")
	fs.StringVar(&f.name, "name", "kvpool", "release name")
	fs.StringVar(&f.namespace, "namespace", "kvpool-system", "release namespace (install creates it)")
	fs.StringVar(&f.values, "values", "", "values file merged over the chart's defaults")
	fs.StringVar(&f.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig (default $KUBECONFIG)")
	fs.DurationVar(&f.timeout, "timeout", 2*time.Minute, "give up after this long")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("%s: unexpected arguments %q", cmd, fs.Args())
	}
	if needChart && f.chart == "" {
		return nil, fmt.Errorf("%s: -chart is required", cmd)
	}
	if f.kubeconfig == "" {
		return nil, fmt.Errorf("%s: no kubeconfig (-kubeconfig or $KUBECONFIG)", cmd)
	}
	return f, nil
}

// config is the Helm action configuration for the release's namespace,
// storing releases as Secrets as the helm CLI does.
func (f *releaseFlags) config() (*action.Configuration, error) {
	settings := cli.New()
	settings.KubeConfig = f.kubeconfig
	settings.SetNamespace(f.namespace)
	cfg := action.NewConfiguration(action.ConfigurationSetLogger(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err := cfg.Init(settings.RESTClientGetter(), f.namespace, "secret"); err != nil {
		return nil, fmt.Errorf("helm configuration: %w", err)
	}
	return cfg, nil
}

func (f *releaseFlags) load() (map[string]any, error) {
	vals := map[string]any{}
	if f.values == "" {
		return vals, nil
	}
	b, err := os.ReadFile(f.values)
	if err != nil {
		return nil, err
	}
	if err := yaml.Unmarshal(b, &vals); err != nil {
		return nil, fmt.Errorf("values %s: %w", f.values, err)
	}
	return vals, nil
}

// runRelease is `install`, `upgrade` or `uninstall`: what `helm install
// --create-namespace`, `helm upgrade` and `helm uninstall` do, through the
// Helm SDK. None waits for the workloads: the caller watches them and can
// say what went wrong.
func runRelease(cmd string, args []string) error {
	f, err := parseRelease(cmd, args, cmd != "uninstall")
	if err != nil {
		return err
	}
	cfg, err := f.config()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.timeout)
	defer cancel()
	switch cmd {
	case "uninstall":
		u := action.NewUninstall(cfg)
		u.WaitStrategy = kube.HookOnlyStrategy
		u.Timeout = f.timeout
		res, err := u.Run(f.name)
		if err != nil {
			return fmt.Errorf("uninstall %s: %w", f.name, err)
		}
		fmt.Printf("uninstalled %s: %s\n", f.name, res.Info)
		return nil
	case "install", "upgrade":
	default:
		return fmt.Errorf("unknown command %q", cmd)
	}
	ch, err := loader.Load(f.chart)
	if err != nil {
		return fmt.Errorf("load chart %s: %w", f.chart, err)
	}
	vals, err := f.load()
	if err != nil {
		return err
	}
	if cmd == "install" {
		in := action.NewInstall(cfg)
		in.ReleaseName, in.Namespace, in.CreateNamespace = f.name, f.namespace, true
		in.WaitStrategy, in.Timeout = kube.HookOnlyStrategy, f.timeout
		rel, err := in.RunWithContext(ctx, ch, vals)
		if err != nil {
			return fmt.Errorf("install %s: %w", f.name, err)
		}
		fmt.Printf("installed %s\n", describe(rel))
		return nil
	}
	up := action.NewUpgrade(cfg)
	up.Namespace = f.namespace
	up.WaitStrategy, up.Timeout = kube.HookOnlyStrategy, f.timeout
	rel, err := up.RunWithContext(ctx, f.name, ch, vals)
	if err != nil {
		return fmt.Errorf("upgrade %s: %w", f.name, err)
	}
	fmt.Printf("upgraded %s\n", describe(rel))
	return nil
}

func describe(rel any) string {
	if r, ok := rel.(interface{ GetName() string }); ok {
		return r.GetName()
	}
	if rel == nil {
		return "(no release)"
	}
	return fmt.Sprintf("%T", rel)
}

var errUsage = errors.New(`usage:
  kvpool-helm render    -chart DIR [-name N] [-namespace NS] [-values FILE]
  kvpool-helm install   -chart DIR [-name N] [-namespace NS] [-values FILE] [-kubeconfig F] [-timeout D]
  kvpool-helm upgrade   -chart DIR [-name N] [-namespace NS] [-values FILE] [-kubeconfig F] [-timeout D]
  kvpool-helm uninstall [-name N] [-namespace NS] [-kubeconfig F] [-timeout D]`)
