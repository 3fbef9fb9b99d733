// Command pause is the e2e node's sandbox ("pause") image entry point and a
// do-nothing container: it blocks until SIGTERM or SIGINT and exits 0.
// The harness cannot pull registry.k8s.io/pause, so it builds this instead.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	<-ch
	os.Exit(0)
}
