package v1alpha1_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// controllerGenVersion is the version hack/gen-api.sh pins and installs.
const controllerGenVersion = "v0.23.0"

// controllerGen is where hack/gen-api.sh caches controller-gen, or "" when
// it is not there.
func controllerGen(t *testing.T) string {
	t.Helper()
	tools := os.Getenv("KVPOOL_TOOLS")
	if tools == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return ""
			}
			cache = filepath.Join(home, ".cache")
		}
		tools = filepath.Join(cache, "kvpool", "tools")
	}
	bin := filepath.Join(tools, "controller-gen-"+controllerGenVersion, "controller-gen")
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() {
		return ""
	}
	return bin
}

// The committed deep copies and CRDs are what controller-gen makes from the
// types now: a change to types.go without hack/gen-api.sh fails here. The
// tool is not built by the tests (that needs the module proxy and a minute);
// without it the test skips and says how to run it.
func TestGeneratedFilesCurrent(t *testing.T) {
	bin := controllerGen(t)
	if bin == "" {
		t.Skip("controller-gen " + controllerGenVersion + " is not installed; `hack/gen-api.sh --path` installs it, then this test checks the generated files")
	}
	out := t.TempDir()
	root := filepath.Join("..", "..")
	cmd := exec.Command(bin, "object", "paths=./api/...", "output:object:dir="+out,
		"crd", "paths=./api/...", "output:crd:dir="+out)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, b)
	}
	for _, c := range []struct{ generated, committed string }{
		{"zz_generated.deepcopy.go", "api/v1alpha1/zz_generated.deepcopy.go"},
		{"kvpool.io_kvpoolnodes.yaml", "config/crd/kvpool.io_kvpoolnodes.yaml"},
		{"kvpool.io_kvpoolnodes.yaml", "charts/kvpool/crds/kvpool.io_kvpoolnodes.yaml"},
	} {
		want, err := os.ReadFile(filepath.Join(out, c.generated))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(root, c.committed))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is not what controller-gen %s makes from the types; run hack/gen-api.sh", c.committed, controllerGenVersion)
		}
	}
}
