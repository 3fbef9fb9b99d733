package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/kvpool/kvpool/pkg/pool"
)

// ChunkLister is the part of *pool.Pool ChunksReady reads.
type ChunkLister interface {
	Chunks() []pool.ChunkInfo
}

// ChunksReady passes when the pool holds at least one usable chunk: free, or
// granted to a pod. Dirty chunks do not count; until scrubbed they serve no
// one.
func ChunksReady(p ChunkLister) Checker {
	return func(context.Context) error {
		n, dirty := 0, 0
		for _, c := range p.Chunks() {
			if c.State == pool.ChunkDirty {
				dirty++
			} else {
				n++
			}
		}
		if n == 0 {
			return fmt.Errorf("no chunk ready (%d awaiting scrub)", dirty)
		}
		return nil
	}
}

// Handshake runs the agent's protocol greeting over conn. The socket server
// package provides one; it must return once conn's deadline passes.
type Handshake func(ctx context.Context, conn net.Conn) error

// Dial returns a check that connects to the agent's own socket and performs
// a real handshake, bounded by the probe's timeout. It fails when the accept
// loop is wedged (the connection sits in the backlog and the greeting times
// out) as well as when the socket is missing.
func Dial(network, address string, hs Handshake) Checker {
	return func(ctx context.Context) error {
		var d net.Dialer
		conn, err := d.DialContext(ctx, network, address)
		if err != nil {
			return fmt.Errorf("dial %s: %w", address, err)
		}
		defer conn.Close()
		if dl, ok := ctx.Deadline(); ok {
			if err := conn.SetDeadline(dl); err != nil {
				return fmt.Errorf("dial %s: %w", address, err)
			}
		}
		// Unblock the handshake if ctx ends without a deadline.
		stop := context.AfterFunc(ctx, func() { conn.Close() })
		defer stop()
		if err := hs(ctx, conn); err != nil {
			return fmt.Errorf("handshake on %s: %w", address, err)
		}
		return nil
	}
}

// Flag is a condition another component sets, such as "registered with
// kubelet". Its zero value is down with no reason given.
type Flag struct {
	mu     sync.Mutex
	up     bool
	reason string
}

// Set raises (up true) or lowers the flag; reason says why it is down.
func (f *Flag) Set(up bool, reason string) {
	f.mu.Lock()
	f.up, f.reason = up, reason
	f.mu.Unlock()
}

// Up reports whether the flag is raised.
func (f *Flag) Up() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.up
}

// Check is a Checker that passes while the flag is up.
func (f *Flag) Check(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.up {
		return nil
	}
	if f.reason == "" {
		return errors.New("not yet")
	}
	return errors.New(f.reason)
}
