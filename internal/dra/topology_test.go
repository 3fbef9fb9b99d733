package dra

import (
	"strings"
	"testing"
)

// PCIeRoot reads the root complex from the sysfs link of the GPU's PCI
// address (a fixture tree here: no GPU on the test machine), and refuses
// a malformed address, a missing one and a link outside /sys/devices/pci*.
func TestPCIeRoot(t *testing.T) {
	root, err := PCIeRoot("testdata", "0000:3b:00.0")
	if err != nil || root != "pci0000:3a" {
		t.Fatalf("PCIeRoot = %q, %v; want pci0000:3a", root, err)
	}
	for _, c := range []struct{ bus, msg string }{
		{"0000:3B:00.0", "invalid PCI Bus ID format"},
		{"../../etc", "invalid PCI Bus ID format"},
		{"0000:86:00.0", "failed to read symlink"},
		{"0000:5e:00.0", "must start with devices/pci"},
	} {
		if got, err := PCIeRoot("testdata", c.bus); err == nil || !strings.Contains(err.Error(), c.msg) || got != "" {
			t.Errorf("PCIeRoot(%s) = %q, %v; want an error mentioning %q", c.bus, got, err, c.msg)
		}
	}
}
