package agent

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/pkg/pool"
)

// The health port serves each probe and each of its checks alone.
func TestHealthPortServesOneCheck(t *testing.T) {
	obs := newObservability(pool.New(), obsOptions{Node: "n", Mode: "standalone"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := obs.start(ctx, "", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	base := "http://" + obs.healthAddr.String()
	for _, c := range []struct {
		path     string
		wantCode int
		want     string
	}{
		{"/livez", 200, "livez ok\n"},
		{"/readyz", 503, "[-]chunks failed: no chunk ready (0 awaiting scrub)\nreadyz failed\n"},
		{"/readyz/chunks", 503, "[-]chunks failed: no chunk ready (0 awaiting scrub)\nreadyz/chunks failed\n"},
		{"/readyz/socket", 404, "readyz has no check \"socket\"\n"},
	} {
		resp, err := http.Get(base + c.path)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != c.wantCode || !strings.HasSuffix(string(b), c.want) {
			t.Errorf("GET %s: %d %q, want %d ending %q", c.path, resp.StatusCode, b, c.wantCode, c.want)
		}
	}
}
