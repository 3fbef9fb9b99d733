package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvpool/kvpool/api/v1alpha1"
	"github.com/kvpool/kvpool/internal/events"
	"github.com/kvpool/kvpool/internal/node/kubenode"
	"github.com/kvpool/kvpool/internal/nodestatus"
	"github.com/kvpool/kvpool/internal/report"
)

// statusInterval is how often the KVPoolNode status is rebuilt: a change
// of readiness or health is written within about this long (the writer
// writes other changes at a bounded rate).
const statusInterval = time.Second

// inClusterConfig is the service account's API server config; tests
// replace it.
var inClusterConfig = rest.InClusterConfig

// kubeParts are the agent's API server clients: the Node it runs on, its
// events and its KVPoolNode status.
type kubeParts struct {
	node        string
	nodeUID     types.UID // "" when the Node could not be read
	cs          kubernetes.Interface
	allocatable int64 // 0 when the Node could not be read
	events      events.Events
	stopEvents  func()
	writer      *nodestatus.Writer
	log         *slog.Logger
}

// restConfig finds the API server: --kubeconfig, else $KUBECONFIG, else the
// in-cluster service account. It returns nil, "" when there is none.
func restConfig(kubeconfig string, getenv func(string) string) (*rest.Config, string, error) {
	path := kubeconfig
	if path == "" {
		path = getenv("KUBECONFIG")
	}
	if path != "" {
		rc, err := clientcmd.BuildConfigFromFlags("", path)
		if err != nil {
			return nil, "", fmt.Errorf("kubeconfig %s: %w", path, err)
		}
		return rc, "kubeconfig " + path, nil
	}
	if getenv("KUBERNETES_SERVICE_HOST") == "" {
		return nil, "", nil
	}
	rc, err := inClusterConfig()
	if err != nil {
		return nil, "", fmt.Errorf("in-cluster API server config: %w", err)
	}
	return rc, "in-cluster service account", nil
}

// connectKube connects to the API server and reads the Node. Without a
// kubeconfig outside a pod it returns nil: the agent then sizes without
// the Node's allocatable memory and writes no status or events.
func connectKube(ctx context.Context, kubeconfig string, log *slog.Logger) (*kubeParts, error) {
	rc, from, err := restConfig(kubeconfig, os.Getenv)
	if err != nil {
		return nil, err
	}
	if rc == nil {
		log.Info("no API server: not in a pod and no --kubeconfig or $KUBECONFIG; " +
			"sizing without the Node's allocatable memory, no KVPoolNode status, no Node events")
		return nil, nil
	}
	name, err := kubenode.NodeName()
	if err != nil {
		return nil, fmt.Errorf("%w (set it from the pod's spec.nodeName with the downward API)", err)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	k := &kubeParts{node: name, cs: cs, log: log}
	var uid types.UID
	gctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	n, err := cs.CoreV1().Nodes().Get(gctx, name, metav1.GetOptions{})
	cancel()
	if err != nil {
		log.Warn("reading the Node failed; sizing without its allocatable memory", "node", name, "err", err)
	} else {
		uid = n.UID
		k.nodeUID = uid
		m, err := kubenode.FromNode(n)
		if err != nil {
			log.Warn("the Node's allocatable memory is unusable; sizing without it", "node", name, "err", err)
		} else {
			k.allocatable = m.Allocatable
		}
	}
	k.events, k.stopEvents = events.NewBroadcaster(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")}, events.NodeRef(name, uid))

	c, err := nodestatus.NewClient(rc, cs)
	if err != nil {
		k.stopEvents()
		return nil, fmt.Errorf("API client: %w", err)
	}
	k.writer = nodestatus.NewWriter(c, name, nodestatus.Options{Log: log})
	log.Info("connected to the API server", "via", from, "node", name, "allocatable", k.allocatable)
	return k, nil
}

// startKube is the step "kube" (cluster mode): the API server, when
// there is one, names the node and gives its allocatable memory and the
// Node events. closeKube stops the events.
func (a *agent) startKube(ctx context.Context) error {
	k, err := connectKube(ctx, a.opts.Kubeconfig, a.log)
	if err != nil || k == nil {
		return err
	}
	a.kube = k
	a.node, a.allocatable, a.events = k.node, k.allocatable, k.events
	return nil
}

func (a *agent) closeKube() error {
	if k := a.kube; k != nil {
		k.close()
	}
	return nil
}

// statusStep is the step "status" (cluster mode): the node's KVPoolNode
// status is kept up to date until the agent's context ends; its stop waits
// for the loop to end and writes the final status (not ready). Nothing
// without an API server.
func (a *agent) statusStep() step {
	wg := new(sync.WaitGroup)
	return step{name: "status",
		start: func(ctx context.Context) error {
			if a.kube != nil {
				a.kube.runStatus(ctx, a, wg)
			}
			return nil
		},
		stop: func() error {
			wg.Wait()
			if a.kube != nil {
				a.kube.stopped()
			}
			return nil
		}}
}

// runStatus keeps the node's KVPoolNode status up to date until ctx ends.
func (k *kubeParts) runStatus(ctx context.Context, a *agent, wg *sync.WaitGroup) {
	k.writer.ReportTo(a.obs.Observer)
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := k.writer.Run(ctx); err != nil && ctx.Err() == nil {
			k.log.Error("KVPoolNode status writer stopped", "err", err)
		}
	}()
	go func() {
		defer wg.Done()
		nodestatus.Feed(ctx, k.writer, statusInterval, func() v1alpha1.KVPoolNodeStatus {
			rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			r := a.obs.Health.Ready(rctx)
			cancel()
			return nodestatus.Build(k.node, nodestatus.Input{
				Snapshot:     report.Take(a.pool, a.obs.Report.Targets(), time.Now()),
				Ready:        r.OK(),
				Reason:       r.Reason(),
				ResourceName: a.cfg.ResourceName,
				AgentVersion: a.opts.Version,
				Restart:      a.restartStatus(),
				// Degraded while the plugin reports unhealthy chunks.
				UnhealthyChunks: a.plug.UnhealthyChunks(),
				Mode:            a.cfg.Mode,
				DRADriver:       a.draDriverName(),
				Claims:          a.claims(),
			})
		})
	}()
}

// stopped writes the final KVPoolNode status of a stopping agent (not
// Ready, nothing serving), so readers know within seconds instead of after
// nodestatus.StaleAfter. The status loop has ended; this has its own short
// deadline, because the agent's context is already done. On `helm
// uninstall` the agent's ServiceAccount may be gone first; the write then
// fails and the heartbeat going stale tells the same.
func (k *kubeParts) stopped() {
	if k.writer == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := k.writer.Stopped(ctx, "agent stopped"); err != nil {
		k.log.Warn("final KVPoolNode status not written", "err", err)
		return
	}
	k.log.Info("final KVPoolNode status written: not ready (agent stopped)")
}

func (k *kubeParts) close() {
	if k.stopEvents != nil {
		k.stopEvents()
	}
}
