package plugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/kvpool/kvpool/pkg/observe"
)

// Run builds a Plugin and serves it until ctx ends; see (*Plugin).Run.
func Run(ctx context.Context, o Options) error {
	p, err := New(o)
	if err != nil {
		return err
	}
	return p.Run(ctx)
}

// PluginDir is the kubelet directory that holds kubelet.sock and the
// plugins' sockets.
func (p *Plugin) PluginDir() string { return filepath.Join(p.o.KubeletDir, "device-plugins") }

// Endpoint is the file name of the plugin's socket inside PluginDir.
func (p *Plugin) Endpoint() string {
	return "kvpool-" + strings.NewReplacer("/", "_", ".", "_").Replace(p.o.ResourceName) + ".sock"
}

// Run serves the device plugin, registers with kubelet, registers again
// whenever kubelet restarts (kubelet.sock is recreated or the plugin's own
// socket is removed), and reconciles allocations against PodResources every
// Interval. It returns when ctx ends.
func (p *Plugin) Run(ctx context.Context) error { return p.run(ctx, true) }

// run reconciles and renews until ctx ends, and with register serves the
// device plugin and registers with kubelet.
func (p *Plugin) run(ctx context.Context, register bool) error {
	done := make(chan struct{}, 2)
	go func() {
		defer func() { done <- struct{}{} }()
		p.reconcileLoop(ctx)
	}()
	go func() {
		defer func() { done <- struct{}{} }()
		p.renewLoop(ctx)
	}()
	defer func() { <-done; <-done }()
	if !register {
		<-ctx.Done()
		return nil
	}
	for {
		err := p.serveOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		p.log.Info("device plugin restarting", "reason", err)
	}
}

func (p *Plugin) reconcileLoop(ctx context.Context) {
	t := time.NewTicker(p.o.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := p.Reconcile(ctx); err != nil && ctx.Err() == nil {
			p.log.Warn("reconcile", "err", err)
		}
	}
}

// renewLoop renews reclaimed chunks as soon as they are reclaimed, and
// retries failed renewals when their backoff ends.
func (p *Plugin) renewLoop(ctx context.Context) {
	var timer <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.l.kick:
		case <-timer:
		}
		timer = nil
		if next := p.renewDirty(); !next.IsZero() {
			timer = time.After(max(next.Sub(p.o.Now()), 10*time.Millisecond))
		}
	}
}

// sockID identifies one incarnation of a socket file.
type sockID struct {
	fi os.FileInfo
}

func statSock(path string) (sockID, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return sockID{}, false
	}
	return sockID{fi}, true
}

func (a sockID) same(b sockID) bool {
	return os.SameFile(a.fi, b.fi) && a.fi.ModTime().Equal(b.fi.ModTime())
}

// serveOnce runs one incarnation: listen, register, and watch until kubelet
// restarts or ctx ends.
func (p *Plugin) serveOnce(ctx context.Context) error {
	dir := p.PluginDir()
	sock := filepath.Join(dir, p.Endpoint())
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return p.pause(ctx, fmt.Errorf("remove stale socket: %w", err))
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return p.pause(ctx, fmt.Errorf("listen: %w", err))
	}
	srv := grpc.NewServer()
	lost := make(chan struct{}, 1)
	pluginapi.RegisterDevicePluginServer(srv, &watchedServer{Plugin: p, lost: lost})
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	defer p.stopServing(ctx, srv, serveErr, sock)
	ours, _ := statSock(sock)
	return p.watch(ctx, dir, sock, ours, lost, serveErr)
}

// stopServing ends an incarnation's gRPC server and removes its socket.
// When the plugin stops for good (ctx done) it first tells kubelet there
// are no devices left (Withdraw) and gives the streams a moment to send
// that.
func (p *Plugin) stopServing(ctx context.Context, srv *grpc.Server, serveErr chan error, sock string) {
	p.registered.Store(false)
	if ctx.Err() != nil {
		p.Withdraw()
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(2 * time.Second):
		}
	}
	srv.Stop()
	if err := <-serveErr; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		p.log.Debug("device plugin server ended", "err", err)
	}
	if cur, ok := statSock(sock); ok && cur.fi.Mode()&os.ModeSocket != 0 {
		os.Remove(sock)
	}
}

// watch registers with kubelet once its socket is there, and returns when
// the incarnation ends: ctx done, our socket removed or replaced, kubelet's
// socket recreated or its ListAndWatch closed (kubelet restarted), or the
// gRPC server failed (its error is put back on serveErr for stopServing).
func (p *Plugin) watch(ctx context.Context, dir, sock string, ours sockID, lost <-chan struct{}, serveErr chan error) error {
	kubelet := filepath.Join(dir, "kubelet.sock")
	// Kubelet's restart is seen as it happens through inotify on the
	// directory: any event on our socket or kubelet.sock runs the checks
	// below at once. The poll every Watch is the fallback for a missed
	// event (queue overflow); without inotify it polls at the retry pace.
	events, closeWatch := p.watchDir(dir)
	defer closeWatch()
	poll := p.o.Watch
	if events == nil {
		poll = min(poll, p.retryDelay())
	}
	t := time.NewTicker(poll)
	defer t.Stop()
	var retry <-chan time.Time // a failed registration is tried again soon
	var kid sockID
	registered := false
	for {
		cur, ok := statSock(sock)
		if !ok || !cur.same(ours) {
			return errors.New("plugin socket removed (kubelet restarted?)")
		}
		k, kok := statSock(kubelet)
		switch {
		case registered && (!kok || !k.same(kid)):
			return errors.New("kubelet socket recreated (kubelet restarted)")
		case !registered && kok:
			err := p.register(ctx, kubelet)
			p.report(observe.Op{Name: observe.OpRegister, Err: err})
			if err != nil {
				p.log.Warn("register with kubelet", "err", err)
				retry = time.After(p.retryDelay())
			} else {
				registered, kid, retry = true, k, nil
				p.registrations.Add(1)
				p.registered.Store(true)
				p.log.Info("registered with kubelet", "endpoint", p.Endpoint())
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-lost:
			if registered {
				return errors.New("kubelet closed ListAndWatch (kubelet restarted?)")
			}
		case err := <-serveErr:
			serveErr <- err // for stopServing
			return fmt.Errorf("serve: %w", err)
		case <-events:
		case <-retry:
		case <-t.C:
		}
	}
}

// watchDir watches dir with inotify and returns a channel that receives
// whenever something may have happened to the plugin's socket or
// kubelet.sock, and the function that stops watching. Where inotify is not
// available it returns a nil channel (which never receives) and logs why.
func (p *Plugin) watchDir(dir string) (<-chan struct{}, func()) {
	w, err := fsnotify.NewWatcher()
	if err == nil {
		if err = w.Add(dir); err != nil {
			w.Close()
		}
	}
	if err != nil {
		p.log.Warn("cannot watch the device plugin directory; polling it", "dir", dir, "err", err)
		return nil, func() {}
	}
	ch := make(chan struct{}, 1)
	done := make(chan struct{})
	mine := p.Endpoint()
	go func() {
		defer close(done)
		for {
			select {
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if name := filepath.Base(ev.Name); name != mine && name != "kubelet.sock" {
					continue
				}
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				// An overflowed queue lost events: look at the files.
				p.log.Debug("device plugin directory watch", "err", err)
			}
			select {
			case ch <- struct{}{}:
			default: // a check is already due
			}
		}
	}()
	return ch, func() {
		if err := w.Close(); err != nil {
			p.log.Debug("close the device plugin directory watch", "err", err)
		}
		<-done
	}
}

// retryDelay is how long a failed listen or registration waits before it is
// tried again.
func (p *Plugin) retryDelay() time.Duration { return min(p.o.Watch, time.Second) }

// watchedServer is the plugin as one incarnation serves it: a ListAndWatch
// stream that kubelet ends (kubelet stopped, or replaced the connection)
// is reported on lost. File times alone can miss a kubelet.sock recreated
// within one tick of the kernel's coarse clock with a reused inode.
type watchedServer struct {
	*Plugin
	lost chan struct{}
}

func (w *watchedServer) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	err := w.listAndWatch(stream)
	select {
	case w.lost <- struct{}{}:
	default:
	}
	return err
}

func (p *Plugin) pause(ctx context.Context, err error) error {
	select {
	case <-ctx.Done():
	case <-time.After(p.retryDelay()):
	}
	return err
}

func (p *Plugin) register(ctx context.Context, kubelet string) error {
	conn, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     p.Endpoint(),
		ResourceName: p.o.ResourceName,
		Options:      &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	return err
}
