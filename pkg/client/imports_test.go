package client_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The client side (client, wire, cudart) must stay free of the agent's
// packages, so that it can become a module of its own: it may take the pod
// contract (contract), the pool's error values (poolerr) and the Unix-socket
// plumbing (unixsock), nothing that allocates, serves or sizes the pool.
// Every agent-only package lives under
// internal/; the agent-side packages the project's layout keeps in pkg/ are
// named here.
func TestClientSideImportsNoAgentPackage(t *testing.T) {
	const mod = "github.com/kvpool/kvpool/"
	forbidden := []string{"internal", "pkg/pool", "pkg/plugin", "pkg/observe", "pkg/standalone"}
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	for _, cgo := range []string{"0", "1"} {
		cmd := exec.Command(goTool, "list", "-deps", mod+"pkg/client", mod+"pkg/wire", mod+"pkg/cudart")
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+cgo)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps (CGO_ENABLED=%s): %v (is the go tool on PATH?)", cgo, err)
		}
		deps := strings.Fields(string(out))
		if !containsPkg(deps, mod+"pkg/client") || !containsPkg(deps, mod+"pkg/wire") {
			t.Fatalf("go list -deps lists no client or wire: %q", deps)
		}
		for _, d := range deps {
			for _, f := range forbidden {
				if d == mod+f || strings.HasPrefix(d, mod+f+"/") {
					t.Errorf("CGO_ENABLED=%s: the client side imports %s", cgo, d)
				}
			}
		}
	}
}

func containsPkg(deps []string, p string) bool {
	for _, d := range deps {
		if d == p {
			return true
		}
	}
	return false
}
