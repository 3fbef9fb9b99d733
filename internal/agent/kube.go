package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
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
	// read is the Node as connectKube read it; planned, instead, what the
	// previous agent read, when the Node is read beside serving (wg).
	read, planned *nodeFacts
	wg            sync.WaitGroup
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
// the Node's allocatable memory and writes no status or events. With
// planned (a restart that adopts the pool: what the previous agent read of
// this node) it does not wait for the Node: it takes the UID and the
// allocatable memory from planned, and readLater reads the Node beside
// serving.
func connectKube(ctx context.Context, kubeconfig string, planned *nodeFacts, log *slog.Logger) (*kubeParts, error) {
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
	if planned != nil && planned.Node == name {
		k.nodeUID, k.allocatable, k.planned = planned.UID, planned.Allocatable, planned
	} else if f, err := k.readNode(ctx); err != nil {
		log.Warn("reading the Node failed; sizing without its allocatable memory", "node", name, "err", err)
	} else {
		k.nodeUID, k.allocatable = f.UID, f.Allocatable
		k.read = f
	}
	k.events, k.stopEvents = events.NewBroadcaster(&typedcorev1.EventSinkImpl{Interface: cs.CoreV1().Events("")}, events.NodeRef(name, k.nodeUID))

	c, err := nodestatus.NewClient(rc, cs)
	if err != nil {
		k.stopEvents()
		return nil, fmt.Errorf("API client: %w", err)
	}
	k.writer = nodestatus.NewWriter(c, name, nodestatus.Options{Log: log})
	if k.planned != nil {
		log.Info("connected to the API server; the Node is read beside serving, the plan uses what the previous agent read of it",
			"via", from, "node", name, "allocatable", k.allocatable, "readThen", k.planned.Read)
	} else {
		log.Info("connected to the API server", "via", from, "node", name, "allocatable", k.allocatable)
	}
	return k, nil
}

// nodeReadTimeout bounds a read of the Node.
const nodeReadTimeout = 15 * time.Second

// readNode reads the agent's Node: its UID and allocatable memory (0, with
// a warning, when that is unusable).
func (k *kubeParts) readNode(ctx context.Context) (*nodeFacts, error) {
	gctx, cancel := context.WithTimeout(ctx, nodeReadTimeout)
	n, err := k.cs.CoreV1().Nodes().Get(gctx, k.node, metav1.GetOptions{})
	cancel()
	if err != nil {
		return nil, err
	}
	f := &nodeFacts{Node: k.node, UID: n.UID, Read: time.Now().UTC()}
	if m, err := kubenode.FromNode(n); err != nil {
		k.log.Warn("the Node's allocatable memory is unusable; sizing without it", "node", k.node, "err", err)
	} else {
		f.Allocatable = m.Allocatable
	}
	return f, nil
}

// readLater reads the Node beside serving, after a start that planned with
// what the previous agent read (connectKube's planned), and says what
// changed since: the pool keeps its plan, and the next start plans with
// the new figures (they are kept for it).
func (k *kubeParts) readLater(ctx context.Context, save func(*nodeFacts)) {
	f, err := k.readNode(ctx)
	if err != nil {
		if ctx.Err() == nil {
			k.log.Warn("reading the Node beside serving failed; the pool is planned with what the previous agent read of it",
				"node", k.node, "readThen", k.planned.Read, "err", err)
		}
		return
	}
	if f.Allocatable != k.planned.Allocatable {
		k.log.Warn("the Node's allocatable memory changed since the previous agent read it; the pool keeps its plan until the agent's next start",
			"node", k.node, "planned", k.planned.Allocatable, "now", f.Allocatable, "readThen", k.planned.Read)
	}
	if f.UID != k.planned.UID {
		k.log.Warn("the Node was recreated since the previous agent read it; this agent's events name the old one",
			"node", k.node, "uid", f.UID, "uidThen", k.planned.UID)
	}
	save(f)
}

// startKube is the step "kube" (cluster mode): the API server, when
// there is one, names the node and gives its allocatable memory and the
// Node events. At a restart that adopts the pool, the Node is read beside
// serving (connectKube). closeKube stops the events.
func (a *agent) startKube(ctx context.Context) error {
	k, err := connectKube(ctx, a.opts.Kubeconfig, a.plannedNode(), a.log)
	if err != nil || k == nil {
		return err
	}
	a.kube = k
	a.node, a.allocatable, a.events = k.node, k.allocatable, k.events
	switch {
	case a.restart == nil:
		// Without a keeper a restart adopts nothing: nothing to keep.
	case k.read != nil:
		a.saveNodeFacts(k.read)
	case k.planned != nil:
		k.wg.Go(func() { k.readLater(ctx, a.saveNodeFacts) })
	}
	return nil
}

// closeKube stops the events. A stop also removes the kept Node facts:
// they serve a restart after a crash, which runs no stop; after a stop
// (an upgrade, an uninstall) the next agent reads the Node, and an
// uninstall leaves nothing on the node.
func (a *agent) closeKube() error {
	k := a.kube
	if k == nil {
		return nil
	}
	k.wg.Wait()
	k.close()
	if a.restart != nil {
		path := filepath.Join(a.cfg.StateDir, nodeFactsFile)
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			a.log.Warn("the kept Node facts were not removed", "path", path, "err", err)
		}
	}
	return nil
}

// nodeFacts are what an agent read of its Node, kept in the state
// directory (nodeFactsFile) for a restart after a crash (with a keeper:
// without one a restart adopts nothing).
type nodeFacts struct {
	Node        string    `json:"node"`
	UID         types.UID `json:"uid"`
	Allocatable int64     `json:"allocatable"`
	Read        time.Time `json:"read"`
}

// nodeFactsFile is the name of the kept nodeFacts in the state directory.
const nodeFactsFile = "node.json"

// plannedNode is what the previous agent read of the Node, when this
// start is a restart that adopts the pool (the keeper holds chunks) and
// the state directory has it; nil otherwise. Such a restart plans with it
// rather than wait for the API server: the pool it adopts was planned with
// it, and a slow or unreachable API server delays no restart.
func (a *agent) plannedNode() *nodeFacts {
	if r := a.restart; r == nil || r.held == nil || len(r.held.Chunks) == 0 {
		return nil
	}
	path := filepath.Join(a.cfg.StateDir, nodeFactsFile)
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var f *nodeFacts
	if err == nil {
		f, err = parseNodeFacts(data)
	}
	if err != nil {
		a.log.Warn("the kept Node facts are unreadable; reading the Node", "path", path, "err", err)
		return nil
	}
	return f
}

// parseNodeFacts decodes kept nodeFacts; facts without a node or with a
// negative allocatable memory are refused.
func parseNodeFacts(data []byte) (*nodeFacts, error) {
	var f nodeFacts
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if f.Node == "" || f.Allocatable < 0 {
		return nil, fmt.Errorf("node %q, allocatable memory %d: want a node and a figure of 0 or more", f.Node, f.Allocatable)
	}
	return &f, nil
}

// saveNodeFacts keeps f for the next start. A failure is logged: the next
// start then reads the Node before it plans.
func (a *agent) saveNodeFacts(f *nodeFacts) {
	data, _ := json.Marshal(f)
	path := filepath.Join(a.cfg.StateDir, nodeFactsFile)
	if err := writeFileAtomic(path, data); err != nil {
		a.log.Warn("the Node facts were not kept for the next start", "path", path, "err", err)
	}
}

// writeFileAtomic writes data to path through a temporary file renamed
// over it, making path's directory (0700) first.
func writeFileAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
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
