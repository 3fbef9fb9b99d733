// Command agent is the kvpool node agent.
//
//	agent [serve] [flags]   serve the pool (--standalone: no kubelet, simulated GPUs)
//	agent plan [flags]      print the pool the agent would allocate
//	agent status [flags]    print a running agent's pools, sessions and errors
//	agent keeper [flags]    hold the pool's memory across agent restarts
//
// The agent itself is internal/agent; this package parses flags, loads the
// configuration and picks the subcommand.
//
// Other subcommands live in their own files as run<Name>(ctx, args).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// commands maps a subcommand to its entry point. Add one line per
// subcommand; its code goes in cmd/agent/<name>.go.
var commands = map[string]func(ctx context.Context, args []string) error{
	"serve":  runServe,
	"plan":   runPlan,
	"status": runStatus,
	"keeper": runKeeper,
}

func main() {
	args := os.Args[1:]
	name := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		name, args = args[0], args[1:]
	}
	run, ok := commands[name]
	if !ok {
		var names []string
		for n := range commands {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "agent: unknown subcommand %q (have %s)\n", name, strings.Join(names, ", "))
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, args)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	var code exitCode
	if errors.As(err, &code) {
		os.Exit(int(code)) // said already: the supervised agent's own end
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "agent %s: %v\n", name, err)
		os.Exit(1)
	}
}

// exitCode is a run's end that says nothing more than its exit status: a
// supervised agent's (its log said why).
type exitCode int

func (c exitCode) Error() string { return fmt.Sprintf("exit status %d", int(c)) }

// version is the agent's version, set at link time (-X main.version=...).
var version = "dev"

// nvmlLib is the NVML binding GPU discovery uses; tests replace it.
var nvmlLib = func() nvml.Interface { return nvml.New() }
