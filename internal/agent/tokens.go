package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/poolerr"
	"github.com/kvpool/kvpool/pkg/unixsock"
)

// prepareTokens is the step "tokens" (standalone without the device
// plugin): each standalone token keeps the chunks of its allocation
// restored from the keeper, and the others get every n-th chunk of each
// GPU (Allocations).
func (a *agent) prepareTokens() error {
	toks := a.cfg.Standalone.Tokens
	if a.opts.RandomToken {
		toks = []string{contract.NewToken()}
	}
	// The tokens' allocations restored from the keeper, their chunks in
	// grant order; the plan's chunk IDs only when a token has none.
	kept := map[string][]string{}
	var gpus [][]string
	for _, t := range toks {
		name := AllocationName(t)
		if ids, err := a.pool.Allocation(name); err == nil {
			kept[name] = ids
		} else if gpus == nil {
			gpus = make([][]string, len(a.plan.GPUs))
			for i, g := range a.plan.GPUs {
				gpus[i] = g.ChunkIDs()
			}
		}
	}
	static, chunks, err := Allocations(toks, gpus, kept)
	if err != nil {
		return err
	}
	a.static, a.tokenChunks = static, chunks
	return nil
}

// authorize resolves an allocation token: a standalone token, or one the
// device plugin handed out in Allocate.
func (a *agent) authorize(token string) (string, error) {
	if alloc, ok := a.static[token]; ok {
		if !a.granted.Load() {
			return "", fmt.Errorf("%w: the pool is still being allocated", poolerr.ErrNotReady)
		}
		return alloc, nil
	}
	if a.plug != nil {
		alloc, err := a.plug.Plugin.Authorize(token)
		if errors.Is(err, poolerr.ErrNotReady) {
			return "", err
		}
		if err != nil {
			if !errors.Is(err, contract.ErrUnknownToken) {
				err = fmt.Errorf("%w: %v", contract.ErrUnknownToken, err)
			}
			return "", err
		}
		return alloc, nil
	}
	return "", contract.ErrUnknownToken
}

// authorizer is the copy server's one door for tokens: authorizePeer,
// within ctx.
func (a *agent) authorizer(ctx context.Context) server.Authorizer {
	return func(token string, peer unixsock.Peer) (string, error) { return a.authorizePeer(ctx, token, peer) }
}

// authorizePeer is authorize with the client's credentials: a token the
// device plugin handed out works only from its pod when tokenBinding is
// "pod" (plugin.Plugin.AuthorizePeer).
func (a *agent) authorizePeer(ctx context.Context, token string, peer unixsock.Peer) (string, error) {
	if _, ok := a.static[token]; ok || a.plug == nil {
		return a.authorize(token)
	}
	alloc, err := a.plug.Plugin.AuthorizePeer(ctx, token, peer.PID)
	if err != nil {
		if errors.Is(err, poolerr.ErrNotReady) {
			return "", err // restored, its chunks not yet back: "retry"
		}
		if errors.Is(err, contract.ErrUnknownToken) {
			return "", err
		}
		// At most one line a second: a pod retrying in a loop must not
		// flood the log.
		n := a.refused.Add(1)
		if now := time.Now().UnixNano(); now-a.refusedLogged.Load() >= int64(time.Second) {
			a.refusedLogged.Store(now)
			a.refused.Store(0)
			a.log.Warn("token refused", "pid", peer.PID, "uid", peer.UID, "refusedSinceLastLine", n, "err", err)
		}
		return "", err
	}
	return alloc, nil
}

// logChunkIDs is how many of a token's chunks the standalone allocation
// line names (a pool at the chunk bound gives a token thousands).
const logChunkIDs = 64

// grantStatic grants the standalone tokens their ready chunks.
func (a *agent) grantStatic() {
	if a.static == nil {
		return
	}
	for tok, alloc := range a.static {
		ids := make([]string, 0, len(a.tokenChunks[tok]))
		a.mu.RLock()
		for _, id := range a.tokenChunks[tok] {
			if a.hmem[id] != nil {
				ids = append(ids, id)
			}
		}
		a.mu.RUnlock()
		a.tokenChunks[tok] = ids
		if len(ids) == 0 {
			a.log.Error("standalone token has no ready chunk", "allocation", alloc)
			continue
		}
		if err := a.pool.Grant(alloc, ids); err != nil {
			a.log.Error("granting standalone chunks", "allocation", alloc, "err", err)
			continue
		}
		a.log.Info("allocation", "token", tok, "allocation", alloc, "count", len(ids), "chunks", logging.ListIDs(ids, logChunkIDs, ","))
	}
	a.granted.Store(true)
	var first string
	for tok := range a.static {
		if first == "" || tok < first {
			first = tok
		}
	}
	a.log.Info("standalone tokens granted",
		"try", fmt.Sprintf("KVPOOL_SOCKET=%s KVPOOL_TOKEN=%s go run ./cmd/kvclient", a.socket, first))
}
