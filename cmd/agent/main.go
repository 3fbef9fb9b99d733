// Command agent is the kvpool node agent.
//
//	agent [serve] [flags]   serve the pool (--standalone: no kubelet, simulated GPUs)
//	agent bench [flags]     run a verified workload against an agent and report figures
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
)

// commands maps a subcommand to its entry point. Add one line per
// subcommand; its code goes in cmd/agent/<name>.go.
var commands = map[string]func(ctx context.Context, args []string) error{
	"serve":  runServe,
	"bench":  runBench,
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
	if err != nil {
		fmt.Fprintf(os.Stderr, "agent %s: %v\n", name, err)
		os.Exit(1)
	}
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
