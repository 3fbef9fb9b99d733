package dra

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/kvpool/kvpool/pkg/contract"
	"github.com/kvpool/kvpool/pkg/observe"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: each claim's
// results for this driver become a plugin.Claim, which the ledger grants
// (or, prepared before, answers the same), and a CDI spec named by the
// claim's UID gives each request's containers the socket and the token.
// One claim's failure is its result only; kubelet retries it.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		start := time.Now()
		devs, err := d.prepare(ctx, claim)
		d.report(observe.Op{Name: observe.OpPrepare, Duration: time.Since(start), Err: err, Allocation: string(claim.UID)})
		if err != nil {
			d.log.Warn("prepare claim", "claim", claim.Namespace+"/"+claim.Name, "uid", claim.UID, "err", err)
			out[claim.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devs}
	}
	return out, nil
}

func (d *Driver) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	c, results, err := d.claimOf(claim)
	if err != nil {
		return nil, err
	}
	grants, err := d.o.Ledger.PrepareClaim(ctx, c)
	if err != nil {
		return nil, err
	}
	cdiIDs, err := d.cdi.write(string(claim.UID), grants)
	if err != nil {
		// The grant stands (a retry answers it the same); the container
		// cannot start without its spec, so the Prepare fails.
		return nil, &plugin.AllocateError{Result: plugin.ResultFailed, Err: err}
	}
	devs := make([]kubeletplugin.Device, 0, len(results))
	for _, r := range results {
		devs = append(devs, kubeletplugin.Device{
			Requests:     []string{r.Request},
			PoolName:     r.Pool,
			DeviceName:   r.Device,
			CDIDeviceIDs: []string{cdiIDs[r.Request]},
			ShareID:      r.ShareID,
		})
	}
	return devs, nil
}

// claimOf reads a claim's allocation: its results for this driver, by
// request, as named chunks (chunk devices) and shares (a share device's
// consumed memory in whole chunks), and the pods it is reserved for.
func (d *Driver) claimOf(claim *resourceapi.ResourceClaim) (plugin.Claim, []resourceapi.DeviceRequestAllocationResult, error) {
	c := plugin.Claim{UID: string(claim.UID), Namespace: claim.Namespace, Name: claim.Name}
	fail := func(format string, args ...any) (plugin.Claim, []resourceapi.DeviceRequestAllocationResult, error) {
		return plugin.Claim{}, nil, &plugin.AllocateError{Result: plugin.ResultInvalid,
			Err: fmt.Errorf("claim %s/%s: "+format, append([]any{claim.Namespace, claim.Name}, args...)...)}
	}
	if claim.Status.Allocation == nil {
		return fail("not allocated")
	}
	for _, ref := range claim.Status.ReservedFor {
		if ref.APIGroup == "" && ref.Resource == "pods" {
			c.PodUIDs = append(c.PodUIDs, string(ref.UID))
		}
	}
	chunks, _ := d.o.Chunks.Chunks()
	byName := make(map[string]Chunk, len(chunks))
	chunkSize := map[int]int64{}
	for _, ch := range chunks {
		byName[DeviceName(ch.ID)] = ch
		if _, ok := chunkSize[ch.GPU]; !ok {
			chunkSize[ch.GPU] = ch.Size
		}
	}
	var results []resourceapi.DeviceRequestAllocationResult
	reqs := map[string]*plugin.ClaimRequest{}
	var order []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != d.o.DriverName {
			continue
		}
		switch {
		case r.Pool != d.o.NodeName:
			return fail("device %s is from pool %q, not this node's (%s)", r.Device, r.Pool, d.o.NodeName)
		case r.AdminAccess != nil && *r.AdminAccess:
			return fail("request %s asks for admin access, which host KV does not offer", r.Request)
		}
		req := reqs[r.Request]
		if req == nil {
			req = &plugin.ClaimRequest{Name: r.Request}
			reqs[r.Request] = req
			order = append(order, r.Request)
		}
		if g, ok := shareGPU(r.Device); ok {
			n, err := shareChunks(r, chunkSize[g])
			if err != nil {
				return fail("request %s: %v", r.Request, err)
			}
			req.Shares = append(req.Shares, plugin.Share{GPU: g, Chunks: n})
		} else {
			ch, ok := byName[r.Device]
			if !ok {
				return plugin.Claim{}, nil, &plugin.AllocateError{Result: plugin.ResultUnavailable,
					Err: fmt.Errorf("claim %s/%s: device %s is not a ready chunk of this node (yet)", claim.Namespace, claim.Name, r.Device)}
			}
			req.Devices = append(req.Devices, ch.ID)
		}
		results = append(results, r)
	}
	if len(order) == 0 {
		return fail("no device of driver %s is allocated to it", d.o.DriverName)
	}
	for _, name := range order {
		c.Requests = append(c.Requests, *reqs[name])
	}
	return c, results, nil
}

// shareGPU parses a share device's name (ShareDevice).
func shareGPU(device string) (int, bool) {
	rest, ok := strings.CutPrefix(device, "gpu")
	if !ok {
		return 0, false
	}
	num, ok := strings.CutSuffix(rest, "-share")
	if !ok || num == "" || len(num) > 4 {
		return 0, false
	}
	g := 0
	for _, ch := range num {
		if ch < '0' || ch > '9' {
			return 0, false
		}
		g = g*10 + int(ch-'0')
	}
	return g, true
}

// shareChunks is how many chunks of chunk bytes a share's consumed memory
// is: the request policy makes it a whole number of at least one.
func shareChunks(r resourceapi.DeviceRequestAllocationResult, chunk int64) (int, error) {
	if r.ShareID == nil {
		return 0, fmt.Errorf("share device %s allocated without a share ID", r.Device)
	}
	q, ok := r.ConsumedCapacity[CapMemory]
	if !ok {
		return 0, fmt.Errorf("share device %s allocated without consumed memory", r.Device)
	}
	if chunk <= 0 {
		return 0, fmt.Errorf("share device %s: its GPU has no ready chunk", r.Device)
	}
	b, ok := q.AsInt64()
	if !ok || b <= 0 || b%chunk != 0 {
		return 0, fmt.Errorf("share device %s: consumed memory %s is not a positive multiple of the chunk size %d", r.Device, q.String(), chunk)
	}
	return int(b / chunk), nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: each claim's
// allocations end (the ledger renews their chunks) and its CDI spec goes.
// A claim this driver never prepared, or unprepared already, is fine.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		start := time.Now()
		err := d.unprepare(string(c.UID))
		d.report(observe.Op{Name: observe.OpUnprepare, Duration: time.Since(start), Err: err, Allocation: string(c.UID)})
		if err != nil {
			d.log.Warn("unprepare claim", "claim", c.String(), "err", err)
		}
		out[c.UID] = err
	}
	return out, nil
}

func (d *Driver) unprepare(uid string) error {
	if !plugin.ValidUID(uid) {
		// Never a file name built from it.
		return &plugin.AllocateError{Result: plugin.ResultInvalid, Err: fmt.Errorf("claim UID %q is not a UID", uid)}
	}
	_, err := d.o.Ledger.UnprepareClaim(uid)
	// The spec goes even when revoking failed: the claim's containers are
	// gone (kubelet unprepares after they stopped).
	return errors.Join(err, d.cdi.remove(uid))
}

// Claims lists the prepared claims for /status, the KVPoolNode and the
// metrics, with their requests' chunks.
func (d *Driver) Claims() []plugin.Record { return d.o.Ledger.Claims() }

// cdiName is the CDI device name of a claim's request: the claim's UID and
// the request ("request" or "request/subrequest", '/' made '_').
func cdiName(uid, request string) string {
	return uid + "-" + strings.ReplaceAll(request, "/", "_")
}

// envOf is what a request's containers get in their environment.
func envOf(token string) []string {
	return []string{contract.EnvSocket + "=" + contract.ContainerSocket, contract.EnvToken + "=" + token}
}
