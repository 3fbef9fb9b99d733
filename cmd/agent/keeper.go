package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
)

// DefaultKeeperSocket is where `agent keeper` listens by default.
const DefaultKeeperSocket = "/var/lib/kvpool/keeper/keeper.sock"

// runKeeper is `agent keeper`: the fd store that holds the pool's memory
// and books while the agent restarts. It ends on SIGTERM or SIGINT, and
// with it the memory (once no process maps it).
func runKeeper(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("keeper", flag.ContinueOnError)
	fs.SetOutput(flagOutput)
	socket := fs.String("socket", DefaultKeeperSocket, "the keeper's Unix socket (the agent's keeperSocket); mode 0600")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	format := fs.String("log-format", "text", "text or json")
	lock := fs.Bool("lock", true, "hold the pool's lock when the agent asks (needs CAP_IPC_LOCK), so that an agent restart unmaps nothing; false leaves the lock with the agent")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `usage: agent keeper [flags]

Holds the pool's chunk memfds and the books memfd for the agent, so that an
agent restart or upgrade adopts the same memory and loses no session or
stream. It talks only to the agent, over a socket only its user may open.
Stopping it frees the pool: a later agent starts fresh. It also holds the
pool's lock (mlock, in a read-only mapping of its own) when the agent asks.

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	log, _, err := logging.New(logging.Options{Level: *level, Format: *format})
	if err != nil {
		return err
	}
	l, err := keeper.Listen(*socket)
	if err != nil {
		return err
	}
	defer os.Remove(*socket)
	k := keeper.New(log)
	k.SetLock(*lock)
	log.Info("keeper serving", "socket", *socket, "version", version, "protocol", keeper.Version, "lock", *lock)
	err = k.Serve(ctx, l)
	st := k.Stat()
	k.Close()
	log.Info("keeper stopped; the pool's memory is released", "chunks", st.Chunks, bytesize.Attr("bytes", st.Bytes))
	return err
}
