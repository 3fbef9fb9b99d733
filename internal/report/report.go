package report

import (
	"encoding/json"
	"net/http"
	"time"
)

// Report is what GET /status returns and `agent status` prints.
type Report struct {
	Node    string `json:"node,omitempty"`
	Version string `json:"version,omitempty"`
	Mode    string `json:"mode,omitempty"` // "cluster" or "standalone"
	// Door is the front door pods get host KV through in cluster mode:
	// "devicePlugin" or "dra".
	Door    string    `json:"door,omitempty"`
	Started time.Time `json:"started"`
	Ready   bool      `json:"ready"`
	Health  string    `json:"health,omitempty"` // readiness failures, one line; empty when ready
	Snapshot
	Errors      []Entry `json:"errors"`
	ErrorsTotal uint64  `json:"errorsTotal"`
	// Restart is what the agent took over from the keeper; nil without one.
	Restart *Restart `json:"restart,omitempty"`
	// Claims are the ResourceClaims the DRA driver prepared.
	Claims []Claim `json:"claims,omitempty"`
}

// Reporter assembles Reports. Pool is required; the rest is optional.
type Reporter struct {
	Pool    Source
	Errors  *Ring
	Targets func() map[int]int64 // planned bytes per GPU
	// Readiness reports whether the agent is ready and, when not, why.
	Readiness func() (ready bool, reason string)
	Node      string
	Version   string
	Mode      string
	Started   time.Time
	Now       func() time.Time // defaults to time.Now
	// Restart reports what the agent took over from the keeper (nil: no keeper).
	Restart func() *Restart
	// Door is the front door (Report.Door).
	Door string
	// Claims lists the prepared ResourceClaims (nil: none).
	Claims func() []Claim
}

// Report takes a snapshot now.
func (r *Reporter) Report() Report {
	now := time.Now
	if r.Now != nil {
		now = r.Now
	}
	var targets map[int]int64
	if r.Targets != nil {
		targets = r.Targets()
	}
	rep := Report{
		Node: r.Node, Version: r.Version, Mode: r.Mode, Door: r.Door, Started: r.Started,
		Snapshot: Take(r.Pool, targets, now()),
		Errors:   []Entry{},
		Ready:    true,
	}
	if r.Readiness != nil {
		rep.Ready, rep.Health = r.Readiness()
	}
	if r.Errors != nil {
		rep.Errors = r.Errors.Entries()
		rep.ErrorsTotal = r.Errors.Total()
	}
	if r.Restart != nil {
		rep.Restart = r.Restart()
	}
	if r.Claims != nil {
		rep.Claims = r.Claims()
	}
	return rep
}

// ServeHTTP answers GET (and HEAD) with the report as JSON.
func (r *Reporter) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	body, err := json.MarshalIndent(r.Report(), "", "  ")
	if err != nil {
		http.Error(w, "encode status: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(append(body, '\n')) // a reader that went away
}
