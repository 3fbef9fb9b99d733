package main

import (
	"os"
	"strings"
	"testing"
)

// TestMain lets tests run the real agent in a child process: the test binary
// re-executed with KVPOOL_TEST_AGENT=1 (or KVPOOL_TEST_RUN_MAIN=1) is the
// agent, its arguments taken from KVPOOL_TEST_AGENT_ARGS when set, else from
// its own command line.
func TestMain(m *testing.M) {
	if os.Getenv("KVPOOL_TEST_TENANT") == "1" {
		os.Exit(tenantMain())
	}
	if os.Getenv("KVPOOL_TEST_AGENT") == "1" || os.Getenv("KVPOOL_TEST_RUN_MAIN") == "1" {
		if a, ok := os.LookupEnv("KVPOOL_TEST_AGENT_ARGS"); ok {
			os.Args = append([]string{"agent"}, strings.Fields(a)...)
		}
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}
