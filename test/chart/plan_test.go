package chart_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/config"
)

// TestChartConfigPlans runs `agent plan --config <the chart's agent.yaml>
// --simulate-gpus 2` on a node tree without NVML, for value sets that size
// the pool differently: it plans what the file says (node mode, the file's
// sizing policy), not standalone mode's small pool (issue 23: on a node
// without NVML it stopped with "NVML not found", and --standalone planned
// its own pool).
func TestChartConfigPlans(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent: skipped with -short")
	}
	root := repoRoot(t)
	bin := filepath.Join(t.TempDir(), "agent")
	build := exec.Command("go", "build", "-o", bin, "./cmd/agent")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the agent: %v\n%s", err, out)
	}
	tree := filepath.Join(root, "internal", "node", "testdata", "v2-two-numa")
	for _, vs := range valueSets() {
		if vs.name != "defaults" && vs.name != "custom-resource-and-paths" { // the huge page sets require pages the tree lacks
			continue
		}
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			data := r.cm.Data["agent.yaml"]
			cfg, err := config.Parse([]byte(data))
			if err != nil {
				t.Fatal(err)
			}
			file := filepath.Join(t.TempDir(), "agent.yaml")
			if err := os.WriteFile(file, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(bin, "plan", "--config", file, "--simulate-gpus", "2", "--json", "--root", tree)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "LD_LIBRARY_PATH=/nonexistent"} // no NVML, no cluster
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("agent plan: %v\n%s%s", err, out, stderr.String())
			}
			var rep struct {
				Mode   string
				GPUs   string
				Policy config.Sizing
				Plan   struct {
					Total      int64 `json:"totalBytes"`
					ChunkBytes int64
					GPUs       []struct{ UUID string }
				}
			}
			if err := json.Unmarshal(out, &rep); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			if rep.Mode != "node" || !strings.Contains(rep.GPUs, "--simulate-gpus 2") || len(rep.Plan.GPUs) != 2 {
				t.Fatalf("plan: mode %q, GPUs %q, %d GPUs planned", rep.Mode, rep.GPUs, len(rep.Plan.GPUs))
			}
			want, _ := json.Marshal(cfg.Sizing)
			got, _ := json.Marshal(rep.Policy)
			if string(got) != string(want) {
				t.Fatalf("planned with policy %s, the chart's file says %s", got, want)
			}
			if p := int64(cfg.Sizing.PoolBytes); rep.Plan.Total <= 0 || p > 0 && rep.Plan.Total > p || rep.Plan.ChunkBytes != int64(cfg.Sizing.ChunkBytes) {
				t.Fatalf("pool %d in chunks of %d, the file asks %d in chunks of %d", rep.Plan.Total, rep.Plan.ChunkBytes, p, int64(cfg.Sizing.ChunkBytes))
			}
			t.Logf("%s: %d bytes in chunks of %d over %d GPUs (%s)", vs.name, rep.Plan.Total, rep.Plan.ChunkBytes, len(rep.Plan.GPUs), rep.GPUs)
		})
	}
}
