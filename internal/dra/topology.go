package dra

import (
	"fmt"
	"path/filepath"

	"k8s.io/dynamic-resource-allocation/deviceattribute"
)

// PCIeRoot is the PCIe root complex ("pci<domain>:<bus>") of the PCI
// device busID ("0000:3b:00.0"), read from sysRoot/sys as
// deviceattribute does: /sys/bus/pci/devices/<busID> links into
// /sys/devices/pci<domain>:<bus>/... . sysRoot is "/" on a node; tests
// give a fixture tree.
func PCIeRoot(sysRoot, busID string) (string, error) {
	a, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(busID,
		deviceattribute.WithFSFromRoot(filepath.Join(sysRoot, "sys")))
	if err != nil {
		return "", err
	}
	if a.Value.StringValue == nil {
		return "", fmt.Errorf("no PCIe root for %s", busID)
	}
	return *a.Value.StringValue, nil
}
