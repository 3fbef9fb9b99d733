package chart_test

import (
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/kvpool/kvpool/internal/config"
)

// TestChartAgreesWithLoader: whatever the chart accepts, the agent's loader
// accepts too, so no value that installs cleanly leaves the agent
// crash-looping on its config. Edge values on both sides of each rule; the
// good ones must render, the bad ones must be refused by the chart with a
// message naming the value.
func TestChartAgreesWithLoader(t *testing.T) {
	cases := []struct {
		values  string
		ok      bool
		mention string // for bad values: the chart's error names this
	}{
		{"pool: {chunkBytes: 2Mi}", true, ""},
		{"pool: {chunkBytes: 64Gi, bytes: 64Gi}", true, ""},
		{"pool: {chunkBytes: 1Mi}", false, "pool.chunkBytes"},
		{"pool: {chunkBytes: 3Mi}", false, "pool.chunkBytes"},
		{"pool: {chunkBytes: 2M}", false, "pool.chunkBytes"},
		{"pool: {chunkBytes: 128Gi, bytes: 256Gi}", false, "pool.chunkBytes"},
		{"pool: {bytes: 1Gi, chunkBytes: 1Gi}", true, ""},
		{"pool: {bytes: 1023Mi, chunkBytes: 1Gi}", false, "less than one chunk"},
		{"pool: {minPerGPU: 4Gi, maxPerGPU: 4Gi}", true, ""},
		{"pool: {minPerGPU: 8Gi, maxPerGPU: 4Gi}", false, "pool.minPerGPU"},
		{"pool: {minPerGPU: 8Gi}", true, ""},
		{"pool: {maxPerGPU: \"0\"}", true, ""},
		{"resourceName: example.k8s.io/kv", false, "resourceName"},
		{"resourceName: kvpool.io/" + strings.Repeat("a", 63), true, ""},
		{"resourceName: kvpool.io/" + strings.Repeat("a", 64), false, "resourceName"},
		{"resourceName: kvpool.io/-kv", false, "resourceName"},
		{"paths: {socketDir: /" + strings.Repeat("s", 94) + "}", true, ""},
		{"paths: {socketDir: /" + strings.Repeat("s", 95) + "}", false, "paths.socketDir"},
		{"paths: {kubeletDir: relative/kubelet}", false, "kubeletDir"},
		{"reclaim: {interval: 0s}", false, "interval"},
		{"reclaim: {interval: 500ms}", true, ""},
		{"reclaim: {gracePeriod: 0s}", true, ""},
		{"reclaim: {gracePeriod: 1h30m}", true, ""},
		{"metrics: {port: 65535}", true, ""},
		{"log: {level: debug, format: text}", true, ""},
		{"gpuResources: [example.com/gpu, example.com/slice-*, example.com/*]", true, ""},
		{"gpuResources: []", true, ""},
		{"gpuResources: [kubernetes.io/gpu]", false, "gpuResources"},
		{"gpuResources: [gpu.k8s.io/gpu]", false, "gpuResources"},
		{"gpuResources: [requests.example.com/gpu]", false, "gpuResources"},
		{"gpuResources: [nvidia.com/g*pu]", false, "gpuResources"},
		{"gpuResources: [nvidia.com]", false, "gpuResources"},
		{"gpuResources: [\"*\"]", false, "gpuResources"},
	}
	for _, tc := range cases {
		t.Run(tc.values, func(t *testing.T) {
			files, err := render(t, parseValues(t, tc.values))
			if err != nil {
				if tc.ok {
					t.Fatalf("the chart refuses good values: %v", err)
				}
				if !strings.Contains(err.Error(), tc.mention) {
					t.Errorf("error does not mention %q: %v", tc.mention, err)
				}
				return
			}
			var data string
			for _, o := range decodeAll(t, files) {
				if cm, ok := o.typed.(*corev1.ConfigMap); ok && cm.Data["agent.yaml"] != "" {
					data = cm.Data["agent.yaml"]
				}
			}
			_, perr := config.Parse([]byte(data))
			switch {
			case perr != nil:
				t.Fatalf("the chart installs a config the agent refuses: %v\n%s", perr, data)
			case !tc.ok:
				t.Fatalf("bad values rendered, and the agent accepts them: the case is wrong or a rule is missing on both sides")
			}
		})
	}
}

// gpuResources reaches the agent as given: the default names the NVIDIA
// device plugin's resources, another plugin's replace them, and an empty
// list leaves the ranks to the clients.
func TestGPUResourcesReachTheAgent(t *testing.T) {
	for _, tc := range []struct {
		values string
		want   []string
	}{
		{"", config.Default().GPUResources},
		{"gpuResources: [example.com/gpu, example.com/slice-*]", []string{"example.com/gpu", "example.com/slice-*"}},
		{"gpuResources: []", nil},
	} {
		t.Run(tc.values, func(t *testing.T) {
			files, err := render(t, parseValues(t, tc.values))
			if err != nil {
				t.Fatal(err)
			}
			var data string
			for _, o := range decodeAll(t, files) {
				if cm, ok := o.typed.(*corev1.ConfigMap); ok && cm.Data["agent.yaml"] != "" {
					data = cm.Data["agent.yaml"]
				}
			}
			c, err := config.Parse([]byte(data))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(c.GPUResources, tc.want) {
				t.Errorf("gpuResources read back as %q, want %q\n%s", c.GPUResources, tc.want, data)
			}
		})
	}
}
