package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/config"
	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/node/kubenode"
)

// fakeNodeAPI is an API server that serves one Node, each GET of it held
// until release is closed.
func fakeNodeAPI(t *testing.T, name, uid, allocatable string) (kubeconfig string, release func(), gets func() int) {
	t.Helper()
	hold := make(chan struct{})
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.URL.Path != "/api/v1/nodes/"+name {
			http.NotFound(w, r)
			return
		}
		mu.Lock()
		n++
		mu.Unlock()
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"kind":"Node","apiVersion":"v1","metadata":{"name":%q,"uid":%q},"status":{"allocatable":{"memory":%q}}}`, name, uid, allocatable)
	}))
	t.Cleanup(srv.Close)
	kubeconfig = filepath.Join(t.TempDir(), "kubeconfig")
	cfg := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: %s\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: x\n", srv.URL)
	if err := os.WriteFile(kubeconfig, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	return kubeconfig, func() { once.Do(func() { close(hold) }) }, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// A first start waits for the Node; a restart that adopts the pool plans
// with what the previous agent read and reads the Node beside serving, so
// that a slow API server delays no restart; what changed since is said,
// and kept for the next start.
func TestKubeNodeReadBesideServingAtARestart(t *testing.T) {
	t.Setenv(kubenode.EnvNodeName, "n1")
	kc, release, gets := fakeNodeAPI(t, "n1", "uid-2", "8Gi")

	// No plan from before: connectKube waits for the Node.
	done := make(chan *kubeParts, 1)
	go func() {
		k, err := connectKube(context.Background(), kc, nil, quietLog)
		if err != nil {
			t.Error(err)
		}
		done <- k
	}()
	select {
	case <-done:
		t.Fatal("a first start planned before the Node was read")
	case <-time.After(200 * time.Millisecond):
	}
	release()
	k := <-done
	k.close()
	if k.allocatable != 8<<30 || k.nodeUID != "uid-2" || k.read == nil || k.planned != nil || gets() != 1 {
		t.Fatalf("first start: allocatable %d, uid %q, read %v, planned %v, %d Node reads; want 8Gi, uid-2, read once",
			k.allocatable, k.nodeUID, k.read, k.planned, gets())
	}

	// A restart with what the previous agent read: nothing waits.
	kc, release, gets = fakeNodeAPI(t, "n1", "uid-2", "8Gi")
	defer release()
	planned := &nodeFacts{Node: "n1", UID: "uid-1", Allocatable: 6 << 30, Read: time.Now().Add(-time.Hour)}
	k, err := connectKube(context.Background(), kc, planned, quietLog)
	if err != nil {
		t.Fatal(err)
	}
	defer k.close()
	if k.allocatable != 6<<30 || k.nodeUID != "uid-1" || gets() != 0 {
		t.Fatalf("restart: allocatable %d, uid %q, %d Node reads; want the planned 6Gi, uid-1, none", k.allocatable, k.nodeUID, gets())
	}
	var logged bytes.Buffer
	k.log = slog.New(slog.NewTextHandler(&logged, nil))
	saved := make(chan *nodeFacts, 1)
	go k.readLater(context.Background(), func(f *nodeFacts) { saved <- f })
	release()
	f := <-saved
	if f.Node != "n1" || f.UID != "uid-2" || f.Allocatable != 8<<30 {
		t.Errorf("kept for the next start: %+v; want n1, uid-2, 8Gi", f)
	}
	for _, want := range []string{"allocatable memory changed", "planned=6442450944 now=8589934592", "the Node was recreated"} {
		if !strings.Contains(logged.String(), want) {
			t.Errorf("the read beside serving did not log %q:\n%s", want, logged.String())
		}
	}
}

// The agent plans a restart with the kept Node facts only when the keeper
// holds a pool and the facts are whole.
func TestPlannedNode(t *testing.T) {
	held := &keeper.State{Chunks: []keeper.Held{{Item: keeper.Item{ID: "gpu0-numa0-0"}}}}
	good, _ := json.Marshal(nodeFacts{Node: "n1", UID: "u", Allocatable: 1 << 30})
	for _, c := range []struct {
		name string
		held *keeper.State
		file []byte // nil: no file
		want bool
	}{
		{"a restart with facts", held, good, true},
		{"no keeper state", nil, good, false},
		{"the keeper holds nothing", &keeper.State{}, good, false},
		{"no facts", held, nil, false},
		{"facts that do not parse", held, []byte("{"), false},
		{"facts without a node", held, []byte(`{"allocatable":1}`), false},
		{"a negative allocatable memory", held, []byte(`{"node":"n1","allocatable":-1}`), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.StateDir = t.TempDir()
			a := &agent{cfg: &cfg, log: quietLog}
			if c.held != nil {
				a.restart = &restart{held: c.held}
			}
			if c.file != nil {
				if err := os.WriteFile(filepath.Join(cfg.StateDir, nodeFactsFile), c.file, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if got := a.plannedNode(); (got != nil) != c.want {
				t.Errorf("plannedNode() = %+v, want facts: %v", got, c.want)
			}
		})
	}
}

// A stop removes the kept Node facts (they serve a restart after a crash):
// an uninstall leaves nothing on the node.
func TestStopRemovesNodeFacts(t *testing.T) {
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	a := &agent{cfg: &cfg, log: quietLog, restart: &restart{}, kube: &kubeParts{}}
	a.saveNodeFacts(&nodeFacts{Node: "n1", Allocatable: 1 << 30})
	path := filepath.Join(cfg.StateDir, nodeFactsFile)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("facts not kept: %v", err)
	}
	if err := a.closeKube(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("facts left after the stop: %v", err)
	}
}

// parseNodeFacts accepts only whole facts, and what it accepts reads back
// the same after it is written again.
func FuzzParseNodeFacts(f *testing.F) {
	good, _ := json.Marshal(nodeFacts{Node: "n1", UID: "u", Allocatable: 1 << 30, Read: time.Unix(1700000000, 5).UTC()})
	for _, seed := range [][]byte{good, []byte("{"), []byte(`{"allocatable":1}`), []byte(`{"node":"n","allocatable":-1}`), []byte("null"), nil} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := parseNodeFacts(data)
		if err != nil {
			return
		}
		if got.Node == "" || got.Allocatable < 0 {
			t.Fatalf("accepted %q as %+v", data, got)
		}
		again, _ := json.Marshal(got)
		back, err := parseNodeFacts(again)
		if err != nil || back.Node != got.Node || back.UID != got.UID || back.Allocatable != got.Allocatable || !back.Read.Equal(got.Read) {
			t.Fatalf("%q -> %+v -> %s -> %+v, %v", data, got, again, back, err)
		}
	})
}
