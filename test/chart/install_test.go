package chart_test

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/chart/loader"
	chartv2 "helm.sh/helm/v4/pkg/chart/v2"
	releasev1 "helm.sh/helm/v4/pkg/release/v1"
	appsv1 "k8s.io/api/apps/v1"
)

// TestInstallDryRun runs Helm's own install action, client-side dry run
// (what `helm install --dry-run=client` does): the chart installs as a
// release, with its CRD first in the manifest, hooks none, and NOTES that tell
// the operator the right commands for this release.
func TestInstallDryRun(t *testing.T) {
	ch, err := loader.Load(chartDir(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg := action.NewConfiguration(action.ConfigurationSetLogger(slog.NewTextHandler(io.Discard, nil)))
	in := action.NewInstall(cfg)
	in.DryRunStrategy = action.DryRunClient
	in.ReleaseName = "kv"
	in.Namespace = namespace
	in.IncludeCRDs = true
	r, err := in.Run(ch.(*chartv2.Chart), parseValues(t, "resourceName: example.com/kv\npool: {bytes: 32Gi}"))
	if err != nil {
		t.Fatalf("install --dry-run=client: %v", err)
	}
	rel, ok := r.(*releasev1.Release)
	if !ok {
		t.Fatalf("release is a %T", r)
	}
	if len(rel.Hooks) != 0 {
		t.Errorf("%d hooks; the chart has none", len(rel.Hooks))
	}
	docs, err := splitDocs([]byte(rel.Manifest))
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) == 0 || !strings.Contains(string(docs[0]), "kind: CustomResourceDefinition") {
		t.Fatal("the manifest does not start with the KVPoolNode CRD")
	}
	var ds *appsv1.DaemonSet
	for _, d := range docs[1:] {
		if o := decodeDoc(t, "manifest", d); o.kind == "DaemonSet" && !strings.HasSuffix(o.name, "-keeper") {
			ds = o.typed.(*appsv1.DaemonSet)
		}
	}
	if ds == nil || ds.Name != "kv-kvpool" {
		t.Fatalf("no DaemonSet kv-kvpool in the release manifest")
	}
	notes := rel.Info.Notes
	for _, want := range []string{
		"rollout status daemonset/kv-kvpool",
		"kubectl -n " + namespace,
		`allocatable.example\.com/kv`,
		"example.com/kv: 4",
		"pins 32Gi",
	} {
		if !strings.Contains(notes, want) {
			t.Errorf("NOTES lack %q:\n%s", want, notes)
		}
	}
}
