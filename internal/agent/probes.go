package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvpool/kvpool/internal/health"
	"github.com/kvpool/kvpool/internal/metrics"
	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/wire"
)

// serverHooks reports every request the socket server answers to obs, and
// counts every refusal by a limit in m (kvpool_limit_rejects_total).
func serverHooks(obs observe.Observer, m *metrics.Metrics) server.Hooks {
	return server.Hooks{Refused: m.LimitRejected, Request: server.ObserveRequests(obs),
		Session: func(ev server.SessionEvent, info server.SessionInfo) {
			if ev == server.SessionOpened {
				m.SessionBound(info.GPU, info.Locality.GPUNUMA, info.ChunkNUMA)
			}
		}}
}

// helloHandshake greets the agent's own socket as a client would and
// checks the reply; health.Dial runs it under the probe's deadline.
func helloHandshake(ctx context.Context, conn net.Conn) error {
	if d, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(d); err != nil {
			return err
		}
	}
	pkt, err := wire.AppendPacket(nil, wire.Header{Op: wire.OpHello, Seq: 1},
		&wire.Hello{Version: wire.Version, Client: "kvpool-agent-probe"})
	if err != nil {
		return err
	}
	if _, err := conn.Write(pkt); err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	buf := make([]byte, 4096)
	n, err := conn.Read(buf)
	if err != nil {
		return fmt.Errorf("hello reply: %w", err)
	}
	h, body, err := wire.ParseHeader(buf[:n])
	if err != nil {
		return fmt.Errorf("hello reply: %w", err)
	}
	if h.Op != wire.OpHello || h.Seq != 1 || h.Status != wire.StatusOK {
		return fmt.Errorf("hello reply: op %v seq %d status %v", h.Op, h.Seq, h.Status)
	}
	var r wire.HelloReply
	if err := wire.DecodeBody(body, &r); err != nil {
		return fmt.Errorf("hello reply: %w", err)
	}
	if r.Version < 1 {
		return fmt.Errorf("hello reply: version %d", r.Version)
	}
	return nil
}

// refusingWindow is how long after the socket server refused a new
// client at a connection bound the readiness check "connections" fails.
const refusingWindow = 10 * time.Second

// heartbeatPeriod is how often the liveness loops check their component;
// a component silent for heartbeatSilence fails liveness.
const (
	heartbeatPeriod  = 5 * time.Second
	heartbeatSilence = 60 * time.Second
)

// addHealthChecks is the step "probes": the agent's probes, ready when
// chunks are ready, the socket answers a handshake and (with the plugin)
// kubelet has registered it; alive while the socket server and the plugin
// loop keep beating. The beating loops run in wg until ctx ends.
func (a *agent) addHealthChecks(ctx context.Context, wg *sync.WaitGroup) error {
	h := a.obs.Health
	dial := health.Dial(wire.Network, a.socket, helloHandshake)
	h.AddReadiness("socket", dial)
	if a.restart != nil {
		h.AddReadiness("keeper", func(context.Context) error {
			if err := a.durable(); err != nil {
				return fmt.Errorf("%w; changes are refused until a keeper holds the pool again", err)
			}
			return nil
		})
	}
	h.AddReadiness("connections", func(context.Context) error {
		if why, ok := a.srv.Refusing(refusingWindow); ok {
			return fmt.Errorf("refusing new clients: %s", why)
		}
		return nil
	})
	server := h.Heartbeat("socket-server", heartbeatSilence)
	beat(ctx, wg, server, func() bool {
		c, cancel := context.WithTimeout(ctx, heartbeatPeriod)
		defer cancel()
		return dial(c) == nil
	})
	if a.plug == nil {
		return nil
	}
	h.AddReadiness("kubelet-registration", func(context.Context) error {
		switch {
		case a.draDriver != nil:
			if !a.draDriver.Registered() {
				return errors.New("DRA driver not registered with kubelet")
			}
		case !a.plug.Plugin.Registered():
			return errors.New("device plugin not registered with kubelet")
		}
		return nil
	})
	// In mode dra the loops are the ledger's (reclaims, renewals), run
	// without the device plugin door.
	beat(ctx, wg, h.Heartbeat("device-plugin", heartbeatSilence), func() bool {
		return a.plug.Running()
	})
	return nil
}

// beat beats hb now and every heartbeatPeriod while ok holds, until ctx
// ends, in wg.
func beat(ctx context.Context, wg *sync.WaitGroup, hb *health.Heartbeat, ok func() bool) {
	hb.Beat()
	wg.Go(func() {
		t := time.NewTicker(heartbeatPeriod)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if ok() {
					hb.Beat()
				}
			}
		}
	})
}
