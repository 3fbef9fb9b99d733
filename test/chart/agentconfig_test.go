package chart_test

import (
	"testing"

	"github.com/kvpool/kvpool/internal/config"
)

// renderedConfig is what the chart tests compare in the agent config.
type renderedConfig struct {
	ResourceName, SocketDir, KubeletDir, StateDir string
	PoolBytes, Headroom, SpareMemory              int64
	HugePages                                     string
	MetricsAddr, HealthAddr                       string
	Mode, DRADriver, CDIDir                       string
}

// loadAgentConfig parses a config file with the agent's own loader
// (internal/config: strict keys, apiVersion and kind, validation) and returns the
// fields the chart sets.
func loadAgentConfig(t *testing.T, data []byte) renderedConfig {
	t.Helper()
	c, err := config.Parse(data)
	if err != nil {
		t.Fatalf("the agent's loader rejects the config: %v\n%s", err, data)
	}
	// The chart writes the current apiVersion, not one the agent reads
	// only with a deprecation warning.
	if w := c.Warnings(); len(w) > 0 {
		t.Errorf("the agent warns about the config: %q\n%s", w, data)
	}
	return renderedConfig{
		ResourceName: c.ResourceName,
		SocketDir:    c.SocketDir,
		KubeletDir:   c.KubeletDir,
		StateDir:     c.StateDir,
		PoolBytes:    int64(c.Sizing.PoolBytes),
		Headroom:     int64(c.Sizing.CgroupHeadroomBytes),
		SpareMemory:  int64(c.RestartInPlace.SpareMemory),
		HugePages:    c.Sizing.HugePages,
		MetricsAddr:  c.Metrics.Address,
		HealthAddr:   c.Health.Address,
		Mode:         c.Mode,
		DRADriver:    c.DRA.DriverName,
		CDIDir:       c.DRA.CDIDir,
	}
}
