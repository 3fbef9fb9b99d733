package chart_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/loader"
	"helm.sh/helm/v4/pkg/engine"
)

// TestServerDryRun sends every rendered value set and every example to a
// real kube-apiserver with `kubectl create --dry-run=server`, so the
// apiserver's own validation (names, enums, resource rules, defaults) runs
// on them. It needs a reachable apiserver: set KVPOOL_DRYRUN_KUBECONFIG to
// its kubeconfig (hack/e2e's node, or any cluster; nothing is created).
// Objects are rendered into the "default" namespace, which always exists.
func TestServerDryRun(t *testing.T) {
	kubeconfig := os.Getenv("KVPOOL_DRYRUN_KUBECONFIG")
	if kubeconfig == "" {
		t.Skip("KVPOOL_DRYRUN_KUBECONFIG is unset: no apiserver to validate against (strict decoding in TestRender still runs)")
	}
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Fatalf("KVPOOL_DRYRUN_KUBECONFIG is set but kubectl is not on PATH: %v", err)
	}
	hasServiceMonitor := exec.Command(kubectl, "--kubeconfig", kubeconfig, "get", "--raw", "/apis/monitoring.coreos.com/v1").Run() == nil
	dryRun := func(t *testing.T, what string, manifest []byte) {
		t.Helper()
		cmd := exec.Command(kubectl, "--kubeconfig", kubeconfig, "create", "--dry-run=server", "-o", "name", "-f", "-")
		cmd.Stdin = bytes.NewReader(manifest)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: the apiserver rejects it: %v\n%s", what, err, out)
		}
		t.Logf("%s: accepted: %s", what, strings.Join(strings.Fields(string(out)), " "))
	}
	ch, err := loader.Load(chartDir(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, vs := range valueSets() {
		t.Run(vs.name, func(t *testing.T) {
			opts := common.ReleaseOptions{Name: releaseName, Namespace: "default", IsInstall: true}
			rv, err := util.ToRenderValues(ch, parseValues(t, vs.values), opts, common.DefaultCapabilities)
			if err != nil {
				t.Fatal(err)
			}
			files, err := engine.Render(ch, rv)
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for n := range files {
				names = append(names, n)
			}
			sort.Strings(names)
			var all bytes.Buffer
			for _, n := range names {
				if !strings.HasSuffix(n, ".yaml") {
					continue
				}
				docs, err := splitDocs([]byte(files[n]))
				if err != nil {
					t.Fatal(err)
				}
				for _, d := range docs {
					if bytes.Contains(d, []byte("kind: ServiceMonitor")) && !hasServiceMonitor {
						t.Logf("%s: the apiserver has no monitoring.coreos.com/v1; ServiceMonitor checked by strict field decoding only", n)
						continue
					}
					all.WriteString("---\n")
					all.Write(d)
				}
			}
			dryRun(t, "chart "+vs.name, all.Bytes())
		})
	}
	// The chart's CRD may already be installed there: apply, not create.
	t.Run("crds", func(t *testing.T) {
		cmd := exec.Command(kubectl, "--kubeconfig", kubeconfig, "apply", "--dry-run=server", "-o", "name", "-f", filepath.Join(chartDir(t), "crds"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("chart CRDs: the apiserver rejects them: %v\n%s", err, out)
		} else {
			t.Logf("chart CRDs: accepted: %s", strings.TrimSpace(string(out)))
		}
	})
	examples, _ := filepath.Glob(filepath.Join(repoRoot(t), "config", "examples", "*.yaml"))
	if len(examples) == 0 {
		t.Fatal("no config/examples/*.yaml")
	}
	for _, f := range examples {
		t.Run(filepath.Base(f), func(t *testing.T) {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			dryRun(t, f, b)
		})
	}
}
