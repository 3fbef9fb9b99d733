package main

import (
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A metrics or health address already taken at start ends the agent at
// once, non-zero, with the reason on stderr (it used to hang until
// SIGTERM).
func TestTakenAddressExits(t *testing.T) {
	for _, flag := range []string{"--metrics-address", "--health-address"} {
		t.Run(flag, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			dir := t.TempDir()
			c := spawnAgent(t, nil, "--standalone", "--socket", filepath.Join(dir, "sock", "kvpool.sock"),
				"--state-dir", filepath.Join(dir, "state"), "--chunks-per-gpu", "1", "--chunk-mib", "2", flag, l.Addr().String())
			select {
			case err := <-c.done:
				c.done <- err
				if err == nil {
					t.Fatal("the agent exited 0 with its address taken")
				}
				if !strings.Contains(c.log.String(), "address already in use") {
					t.Fatalf("no reason logged; log:\n%s", c.log.String())
				}
			case <-time.After(20 * time.Second):
				t.Fatalf("the agent did not exit with %s taken", flag)
			}
		})
	}
}
