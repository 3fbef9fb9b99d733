package agent

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/internal/metrics"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/pool"
)

// The server's session hook counts a new session's chunks on another NUMA
// node than its GPU's, once, at open: a resume or disconnect of the same
// session counts nothing again.
func TestServerHooksCountCrossNUMA(t *testing.T) {
	m := metrics.New(pool.New(), metrics.Options{NoRuntime: true})
	h := serverHooks(observe.Nop, m)
	info := server.SessionInfo{GPU: 2, Locality: pool.Locality{GPUNUMA: 1, Local: 1, Remote: 2}, ChunkNUMA: []int{1, 0, 0}}
	h.Session(server.SessionOpened, info)
	h.Session(server.SessionResumed, info)
	h.Session(server.SessionDisconnected, info)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := `kvpool_cross_numa_chunks_total{chunk_numa="0",gpu="2",gpu_numa="1"} 2`
	if !strings.Contains(string(body), want) {
		t.Fatalf("metrics lack %s:\n%s", want, body)
	}
}

// The ranks of a standalone token's allocation are not known to the agent:
// the pool shares it one session per GPU its chunks were sized under.
func TestRanksOfStandaloneTokens(t *testing.T) {
	a := &agent{static: map[string]string{"tok": "standalone-0"}}
	r := a.ranks(t.Context())
	for _, alloc := range []string{"standalone-0", "alloc-0000000000000000"} {
		if got := r(alloc); got.Count != 0 || got.GPUs != nil {
			t.Errorf("ranks of %s without a device plugin: %+v", alloc, got)
		}
	}
}
