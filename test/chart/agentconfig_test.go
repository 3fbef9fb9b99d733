package chart_test

import (
	"testing"

	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

// renderedConfig is what the chart tests compare in the agent config.
type renderedConfig struct {
	ResourceName, SocketDir, KubeletDir, StateDir string
	PoolBytes, Headroom                           int64
	HugePages                                     string
	MetricsAddr, HealthAddr                       string
}

// contractConfig mirrors the shared AgentConfig contract (design notes,
// "Shared contracts"). PENDING(issue 5): pkg/config is not on this branch
// yet; until it is, the rendered file is decoded strictly into this mirror,
// and TestAgentLoader below reports the gap as a skip.
type contractConfig struct {
	APIVersion   string `json:"apiVersion"`
	Kind         string `json:"kind"`
	ResourceName string `json:"resourceName"`
	SocketDir    string `json:"socketDir"`
	KubeletDir   string `json:"kubeletDir"`
	StateDir     string `json:"stateDir"`
	Sizing       struct {
		PoolBytes           string   `json:"poolBytes"`
		Fraction            *float64 `json:"fraction"`
		ReserveBytes        string   `json:"reserveBytes"`
		CgroupHeadroomBytes string   `json:"cgroupHeadroomBytes"`
		Split               string   `json:"split"`
		MinPerGPU           string   `json:"minPerGPU"`
		MaxPerGPU           string   `json:"maxPerGPU"`
		ChunkBytes          string   `json:"chunkBytes"`
		HugePages           string   `json:"hugePages"`
	} `json:"sizing"`
	Reclaim struct {
		GracePeriod string `json:"gracePeriod"`
		Interval    string `json:"interval"`
	} `json:"reclaim"`
	Metrics struct {
		Address string `json:"address"`
	} `json:"metrics"`
	Health struct {
		Address string `json:"address"`
	} `json:"health"`
	Log struct {
		Level  string `json:"level"`
		Format string `json:"format"`
	} `json:"log"`
	Standalone struct {
		Tokens    []string `json:"tokens"`
		GPUs      int      `json:"gpus"`
		PoolBytes string   `json:"poolBytes"`
	} `json:"standalone"`
}

func loadAgentConfig(t *testing.T, data []byte) renderedConfig {
	t.Helper()
	var c contractConfig
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		t.Fatalf("agent config: %v\n%s", err, data)
	}
	if c.APIVersion != "kvpool.io/v1alpha1" || c.Kind != "AgentConfig" {
		t.Fatalf("agent config is %s %s, want kvpool.io/v1alpha1 AgentConfig", c.APIVersion, c.Kind)
	}
	q := func(name, s string) int64 {
		v, err := resource.ParseQuantity(s)
		if err != nil {
			t.Fatalf("agent config %s: %v", name, err)
		}
		return v.Value()
	}
	return renderedConfig{
		ResourceName: c.ResourceName,
		SocketDir:    c.SocketDir,
		KubeletDir:   c.KubeletDir,
		StateDir:     c.StateDir,
		PoolBytes:    q("sizing.poolBytes", c.Sizing.PoolBytes),
		Headroom:     q("sizing.cgroupHeadroomBytes", c.Sizing.CgroupHeadroomBytes),
		HugePages:    c.Sizing.HugePages,
		MetricsAddr:  c.Metrics.Address,
		HealthAddr:   c.Health.Address,
	}
}

// TestAgentLoader is the visible placeholder for the check that the rendered
// config and config/agent.yaml load with the agent's own loader.
func TestAgentLoader(t *testing.T) {
	t.Skip("PENDING: pkg/config (issue 5) is not on this branch yet; configs are checked against a strict mirror of the shared contract instead")
}
