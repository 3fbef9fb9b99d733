package config

import (
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/kvpool/kvpool/internal/supervise"
	"github.com/kvpool/kvpool/pkg/contract"
)

// MaxPollAfterReply is the longest PollAfterReply (wire.SpinLimit).
const MaxPollAfterReply = time.Millisecond

// maxSunPath is the longest Unix socket path Linux accepts (sun_path is 108
// bytes including the terminating NUL).
const maxSunPath = 107

// maxDRADriverName is the longest DRA driver name resource.k8s.io/v1
// accepts.
const maxDRADriverName = 63

// MaxDevicePages is the most limits.maxDevicePages may be: a change's
// record in the books, up to 5 bytes per device page, then stays far
// within what the books replay (1 GiB).
const MaxDevicePages = 1 << 27

// MaxPages is the most limits.maxPages may be (256 GiB of page links).
const MaxPages = 1 << 36

// Validate checks every field and reports every problem at once: nil when
// the configuration is usable, else a utilerrors.Aggregate of
// *field.Error (k8s.io/apimachinery), each naming its field by YAML path
// ("sizing.fraction: Invalid value: 1.5: must be in (0, 1]"), printed one a
// line. ValidateFields gives the same errors as a list.
func (c *Config) Validate() error {
	if agg := c.ValidateFields().ToAggregate(); agg != nil {
		return byLine{agg}
	}
	return nil
}

// byLine prints an aggregate one error a line rather than as one bracketed
// line, so a long list stays readable in a log.
type byLine struct{ utilerrors.Aggregate }

func (b byLine) Error() string {
	errs := b.Errors()
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return strings.Join(msgs, "\n")
}

// ValidateFields checks every field and returns every problem found, one
// section at a time (each section's validator takes its own field.Path, as
// apimachinery's validators do).
func (c *Config) ValidateFields() field.ErrorList {
	var errs field.ErrorList
	errs = append(errs, c.validateTop()...)
	errs = append(errs, c.validateFrontDoor()...)
	errs = append(errs, validateGPUResources(field.NewPath("gpuResources"), c.GPUResources)...)
	errs = append(errs, c.Sizing.validate(field.NewPath("sizing"))...)
	errs = append(errs, c.Reclaim.validate(field.NewPath("reclaim"))...)
	errs = append(errs, c.Limits.validate(field.NewPath("limits"))...)
	errs = append(errs, validateAddress(field.NewPath("metrics", "address"), c.Metrics.Address)...)
	errs = append(errs, validateAddress(field.NewPath("health", "address"), c.Health.Address)...)
	errs = append(errs, c.Log.validate(field.NewPath("log"))...)
	errs = append(errs, c.Standalone.validate(field.NewPath("standalone"))...)
	return errs
}

// validateTop checks the fields at the top level: the object's type, the
// resource name, the directories and sockets.
func (c *Config) validateTop() field.ErrorList {
	var errs field.ErrorList
	p := field.NewPath
	if c.APIVersion != APIVersion && c.APIVersion != LegacyAPIVersion {
		errs = append(errs, field.NotSupported(p("apiVersion"), c.APIVersion, []string{APIVersion}))
	}
	if c.Kind != Kind {
		errs = append(errs, field.NotSupported(p("kind"), c.Kind, []string{Kind}))
	}
	if err := contract.CheckResourceName(c.ResourceName); err != nil {
		if c.ResourceName == "" {
			errs = append(errs, field.Required(p("resourceName"), "an extended resource name such as "+contract.DefaultResourceName))
		} else {
			errs = append(errs, field.Invalid(p("resourceName"), c.ResourceName, err.Error()))
		}
	}
	for _, d := range []struct{ field, dir string }{
		{"socketDir", c.SocketDir}, {"kubeletDir", c.KubeletDir}, {"stateDir", c.StateDir}, {"podLogsDir", c.PodLogsDir},
	} {
		if !filepath.IsAbs(d.dir) {
			errs = append(errs, field.Invalid(p(d.field), d.dir, "must be an absolute path"))
		}
	}
	if c.TokenBinding != TokenBindingPod && c.TokenBinding != TokenBindingNone {
		errs = append(errs, field.NotSupported(p("tokenBinding"), c.TokenBinding, []string{TokenBindingPod, TokenBindingNone}))
	}
	if filepath.IsAbs(c.SocketDir) && filepath.IsAbs(c.StateDir) {
		if msg := checkDirs(c.SocketDir, c.StateDir); msg != "" {
			errs = append(errs, field.Invalid(p("stateDir"), c.StateDir, msg))
		}
	}
	if d := c.PollAfterReply.Duration; d < 0 || d > MaxPollAfterReply {
		errs = append(errs, field.Invalid(p("pollAfterReply"), c.PollAfterReply.String(), fmt.Sprintf("must be between 0s and %v", MaxPollAfterReply)))
	}
	if n := c.RestartInPlace.Max; n < 0 || n > supervise.MaxRestarts {
		errs = append(errs, field.Invalid(p("restartInPlace", "max"), n, fmt.Sprintf("must be between 0 (off) and %d", supervise.MaxRestarts)))
	}
	if c.RestartInPlace.SpareMemory < 0 {
		errs = append(errs, field.Invalid(p("restartInPlace", "spareMemory"), c.RestartInPlace.SpareMemory.String(), "must not be negative"))
	}
	if d := c.RestartInPlace.SpareAfter.Duration; d < 0 || d > time.Hour {
		errs = append(errs, field.Invalid(p("restartInPlace", "spareAfter"), c.RestartInPlace.SpareAfter.String(), "must be between 0s and 1h"))
	}
	if d := c.RestartInPlace.Window.Duration; d <= 0 {
		errs = append(errs, field.Invalid(p("restartInPlace", "window"), c.RestartInPlace.Window.String(), "must be a positive duration such as 10m"))
	}
	if k := c.KeeperSocket; k != "" && (!filepath.IsAbs(k) || len(k) > maxSunPath) {
		errs = append(errs, field.Invalid(p("keeperSocket"), k, fmt.Sprintf("must be an absolute path of at most %d bytes", maxSunPath)))
	} else if k != "" && filepath.IsAbs(c.SocketDir) {
		if msg := checkKeeperSocket(c.SocketDir, k); msg != "" {
			errs = append(errs, field.Invalid(p("keeperSocket"), k, msg))
		}
	}
	if filepath.IsAbs(c.SocketDir) && len(c.SocketPath()) > maxSunPath {
		errs = append(errs, field.Invalid(p("socketDir"), c.SocketDir, fmt.Sprintf("socket path %q is %d bytes, longer than a Unix socket address allows (%d)", c.SocketPath(), len(c.SocketPath()), maxSunPath)))
	}
	return errs
}

// validateFrontDoor checks the front door kubelet talks to (mode) and the
// DRA driver's settings.
func (c *Config) validateFrontDoor() field.ErrorList {
	var errs field.ErrorList
	p := field.NewPath
	if c.Mode != ModeDevicePlugin && c.Mode != ModeDRA {
		errs = append(errs, field.NotSupported(p("mode"), c.Mode, []string{ModeDevicePlugin, ModeDRA}))
	}
	if msgs := validation.IsDNS1123Subdomain(c.DRA.DriverName); len(msgs) > 0 || len(c.DRA.DriverName) > maxDRADriverName {
		if len(c.DRA.DriverName) > maxDRADriverName {
			msgs = append(msgs, fmt.Sprintf("must be at most %d characters", maxDRADriverName))
		}
		errs = append(errs, field.Invalid(p("dra", "driverName"), c.DRA.DriverName, strings.Join(msgs, "; ")))
	}
	if !filepath.IsAbs(c.DRA.CDIDir) {
		errs = append(errs, field.Invalid(p("dra", "cdiDir"), c.DRA.CDIDir, "must be an absolute path"))
	}
	return errs
}

// validateGPUResources checks the resource names (or name prefixes ending
// in *) that PodResources lists a container's GPUs under.
func validateGPUResources(gp *field.Path, names []string) field.ErrorList {
	var errs field.ErrorList
	for i, r := range names {
		name, wild := strings.CutSuffix(r, "*")
		if wild {
			name += "x" // a prefix is valid when some name starting with it is
		}
		if err := contract.CheckResourceName(name); err != nil || strings.Contains(name, "*") {
			errs = append(errs, field.Invalid(gp.Index(i), r, "an extended resource name (domain/name), or a prefix of one followed by *"))
		}
	}
	return errs
}

func (s *Sizing) validate(sp *field.Path) field.ErrorList {
	var errs field.ErrorList
	nonNegative := func(name string, v Bytes) {
		if v < 0 {
			errs = append(errs, field.Invalid(sp.Child(name), v.String(), "must not be negative"))
		}
	}
	nonNegative("poolBytes", s.PoolBytes)
	if !(s.Fraction > 0 && s.Fraction <= 1) {
		errs = append(errs, field.Invalid(sp.Child("fraction"), s.Fraction, "must be in (0, 1]"))
	}
	nonNegative("reserveBytes", s.ReserveBytes)
	nonNegative("cgroupHeadroomBytes", s.CgroupHeadroomBytes)
	if s.Split != SplitEqual && s.Split != SplitMemory {
		errs = append(errs, field.NotSupported(sp.Child("split"), s.Split, []string{SplitEqual, SplitMemory}))
	}
	nonNegative("minPerGPU", s.MinPerGPU)
	nonNegative("maxPerGPU", s.MaxPerGPU)
	if s.MaxPerGPU > 0 && s.MinPerGPU > s.MaxPerGPU {
		errs = append(errs, field.Invalid(sp.Child("minPerGPU"), s.MinPerGPU.String(), fmt.Sprintf("must not be more than sizing.maxPerGPU %s", s.MaxPerGPU)))
	}
	switch {
	case s.ChunkBytes < 2*MiB || s.ChunkBytes > 64*GiB:
		errs = append(errs, field.Invalid(sp.Child("chunkBytes"), s.ChunkBytes.String(), "must be 2Mi to 64Gi"))
	case s.ChunkBytes%(2*MiB) != 0:
		errs = append(errs, field.Invalid(sp.Child("chunkBytes"), s.ChunkBytes.String(), "must be a multiple of 2Mi (the huge page size)"))
	}
	if s.PoolBytes > 0 && s.PoolBytes < s.ChunkBytes {
		errs = append(errs, field.Invalid(sp.Child("poolBytes"), s.PoolBytes.String(), fmt.Sprintf("is less than one chunk (sizing.chunkBytes %s)", s.ChunkBytes)))
	}
	switch s.HugePages {
	case HugePagesNever, HugePagesPrefer, HugePagesRequire:
	default:
		errs = append(errs, field.NotSupported(sp.Child("hugePages"), s.HugePages, []string{HugePagesNever, HugePagesPrefer, HugePagesRequire}))
	}
	return errs
}

func (r *Reclaim) validate(rp *field.Path) field.ErrorList {
	var errs field.ErrorList
	if d := r.GracePeriod.Duration; d < 0 {
		errs = append(errs, field.Invalid(rp.Child("gracePeriod"), d.String(), "must not be negative"))
	}
	if d := r.Interval.Duration; d <= 0 {
		errs = append(errs, field.Invalid(rp.Child("interval"), d.String(), "must be a positive duration such as 10s"))
	}
	return errs
}

func (lim *Limits) validate(lp *field.Path) field.ErrorList {
	var errs field.ErrorList
	for _, f := range []struct {
		name string
		v    int
	}{{"maxConns", lim.MaxConns}, {"maxConnsPerUID", lim.MaxConnsPerUID}, {"maxConnsPerPID", lim.MaxConnsPerPID},
		{"probeConns", lim.ProbeConns}, {"maxSessions", lim.MaxSessions},
		{"maxSessionsPerAllocation", lim.MaxSessionsPerAllocation}, {"maxStreamsPerSession", lim.MaxStreamsPerSession},
		{"maxStreams", lim.MaxStreams}} {
		if f.v <= 0 {
			errs = append(errs, field.Invalid(lp.Child(f.name), f.v, "must be a positive count"))
		}
	}
	switch {
	case lim.MaxConnsPerUID > lim.MaxConns:
		errs = append(errs, field.Invalid(lp.Child("maxConnsPerUID"), lim.MaxConnsPerUID, fmt.Sprintf("must not be more than limits.maxConns %d", lim.MaxConns)))
	case lim.MaxConnsPerPID > lim.MaxConnsPerUID:
		errs = append(errs, field.Invalid(lp.Child("maxConnsPerPID"), lim.MaxConnsPerPID, fmt.Sprintf("must not be more than limits.maxConnsPerUID %d", lim.MaxConnsPerUID)))
	}
	if lim.MaxSessionsPerAllocation > lim.MaxSessions {
		errs = append(errs, field.Invalid(lp.Child("maxSessionsPerAllocation"), lim.MaxSessionsPerAllocation, fmt.Sprintf("must not be more than limits.maxSessions %d", lim.MaxSessions)))
	}
	if lim.HelloTimeout.Duration <= 0 {
		errs = append(errs, field.Invalid(lp.Child("helloTimeout"), lim.HelloTimeout.String(), "must be a positive duration such as 5s"))
	} else if lim.OpenTimeout.Duration < lim.HelloTimeout.Duration {
		errs = append(errs, field.Invalid(lp.Child("openTimeout"), lim.OpenTimeout.String(), fmt.Sprintf("must not be less than limits.helloTimeout %v", lim.HelloTimeout.Duration)))
	}
	if lim.MaxNameBytesPerSession < 2*KiB {
		errs = append(errs, field.Invalid(lp.Child("maxNameBytesPerSession"), lim.MaxNameBytesPerSession.String(), "must be at least 2Ki (one stream with the longest request ID and label)"))
	}
	if lim.MaxStreams > 0 && lim.MaxStreams < lim.MaxStreamsPerSession {
		errs = append(errs, field.Invalid(lp.Child("maxStreams"), lim.MaxStreams, fmt.Sprintf("must not be less than limits.maxStreamsPerSession %d", lim.MaxStreamsPerSession)))
	}
	if lim.MaxNameBytes < lim.MaxNameBytesPerSession {
		errs = append(errs, field.Invalid(lp.Child("maxNameBytes"), lim.MaxNameBytes.String(), fmt.Sprintf("must not be less than limits.maxNameBytesPerSession %s", lim.MaxNameBytesPerSession)))
	}
	if lim.MaxDevicePages <= 0 || lim.MaxDevicePages > MaxDevicePages {
		errs = append(errs, field.Invalid(lp.Child("maxDevicePages"), lim.MaxDevicePages, fmt.Sprintf("must be 1 to %d", MaxDevicePages)))
	}
	if lim.MaxDevicePagesTotal < lim.MaxDevicePages {
		errs = append(errs, field.Invalid(lp.Child("maxDevicePagesTotal"), lim.MaxDevicePagesTotal, fmt.Sprintf("must not be less than limits.maxDevicePages %d", lim.MaxDevicePages)))
	}
	if lim.MaxPages < 0 || lim.MaxPages > MaxPages {
		errs = append(errs, field.Invalid(lp.Child("maxPages"), lim.MaxPages, fmt.Sprintf("must be 0 (the pool's bytes / 4Ki) to %d", MaxPages)))
	}
	if lim.MaxClientName < 16 || lim.MaxClientName > 2048 {
		errs = append(errs, field.Invalid(lp.Child("maxClientName"), lim.MaxClientName, "must be 16 to 2048"))
	}
	return errs
}

func validateAddress(ap *field.Path, addr string) field.ErrorList {
	if msg := checkAddress(addr); msg != "" {
		return field.ErrorList{field.Invalid(ap, addr, msg)}
	}
	return nil
}

func (l *Log) validate(lp *field.Path) field.ErrorList {
	var errs field.ErrorList
	switch l.Level {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, field.NotSupported(lp.Child("level"), l.Level, []string{"debug", "info", "warn", "error"}))
	}
	if l.Format != "text" && l.Format != "json" {
		errs = append(errs, field.NotSupported(lp.Child("format"), l.Format, []string{"text", "json"}))
	}
	return errs
}

func (st *Standalone) validate(sp *field.Path) field.ErrorList {
	var errs field.ErrorList
	tp := sp.Child("tokens")
	if len(st.Tokens) == 0 {
		errs = append(errs, field.Required(tp, "at least one token"))
	}
	seen := map[string]bool{}
	for i, t := range st.Tokens {
		switch {
		case t == "":
			errs = append(errs, field.Required(tp.Index(i), "a token must not be empty"))
		case strings.ContainsAny(t, ", \t\r\n"):
			errs = append(errs, field.Invalid(tp.Index(i), t, "must not contain a comma or whitespace"))
		case seen[t]:
			errs = append(errs, field.Duplicate(tp.Index(i), t))
		}
		seen[t] = true
	}
	if st.GPUs < 1 || st.GPUs > 64 {
		errs = append(errs, field.Invalid(sp.Child("gpus"), st.GPUs, "must be 1 to 64"))
	}
	if st.PoolBytes <= 0 {
		errs = append(errs, field.Invalid(sp.Child("poolBytes"), st.PoolBytes.String(), "must be a positive size such as 512Mi"))
	}
	return errs
}

// CheckDirs refuses a state directory (which holds every allocation token)
// that is the socket directory (which pods mount), inside it, or holds it:
// either way a pod, or whoever can write the socket directory, would reach
// the tokens, or the agent's checkpoint writes would land where pods look.
// Both paths must be absolute; they are compared cleaned, without following
// symbolic links.
func CheckDirs(socketDir, stateDir string) error {
	if msg := checkDirs(socketDir, stateDir); msg != "" {
		return fmt.Errorf("%q %s", stateDir, msg)
	}
	return nil
}

// checkDirs is CheckDirs' reason, without the state directory's name: ""
// when the two are apart.
func checkDirs(socketDir, stateDir string) string {
	sock, state := filepath.Clean(socketDir), filepath.Clean(stateDir)
	within := func(dir, parent string) bool {
		rel, err := filepath.Rel(parent, dir)
		return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
	}
	switch {
	case sock == state:
		return "is also the socket directory; the tokens must not be where pods mount"
	case within(state, sock):
		return fmt.Sprintf("is inside the socket directory %q, which pods mount: they would read every allocation token", socketDir)
	case within(sock, state):
		return fmt.Sprintf("contains the socket directory %q; keep them apart (pods mount the socket directory)", socketDir)
	}
	return ""
}

// CheckKeeperSocket refuses a keeper socket inside the socket directory
// (which pods mount): a process in a pod could connect to the keeper and
// take the pool's chunks and books while the agent is down, or hold the
// agent's place. Both paths must be absolute; they are compared cleaned,
// without following symbolic links.
func CheckKeeperSocket(socketDir, keeperSocket string) error {
	if msg := checkKeeperSocket(socketDir, keeperSocket); msg != "" {
		return fmt.Errorf("keeper socket %q %s", keeperSocket, msg)
	}
	return nil
}

func checkKeeperSocket(socketDir, keeperSocket string) string {
	sock, keeper := filepath.Clean(socketDir), filepath.Clean(keeperSocket)
	rel, err := filepath.Rel(sock, keeper)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return ""
	}
	return fmt.Sprintf("is inside the socket directory %q, which pods mount: a process in a pod could take the pool's chunks and books from the keeper while the agent is down; put it outside (the chart's default is /var/lib/kvpool/keeper/keeper.sock)", socketDir)
}

func checkAddress(addr string) string {
	if addr == "" {
		return ""
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "must be host:port (e.g. :9464)"
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return fmt.Sprintf("port %q must be a number from 0 to 65535", port)
	}
	return ""
}
