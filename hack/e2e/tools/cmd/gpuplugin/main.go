// Command gpuplugin runs the e2e's stand-in for the NVIDIA device plugin
// (package gpuplugin) by hand, against a node's kubelet: it advertises the
// GPUs named on the command line as nvidia.com/gpu until SIGTERM or SIGINT.
//
//	gpuplugin -kubelet-dir /var/lib/kubelet GPU-sim-00000000:0 GPU-sim-00000001:0 ...
//
// Each argument is UUID:NUMA (NUMA -1 or omitted: no TopologyInfo).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvpool/kvpool/hack/e2e/tools/gpuplugin"
)

func main() {
	kubelet := flag.String("kubelet-dir", "/var/lib/kubelet", "kubelet root directory")
	flag.Parse()
	var gpus []gpuplugin.GPU
	for _, a := range flag.Args() {
		uuid, n, ok := strings.Cut(a, ":")
		g := gpuplugin.GPU{UUID: uuid, NUMA: -1}
		if ok {
			v, err := strconv.Atoi(n)
			if err != nil {
				fmt.Fprintf(os.Stderr, "gpuplugin: %q: NUMA node %q is not a number\n", a, n)
				os.Exit(2)
			}
			g.NUMA = v
		}
		gpus = append(gpus, g)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	p, err := gpuplugin.Start(ctx, filepath.Join(*kubelet, "device-plugins"), gpus)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("gpuplugin: advertising %d GPUs as %s\n", len(gpus), gpuplugin.ResourceName)
	<-ctx.Done()
	p.Stop()
}
