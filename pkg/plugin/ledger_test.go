package plugin

import (
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// An Allocate that waits on kubelet's PodResources, and then on a slow
// renewal of the chunks it reclaims, holds no lock Authorize needs: a
// client with a token opens its session meanwhile.
func TestAuthorizeNotBlockedBySlowAllocate(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-0")
	e.mustAllocate("gpu0-numa0-1") // never listed: kubelet may give it away

	authorizeWithin := func(what string) {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			_, err := e.p.Authorize(token)
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Authorize while %s: %v", what, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("Authorize blocked while %s", what)
		}
	}

	// Kubelet hands gpu0-numa0-1 to a new pod: the Allocate must ask
	// PodResources who holds it, and PodResources is stuck.
	release, blocked := e.prs.Block()
	defer release()
	renewing, unblockRenew := make(chan struct{}, 1), make(chan struct{})
	e.mu.Lock()
	e.zeroFn = func(id string) error {
		if id == "gpu0-numa0-1" {
			renewing <- struct{}{}
			<-unblockRenew
		}
		return nil
	}
	e.mu.Unlock()
	allocated := make(chan error, 1)
	go func() {
		_, err := e.allocate([]string{"gpu0-numa0-1", "gpu0-numa0-2"})
		allocated <- err
	}()
	select {
	case <-blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("Allocate never asked PodResources")
	}
	authorizeWithin("an Allocate waits on PodResources")

	// PodResources answers (no pod holds the old allocation): the Allocate
	// reclaims it and renews its chunk, slowly.
	release()
	select {
	case <-renewing:
	case <-time.After(5 * time.Second):
		t.Fatal("Allocate never renewed the reclaimed chunk")
	}
	authorizeWithin("an Allocate renews a chunk")
	select {
	case err := <-allocated:
		t.Fatalf("Allocate returned before its renewal ended: %v", err)
	default:
	}
	close(unblockRenew)
	if err := <-allocated; err != nil {
		t.Fatalf("Allocate after the renewal: %v", err)
	}
	if e.zeroCount("gpu0-numa0-1") != 1 {
		t.Errorf("gpu0-numa0-1 renewed %d times, want 1", e.zeroCount("gpu0-numa0-1"))
	}
}

// A reconcile stuck in PodResources does not hold Authorize up either.
func TestAuthorizeNotBlockedBySlowReconcile(t *testing.T) {
	e := newEnv(t)
	token := e.mustAllocate("gpu0-numa0-0")
	release, blocked := e.prs.Block()
	defer release()
	reconciled := make(chan error, 1)
	go func() { reconciled <- e.p.Reconcile(t.Context()) }()
	select {
	case <-blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("Reconcile never asked PodResources")
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.p.Authorize(token)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Authorize blocked by a reconcile waiting on PodResources")
	}
	release()
	if err := <-reconciled; err != nil {
		t.Fatal(err)
	}
}

// Every refusal of Allocate is an *AllocateError whose result decides the
// gRPC code kubelet sees.
func TestAllocateErrorCodes(t *testing.T) {
	for _, c := range []struct {
		result string
		code   codes.Code
	}{
		{ResultInvalid, codes.InvalidArgument},
		{ResultRefused, codes.FailedPrecondition},
		{ResultUnavailable, codes.Unavailable},
		{ResultFailed, codes.Internal},
	} {
		err := grpcError(allocErr(c.result, "x %d", 1))
		if status.Code(err) != c.code || status.Convert(err).Message() != "allocate: x 1" {
			t.Errorf("%s: %v", c.result, err)
		}
	}
	if status.Code(grpcError(errors.New("other"))) != codes.Internal {
		t.Error("an unclassified error is not Internal")
	}
}

// The plugin reports each Allocate, registration, reconcile, reclaim and
// failed renewal to its observer (metrics and the error ring), and lists a
// chunk whose renewal failed as unhealthy (the KVPoolNode turns Degraded).
func TestPluginReportsOperations(t *testing.T) {
	e := newEnv(t)
	// The serve loop reports the registration just after kubelet accepts it.
	for deadline := time.Now().Add(5 * time.Second); !slices.Contains(e.ops(), "plugin/register ok"); {
		if time.Now().After(deadline) {
			t.Fatalf("no registration reported: %q", e.ops())
		}
		time.Sleep(time.Millisecond)
	}
	token := e.mustAllocate("gpu0-numa0-0")
	id := AllocationID(token)
	if _, err := e.allocate([]string{"nope"}); status.Code(err) != codes.InvalidArgument {
		t.Fatal(err)
	}
	e.mu.Lock()
	e.zeroFn = func(string) error { return errBoom }
	e.mu.Unlock()
	e.clock.Advance(testGrace)
	e.reconcile() // reclaims; the renewal fails
	if got := e.p.UnhealthyChunks(); !slices.Equal(got, []string{"gpu0-numa0-0"}) {
		t.Errorf("unhealthy chunks = %v while its renewal fails", got)
	}
	if got := e.p.UnhealthyByGPU(); len(got) != 1 || got[0] != 1 {
		t.Errorf("unhealthy by GPU = %v, want gpu 0: 1", got)
	}
	if _, err := e.allocate([]string{"gpu0-numa0-0"}); status.Code(err) != codes.FailedPrecondition {
		t.Fatal(err)
	}
	e.mu.Lock()
	e.zeroFn = nil
	e.mu.Unlock()
	e.clock.Advance(RenewRetryFirst)
	e.reconcile()
	if got := e.p.UnhealthyChunks(); len(got) != 0 {
		t.Errorf("unhealthy chunks = %v after a successful renewal", got)
	}
	want := []string{
		"plugin/allocate ok",
		"plugin/allocate invalid",
		"reclaim/pod_gone ok " + id,
		"plugin/reconcile ok",
		"reclaim/renew error",
		"plugin/allocate refused",
		"plugin/reconcile ok",
	}
	// The renew loop, woken by the reclaim, may report the failed renewal
	// before the reconcile reports the reclaim: compare without order.
	got := e.ops()[1:]
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("reported\n%q\nwant\n%q", got, want)
	}
}
