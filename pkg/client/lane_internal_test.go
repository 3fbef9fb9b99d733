package client

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvpool/kvpool/pkg/cudart"
)

// A session's packets travel a lane once it is open, again after a
// reconnect, and the socket alone with NoLane; the calls answer the same.
func TestSessionTakesALane(t *testing.T) {
	a := serveStandalone(t, 4)
	dev, k := simDevice(t, 16*4096)
	hasLane := func(p *CPUPagePool) bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.wc != nil && p.wc.HasLane()
	}
	for _, noLane := range []bool{false, true} {
		p, err := Open(context.Background(), Options{Socket: a.Socket, Token: "tok", Device: dev, NoLane: noLane,
			Regions:    []cudart.Region{{Base: k, Stride: 4096, PageBytes: 4096, Pages: 16}},
			InstanceID: []byte("lane-test-instance"), RetryFor: time.Second, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		if got := hasLane(p); got == noLane {
			t.Fatalf("NoLane %v: the session's packets travel a lane: %v", noLane, got)
		}
		if ok, err := p.OffloadStream("r", "l", []int32{1, 2, 3}, 3, 3, 0); !ok || err != nil {
			t.Fatal(ok, err)
		}
		p.Disconnect()
		if n, err := p.NumPages("r", "l"); err != nil || n != 3 {
			t.Fatalf("NoLane %v: after a reconnect: %d pages, %v", noLane, n, err)
		}
		if got := hasLane(p); got == noLane {
			t.Fatalf("NoLane %v: after a reconnect, a lane: %v", noLane, got)
		}
		if _, err := p.ReloadStream("r", "l", []int32{4, 5, 6}); err != nil {
			t.Fatal(err)
		}
		if err := p.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if err := p.Discard("r", "l"); err != nil {
			t.Fatal(err)
		}
		p.Close()
	}
}

// $KVPOOL_LANE=off keeps the packets on the socket as NoLane does; "on"
// is the default; any other value is refused at Open, naming it.
func TestLaneEnv(t *testing.T) {
	a := serveStandalone(t, 4)
	dev, k := simDevice(t, 16*4096)
	for _, tc := range []struct {
		env, err string
		lane     bool
	}{
		{"", "", true},
		{"on", "", true},
		{"off", "", false},
		{"yes", `KVPOOL_LANE="yes"`, false},
	} {
		t.Run("KVPOOL_LANE="+tc.env, func(t *testing.T) {
			t.Setenv(LaneEnv, tc.env)
			p, err := Open(context.Background(), Options{Socket: a.Socket, Token: "tok", Device: dev,
				Regions:    []cudart.Region{{Base: k, Stride: 4096, PageBytes: 4096, Pages: 16}},
				InstanceID: []byte("lane-env-instance"), RetryFor: time.Second, Logger: slog.New(slog.DiscardHandler)})
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Open: %v, want an error naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			p.mu.Lock()
			got := p.wc.HasLane()
			p.mu.Unlock()
			if got != tc.lane {
				t.Fatalf("a lane: %v, want %v", got, tc.lane)
			}
		})
	}
}
