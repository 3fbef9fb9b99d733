//go:build !cgo

package cudart

import "fmt"

type cudaDriver struct{ Driver }

// openCUDA cannot load a driver in a build without cgo.
func openCUDA(path string, noBatch, noKernel bool) (*cudaDriver, error) {
	return nil, fmt.Errorf("%w: %s: this binary was built without cgo (CGO_ENABLED=0), which loading libcuda needs", ErrNoDriver, path)
}

func (d *cudaDriver) Version() int                  { return 0 }
func (d *cudaDriver) BatchABI() int                 { return 0 }
func (d *cudaDriver) deviceName(ordinal int) string { return "" }
func (d *cudaDriver) kernelState() string           { return "" }
