package main

import (
	"context"
	"testing"
)

// TestRestartProbe runs the restart probe small: a keeper and an agent
// built from this tree, 1 and 300 streams, two SIGKILLs each; the probe
// fails when a restarted agent does not serve the session's streams.
func TestRestartProbe(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent and kills it")
	}
	if err := runRestart(context.Background(), []string{"--streams", "1,300", "--restarts", "2", "--settle", "10ms"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{{"--streams", "0"}, {"--chunks", "0"}, {"--chunks", "1", "--chunk-mib", "16"}} {
		if err := runRestart(context.Background(), bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}
