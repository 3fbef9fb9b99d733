package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/kvpool/kvpool/pkg/contract"
)

// DefaultSocket is the standalone agent's socket:
// $XDG_RUNTIME_DIR/kvpool/kvpool.sock, or /tmp/kvpool-<uid>/kvpool.sock
// when XDG_RUNTIME_DIR is unset.
func DefaultSocket() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "kvpool", contract.SocketFile)
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvpool-%d", os.Getuid()), contract.SocketFile)
}

// DefaultStateDir is the standalone agent's state directory: next to the
// socket's directory, never inside it ($XDG_RUNTIME_DIR/kvpool-state, or
// /tmp/kvpool-<uid>-state), so that a pod mounting the socket directory
// cannot read the tokens.
func DefaultStateDir() string {
	return filepath.Dir(DefaultSocket()) + "-state"
}

// CheckSocketDir refuses a socket directory that someone else could
// tamper with: one that exists but is not a directory (a symbolic link
// included), is owned by another user than the agent's, or is writable by
// group or others (they could move the socket away and put their own in its
// place). A directory that does not exist yet is fine: Listen creates it.
func CheckSocketDir(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("socket directory %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory (%s); remove it or choose another with --socket", dir, fi.Mode().Type())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("socket directory %s: no owner information", dir)
	}
	if uid := os.Getuid(); int(st.Uid) != uid {
		return fmt.Errorf("socket directory %s is owned by uid %d, not by the agent's uid %d: another user could replace the socket; remove it or choose another with --socket", dir, st.Uid, uid)
	}
	if perm := fi.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Errorf("socket directory %s has mode %04o: group or others may write it and replace the socket; chmod go-w %s, or choose another with --socket", dir, perm, dir)
	}
	return nil
}

// AllocationName is the pool allocation of a standalone token: named by
// the token itself (a digest of it, never the token), not by its place in
// the list, so that restarting with the tokens in another order keeps each
// tenant's allocation, chunks and streams. (A short, guessable token stays
// guessable from its digest, as it is against the socket: use long random
// tokens.)
func AllocationName(token string) string {
	h := sha256.Sum256([]byte("kvpool standalone allocation\x00" + token))
	return "standalone-" + hex.EncodeToString(h[:8])
}

// Allocations splits each GPU's chunk IDs among the standalone tokens, as
// pool allocations named by AllocationName. kept holds the chunks of
// allocations restored from the keeper: a token whose allocation is there
// keeps exactly those chunks; the other tokens share the rest of each GPU's
// chunks, token i (in the order of their allocation names, whatever the
// order given) taking chunks i, i+n, i+2n, ... of every GPU (n tokens). It
// returns each token's allocation and chunk IDs.
func Allocations(tokens []string, gpus [][]string, kept map[string][]string) (alloc map[string]string, chunks map[string][]string, err error) {
	if len(tokens) == 0 {
		return nil, nil, errors.New("standalone: no tokens")
	}
	alloc = make(map[string]string, len(tokens))
	var fresh []string // tokens without a kept allocation
	chunks = make(map[string][]string, len(tokens))
	for _, t := range tokens {
		if err := contract.CheckStaticToken(t); err != nil {
			return nil, nil, fmt.Errorf("standalone tokens: %w", err)
		}
		if _, dup := alloc[t]; dup {
			return nil, nil, fmt.Errorf("standalone tokens: a token is given twice (they must be distinct)")
		}
		alloc[t] = AllocationName(t)
		if ids, ok := kept[alloc[t]]; ok {
			chunks[t] = slices.Clone(ids)
			continue
		}
		fresh = append(fresh, t)
	}
	if len(fresh) == 0 {
		return alloc, chunks, nil
	}
	slices.SortFunc(fresh, func(a, b string) int { return strings.Compare(alloc[a], alloc[b]) })
	taken := map[string]bool{}
	for _, ids := range chunks {
		for _, id := range ids {
			taken[id] = true
		}
	}
	for g, all := range gpus {
		ids := slices.DeleteFunc(slices.Clone(all), func(id string) bool { return taken[id] })
		if len(ids) < len(fresh) {
			return nil, nil, fmt.Errorf("%d standalone tokens need at least as many chunks per GPU; GPU %d has %d (%d held by allocations kept from before the restart)",
				len(fresh), g, len(ids), len(all)-len(ids))
		}
		for i, id := range ids {
			t := fresh[i%len(fresh)]
			chunks[t] = append(chunks[t], id)
		}
	}
	return alloc, chunks, nil
}
