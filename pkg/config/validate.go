package config

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvpool/kvpool/pkg/contract"
)

// FieldError is one invalid field. Field is the YAML path
// ("sizing.fraction").
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// maxSunPath is the longest Unix socket path Linux accepts (sun_path is 108
// bytes including the terminating NUL).
const maxSunPath = 107

// Validate checks every field and returns all problems joined, each a
// *FieldError naming the field; nil when the configuration is usable.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)})
	}
	if c.APIVersion != APIVersion {
		bad("apiVersion", "is %q, want %q", c.APIVersion, APIVersion)
	}
	if c.Kind != Kind {
		bad("kind", "is %q, want %q", c.Kind, Kind)
	}
	if err := contract.CheckResourceName(c.ResourceName); err != nil {
		bad("resourceName", "%v", err)
	}
	for _, d := range []struct{ field, dir string }{
		{"socketDir", c.SocketDir}, {"kubeletDir", c.KubeletDir}, {"stateDir", c.StateDir}, {"podLogsDir", c.PodLogsDir},
	} {
		if !filepath.IsAbs(d.dir) {
			bad(d.field, "%q is not an absolute path", d.dir)
		}
	}
	if c.TokenBinding != TokenBindingPod && c.TokenBinding != TokenBindingNone {
		bad("tokenBinding", "is %q, want %q or %q", c.TokenBinding, TokenBindingPod, TokenBindingNone)
	}
	if filepath.IsAbs(c.SocketDir) && filepath.IsAbs(c.StateDir) {
		if err := CheckDirs(c.SocketDir, c.StateDir); err != nil {
			bad("stateDir", "%s", err.Error())
		}
	}
	if k := c.KeeperSocket; k != "" && (!filepath.IsAbs(k) || len(k) > maxSunPath) {
		bad("keeperSocket", "%q is not an absolute path of at most %d bytes", k, maxSunPath)
	}
	if filepath.IsAbs(c.SocketDir) && len(c.SocketPath()) > maxSunPath {
		bad("socketDir", "socket path %q is %d bytes, longer than a Unix socket address allows (%d)", c.SocketPath(), len(c.SocketPath()), maxSunPath)
	}

	s := &c.Sizing
	if s.PoolBytes < 0 {
		bad("sizing.poolBytes", "is negative")
	}
	if !(s.Fraction > 0 && s.Fraction <= 1) {
		bad("sizing.fraction", "is %v, want a value in (0, 1]", s.Fraction)
	}
	if s.ReserveBytes < 0 {
		bad("sizing.reserveBytes", "is negative")
	}
	if s.CgroupHeadroomBytes < 0 {
		bad("sizing.cgroupHeadroomBytes", "is negative")
	}
	if s.Split != SplitEqual && s.Split != SplitMemory {
		bad("sizing.split", "is %q, want %q or %q", s.Split, SplitEqual, SplitMemory)
	}
	if s.MinPerGPU < 0 {
		bad("sizing.minPerGPU", "is negative")
	}
	if s.MaxPerGPU < 0 {
		bad("sizing.maxPerGPU", "is negative")
	}
	if s.MaxPerGPU > 0 && s.MinPerGPU > s.MaxPerGPU {
		bad("sizing.minPerGPU", "%s is more than sizing.maxPerGPU %s", s.MinPerGPU, s.MaxPerGPU)
	}
	switch {
	case s.ChunkBytes < 2*MiB || s.ChunkBytes > 64*GiB:
		bad("sizing.chunkBytes", "is %s, want 2Mi to 64Gi", s.ChunkBytes)
	case s.ChunkBytes%(2*MiB) != 0:
		bad("sizing.chunkBytes", "%s is not a multiple of 2Mi (the huge page size)", s.ChunkBytes)
	}
	if s.PoolBytes > 0 && s.PoolBytes < s.ChunkBytes {
		bad("sizing.poolBytes", "%s is less than one chunk (sizing.chunkBytes %s)", s.PoolBytes, s.ChunkBytes)
	}
	switch s.HugePages {
	case HugePagesNever, HugePagesPrefer, HugePagesRequire:
	default:
		bad("sizing.hugePages", "is %q, want %q, %q or %q", s.HugePages, HugePagesNever, HugePagesPrefer, HugePagesRequire)
	}

	if c.Reclaim.GracePeriod.Duration < 0 {
		bad("reclaim.gracePeriod", "is negative")
	}
	if c.Reclaim.Interval.Duration <= 0 {
		bad("reclaim.interval", "is %v, want a positive duration such as 10s", c.Reclaim.Interval.Duration)
	}
	lim := &c.Limits
	for _, f := range []struct {
		name string
		v    int
	}{{"limits.maxConns", lim.MaxConns}, {"limits.maxConnsPerUID", lim.MaxConnsPerUID}, {"limits.maxConnsPerPID", lim.MaxConnsPerPID},
		{"limits.probeConns", lim.ProbeConns}, {"limits.maxSessions", lim.MaxSessions},
		{"limits.maxSessionsPerAllocation", lim.MaxSessionsPerAllocation}, {"limits.maxStreamsPerSession", lim.MaxStreamsPerSession}} {
		if f.v <= 0 {
			bad(f.name, "is %d, want a positive count", f.v)
		}
	}
	switch {
	case lim.MaxConnsPerUID > lim.MaxConns:
		bad("limits.maxConnsPerUID", "%d is more than limits.maxConns %d", lim.MaxConnsPerUID, lim.MaxConns)
	case lim.MaxConnsPerPID > lim.MaxConnsPerUID:
		bad("limits.maxConnsPerPID", "%d is more than limits.maxConnsPerUID %d", lim.MaxConnsPerPID, lim.MaxConnsPerUID)
	}
	if lim.MaxSessionsPerAllocation > lim.MaxSessions {
		bad("limits.maxSessionsPerAllocation", "%d is more than limits.maxSessions %d", lim.MaxSessionsPerAllocation, lim.MaxSessions)
	}
	if lim.HelloTimeout.Duration <= 0 {
		bad("limits.helloTimeout", "is %v, want a positive duration such as 5s", lim.HelloTimeout.Duration)
	} else if lim.OpenTimeout.Duration < lim.HelloTimeout.Duration {
		bad("limits.openTimeout", "%v is less than limits.helloTimeout %v", lim.OpenTimeout.Duration, lim.HelloTimeout.Duration)
	}
	if lim.MaxNameBytesPerSession < 2*KiB {
		bad("limits.maxNameBytesPerSession", "is %s, want at least 2Ki (one stream with the longest request ID and label)", lim.MaxNameBytesPerSession)
	}
	if lim.MaxDevicePages <= 0 || lim.MaxDevicePages > 1<<31-2 {
		bad("limits.maxDevicePages", "is %d, want 1 to %d", lim.MaxDevicePages, 1<<31-2)
	}
	if lim.MaxClientName < 16 || lim.MaxClientName > 2048 {
		bad("limits.maxClientName", "is %d, want 16 to 2048", lim.MaxClientName)
	}
	if msg := checkAddress(c.Metrics.Address); msg != "" {
		bad("metrics.address", "%s", msg)
	}
	if msg := checkAddress(c.Health.Address); msg != "" {
		bad("health.address", "%s", msg)
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		bad("log.level", "is %q, want debug, info, warn or error", c.Log.Level)
	}
	if c.Log.Format != "text" && c.Log.Format != "json" {
		bad("log.format", "is %q, want text or json", c.Log.Format)
	}

	st := &c.Standalone
	if len(st.Tokens) == 0 {
		bad("standalone.tokens", "is empty, want at least one token")
	}
	seen := map[string]bool{}
	for i, t := range st.Tokens {
		switch {
		case t == "":
			bad(fmt.Sprintf("standalone.tokens[%d]", i), "is empty")
		case strings.ContainsAny(t, ", \t\r\n"):
			bad(fmt.Sprintf("standalone.tokens[%d]", i), "%q contains a comma or whitespace", t)
		case seen[t]:
			bad(fmt.Sprintf("standalone.tokens[%d]", i), "%q is listed twice", t)
		}
		seen[t] = true
	}
	if st.GPUs < 1 || st.GPUs > 64 {
		bad("standalone.gpus", "is %d, want 1 to 64", st.GPUs)
	}
	if st.PoolBytes <= 0 {
		bad("standalone.poolBytes", "is %s, want a positive size such as 512Mi", st.PoolBytes)
	}
	return errors.Join(errs...)
}

// CheckDirs refuses a state directory (which holds every allocation token)
// that is the socket directory (which pods mount), inside it, or holds it:
// either way a pod, or whoever can write the socket directory, would reach
// the tokens, or the agent's checkpoint writes would land where pods look.
// Both paths must be absolute; they are compared cleaned, without following
// symbolic links.
func CheckDirs(socketDir, stateDir string) error {
	sock, state := filepath.Clean(socketDir), filepath.Clean(stateDir)
	within := func(dir, parent string) bool {
		rel, err := filepath.Rel(parent, dir)
		return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
	}
	switch {
	case sock == state:
		return fmt.Errorf("%q is also the socket directory; the tokens must not be where pods mount", stateDir)
	case within(state, sock):
		return fmt.Errorf("%q is inside the socket directory %q, which pods mount: they would read every allocation token", stateDir, socketDir)
	case within(sock, state):
		return fmt.Errorf("%q contains the socket directory %q; keep them apart (pods mount the socket directory)", stateDir, socketDir)
	}
	return nil
}

func checkAddress(addr string) string {
	if addr == "" {
		return ""
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Sprintf("%q is not host:port (e.g. :9464)", addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return fmt.Sprintf("%q: port %q is not a number from 0 to 65535", addr, port)
	}
	return ""
}
