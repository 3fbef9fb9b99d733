package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"k8s.io/client-go/rest"

	"github.com/kvpool/kvpool/internal/sizing"
)

// The fake /proc and /sys trees of internal/node.
const (
	twoNUMA = "../../internal/node/testdata/v2-two-numa"
	hybrid  = "../../internal/node/testdata/v1-hybrid"
)

func noNVML() nvml.Interface {
	return &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
}

func dgx() nvml.Interface {
	srv := dgxh100.New()
	for i, d := range srv.Devices {
		numa := i / 4
		d.(*server.Device).GetNumaNodeIdFunc = func() (int, nvml.Return) { return numa, nvml.SUCCESS }
	}
	return srv
}

func noEnv(string) string { return "" }

func TestPlanStandaloneTable(t *testing.T) {
	var out bytes.Buffer
	if err := plan(context.Background(), []string{"--standalone", "--root", hybrid}, &out, noEnv, noNVML()); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{
		"mode standalone, GPUs from simulated (2; no NVML on this node)",
		"cgroup limit 16Gi (cgroup v1)",
		"sizing.poolBytes", "<- binds",
		"pool: 512Mi in 64Mi chunks",
		"GPU  UUID", "0    GPU-sim-00000000  0     256Mi  4       4Ki   sizing.poolBytes",
		"1    GPU-sim-00000001  0     256Mi  4       4Ki   sizing.poolBytes",
		"warning: GPU 0: not enough huge pages",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
}

func TestPlanDGXJSON(t *testing.T) {
	var out bytes.Buffer
	args := []string{"--json", "--root", twoNUMA, "--pool-bytes", "512Gi", "--huge-pages", "never"}
	if err := plan(context.Background(), args, &out, noEnv, dgx()); err != nil {
		t.Fatal(err)
	}
	var r planReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	// The tree's pod cgroup allows 300Gi: 299.5Gi less the page tables of
	// its mapping (597Mi) and the sessions' page links (299Mi) over 8 GPUs
	// is 37 1Gi chunks each.
	if r.Mode != "node" || r.GPUs != "NVML" || r.Plan.Bound != sizing.BoundCgroup || len(r.Plan.GPUs) != 8 {
		t.Fatalf("report %+v", r)
	}
	for i, g := range r.Plan.GPUs {
		if g.GPU != i || g.NUMA != i/4 || g.Chunks != 37 || g.Bytes != 37<<30 || g.PageSize != int64(os.Getpagesize()) || !strings.HasPrefix(g.UUID, "GPU-") {
			t.Errorf("GPU %d plan %+v", i, g)
		}
	}
	if r.Node.CgroupLimit != 300<<30 || r.Node.NUMANodes != 2 {
		t.Errorf("node %+v", r.Node)
	}
}

// The estimate at a given rate (--pin-rate) on the DGX tree: two NUMA
// nodes of four GPUs, pinned side by side, the GPUs of a node in turn.
func TestPlanPinEstimateGiven(t *testing.T) {
	var out bytes.Buffer
	args := []string{"--json", "--root", twoNUMA, "--pool-bytes", "512Gi", "--huge-pages", "never", "--pin-rate", "2Gi"}
	if err := plan(context.Background(), args, &out, noEnv, dgx()); err != nil {
		t.Fatal(err)
	}
	var r planReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	e := r.PinEstimate
	if e == nil || e.Source != "--pin-rate" || len(e.Nodes) != 2 || r.NoPinEstimate != "" {
		t.Fatalf("estimate %+v (none: %q)", e, r.NoPinEstimate)
	}
	for i, n := range e.Nodes {
		// 4 GPUs of 37 1Gi chunks at 2Gi/s; the tree's nodes have 64 CPUs
		// each, so 8 workers.
		if n.NUMA != i || n.GPUs != 4 || n.Bytes != 4*37<<30 || n.Workers != 8 || n.PinBytesPerSecond != 2<<30 || n.ReadySeconds != 74 || n.Ratio != 0 {
			t.Errorf("node %d: %+v", i, n)
		}
	}
	if e.FirstChunkSeconds != 0.5 || e.EveryGPUSeconds != 2 || e.ReadySeconds != 74 || e.Note != "" {
		t.Errorf("estimate %+v", e)
	}
	out.Reset()
	if err := plan(context.Background(), args[1:], &out, noEnv, dgx()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"pinning estimate (a rate given by --pin-rate)", "first chunk in 0.50 s, every GPU serving in 2.00 s, pool ready in 74.0 s"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
	// Another node's tree and no rate: no estimate, and why.
	out.Reset()
	if err := plan(context.Background(), args[:len(args)-2], &out, noEnv, dgx()); err != nil {
		t.Fatal(err)
	}
	r = planReport{}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.PinEstimate != nil || !strings.Contains(r.NoPinEstimate, "give its rate with --pin-rate") {
		t.Errorf("without a rate: %v, %q", err, r.NoPinEstimate)
	}
}

// The probe pins on this machine's NUMA nodes and measures a memset of
// fresh memory beside it.
func TestPlanPinProbe(t *testing.T) {
	var out bytes.Buffer
	if err := plan(context.Background(), []string{"--json", "--standalone", "--pin-probe", "8Mi"}, &out, noEnv, noNVML()); err != nil {
		t.Fatal(err)
	}
	var r planReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	e := r.PinEstimate
	if e == nil || e.Source != "probe" || e.ProbeBytes != 8<<20 || len(e.Nodes) == 0 {
		t.Fatalf("estimate %+v (none: %q)", e, r.NoPinEstimate)
	}
	var total int64
	for _, n := range e.Nodes {
		total += n.Bytes
		if n.PinBytesPerSecond <= 0 || n.MemsetBytesPerSecond <= 0 || n.Ratio <= 0 || n.Workers < 1 || n.ReadySeconds <= 0 {
			t.Errorf("node %+v", n)
		}
	}
	if total != r.Plan.Total || e.ReadySeconds <= 0 || e.FirstChunkSeconds <= 0 || e.FirstChunkSeconds > e.ReadySeconds {
		t.Errorf("estimate %+v for a %d-byte pool", e, r.Plan.Total)
	}
	out.Reset()
	if err := plan(context.Background(), []string{"--json", "--standalone", "--pin-probe", "0"}, &out, noEnv, noNVML()); err != nil {
		t.Fatal(err)
	}
	r = planReport{}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.PinEstimate != nil || r.NoPinEstimate != "--pin-probe 0" {
		t.Errorf("--pin-probe 0: %v, %+v, %q", err, r.PinEstimate, r.NoPinEstimate)
	}
}

func TestPlanHelp(t *testing.T) {
	var out bytes.Buffer
	if err := plan(context.Background(), []string{"--help"}, &out, noEnv, noNVML()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"usage: agent plan", "-pool-bytes", "KVPOOL_POOL_BYTES", "-json"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("help lacks %q", want)
		}
	}
}

func TestPlanErrors(t *testing.T) {
	cases := []struct {
		name string
		args []string
		env  map[string]string
		lib  nvml.Interface
		want string
	}{
		{"no NVML without standalone", []string{"--root", hybrid}, nil, noNVML(), "use --simulate-gpus N"},
		{"simulate with standalone", []string{"--root", hybrid, "--standalone", "--simulate-gpus", "2"}, nil, noNVML(), "does not go with --standalone"},
		{"simulate negative", []string{"--root", hybrid, "--simulate-gpus", "-1"}, nil, noNVML(), "positive count"},
		{"unknown flag", []string{"--bogus"}, nil, noNVML(), "flag provided but not defined: -bogus"},
		{"stray argument", []string{"--standalone", "now"}, nil, noNVML(), `unexpected arguments ["now"]`},
		{"bad flag value", []string{"--split", "numa", "--standalone"}, nil, noNVML(), "sizing.split"},
		{"bad env value", []string{"--standalone"}, map[string]string{"KVPOOL_CHUNK_BYTES": "1GB"}, noNVML(), "KVPOOL_CHUNK_BYTES"},
		{"missing root", []string{"--standalone", "--root", "/nonexistent"}, nil, noNVML(), "no such file"},
		{"policy cannot be met", []string{"--root", twoNUMA, "--min-per-gpu", "64Gi"}, nil, dgx(), "less than sizing.minPerGPU 64Gi"},
		{"NVML fails", []string{"--root", twoNUMA}, nil, &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_NO_PERMISSION }}, "nvmlInit"},
		{"negative probe", []string{"--standalone", "--pin-probe", "-1Mi"}, nil, noNVML(), `invalid value "-1Mi" for flag -pin-probe: quantity "-1Mi": want a non-negative number`},
		{"bad rate", []string{"--standalone", "--pin-rate", "fast"}, nil, noNVML(), `invalid value "fast" for flag -pin-rate`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			env := func(k string) string { return c.env[k] }
			var out bytes.Buffer
			err := plan(context.Background(), c.args, &out, env, c.lib)
			if err == nil || !strings.Contains(err.Error()+out.String(), c.want) {
				t.Errorf("err %v (output %q), want %q", err, out.String(), c.want)
			}
		})
	}
}

// TestPlanProcess runs `agent plan` through main in a child process, on
// this machine's real /proc and /sys and the real NVML loader.
func TestPlanProcess(t *testing.T) {
	cmd := exec.Command(os.Args[0], "plan", "--standalone", "--json")
	cmd.Env = append(os.Environ(), "KVPOOL_TEST_RUN_MAIN=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("agent plan: %v\n%s", err, out)
	}
	var r planReport
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if r.Mode != "standalone" || r.Plan.Total <= 0 || len(r.Plan.GPUs) == 0 {
		t.Errorf("report %+v", r)
	}
	t.Logf("GPUs from %s; pool %d bytes", r.GPUs, r.Plan.Total)
	cmd = exec.Command(os.Args[0], "plan", "--split=bad", "--standalone")
	cmd.Env = append(os.Environ(), "KVPOOL_TEST_RUN_MAIN=1")
	out, err = cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "sizing.split") {
		t.Errorf("bad flag: err %v, output %q", err, out)
	}
}

// TestPlanInCluster serves a Node from a fake API server over HTTP: its
// allocatable memory binds the plan; when the server refuses, the plan
// goes on without it.
func TestPlanInCluster(t *testing.T) {
	var status int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/nodes/gpu-1" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		if status != http.StatusOK {
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"nodes \"gpu-1\" is forbidden","reason":"Forbidden","code":403}`)
			return
		}
		fmt.Fprint(w, `{"kind":"Node","apiVersion":"v1","metadata":{"name":"gpu-1"},
			"status":{"capacity":{"memory":"512Gi"},"allocatable":{"memory":"100Gi","hugepages-2Mi":"0"}}}`)
	}))
	defer srv.Close()
	old := inClusterConfig
	inClusterConfig = func() (*rest.Config, error) { return &rest.Config{Host: srv.URL}, nil }
	defer func() { inClusterConfig = old }()
	env := func(k string) string {
		return map[string]string{"KUBERNETES_SERVICE_HOST": "10.0.0.1", "NODE_NAME": "gpu-1"}[k]
	}
	args := []string{"--json", "--root", twoNUMA, "--pool-bytes", "512Gi", "--huge-pages", "never"}

	status = http.StatusOK
	var out bytes.Buffer
	if err := plan(context.Background(), args, &out, env, dgx()); err != nil {
		t.Fatal(err)
	}
	var r planReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Node.Allocatable != 100<<30 || r.Plan.Bound != "node allocatable memory" || r.Plan.GPUs[0].Chunks != 12 {
		t.Errorf("allocatable %d, bound %q, GPU 0 %+v", r.Node.Allocatable, r.Plan.Bound, r.Plan.GPUs[0])
	}

	status = http.StatusForbidden
	out.Reset()
	if err := plan(context.Background(), args, &out, env, dgx()); err != nil {
		t.Fatal(err)
	}
	r = planReport{}
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Node.Allocatable != 0 || r.Plan.Bound != sizing.BoundCgroup {
		t.Errorf("forbidden: allocatable %d, bound %q", r.Node.Allocatable, r.Plan.Bound)
	}
}

// --simulate-gpus plans the configuration's own sizing (node mode, not
// standalone's pool) for simulated GPUs where NVML is absent.
func TestPlanSimulatedGPUs(t *testing.T) {
	cfg := t.TempDir() + "/agent.yaml"
	if err := os.WriteFile(cfg, []byte("apiVersion: config.kvpool.io/v1alpha1\nkind: AgentConfig\nsizing: {poolBytes: 12Gi, chunkBytes: 2Gi, hugePages: never}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := plan(context.Background(), []string{"--config", cfg, "--simulate-gpus", "3", "--json", "--root", twoNUMA}, &out, noEnv, noNVML()); err != nil {
		t.Fatal(err)
	}
	var r planReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Mode != "node" || r.GPUs != "simulated (--simulate-gpus 3)" || len(r.Plan.GPUs) != 3 || r.Plan.Total != 12<<30 || r.Plan.ChunkBytes != 2<<30 {
		t.Fatalf("plan %+v: mode %q, GPUs %q", r.Plan, r.Mode, r.GPUs)
	}
}
