//go:build !rdma

package verbs

import "fmt"

// openRDMA is what Open does with a hardware device name in a build
// without the rdma tag.
func openRDMA(name string, _ OpenOptions) (Device, error) {
	return nil, fmt.Errorf("verbs: open %q: %w: rdma-core devices need a build with -tags rdma", name, ErrNoDevice)
}
