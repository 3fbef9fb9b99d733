package main

import (
	"context"
	"testing"
)

// TestRestartProbe runs the restart probe small: a keeper and an agent
// built from this tree, 2 and 301 streams over two sessions, two SIGKILLs
// each; the probe fails when a restarted agent does not serve every
// session's streams.
func TestRestartProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent and kills it")
	}
	if err := runRestart(context.Background(), []string{"--streams", "2,301", "--sessions", "2", "--chunks", "4", "--restarts", "2", "--settle", "10ms"}); err != nil {
		t.Fatal(err)
	}
	// The gap timed by one call that rides out each restart.
	if err := runRestart(context.Background(), []string{"--streams", "1", "--restarts", "2", "--settle", "10ms", "--wait", "client"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{{"--streams", "0"}, {"--chunks", "0"}, {"--chunks", "1", "--chunk-mib", "16"},
		{"--sessions", "0"}, {"--sessions", "3", "--chunks", "2"}, {"--streams", "131073"}, {"--wait", "sometimes"}} {
		if err := runRestart(context.Background(), bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}
