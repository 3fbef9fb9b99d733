// Package logging sets up the agent's one logger: log/slog with a level and
// text or JSON output, bridged so that client-go (klog) logs through the
// same handler.
package logging

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"k8s.io/klog/v2"
)

// Options configures New and Setup.
type Options struct {
	Level  string    // debug, info, warn or error; "" is info
	Format string    // text or json; "" is text
	Writer io.Writer // default os.Stderr
	// AddSource adds the file and line of the logging call.
	AddSource bool
}

// ParseLevel parses debug, info, warn (or warning) and error, in any case.
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "info":
		return slog.LevelInfo, nil
	case "debug":
		return slog.LevelDebug, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("log level %q: want debug, info, warn or error", s)
}

// New returns a logger for opts and the LevelVar that controls it, so the
// level can change while the agent runs.
func New(opts Options) (*slog.Logger, *slog.LevelVar, error) {
	lvl, err := ParseLevel(opts.Level)
	if err != nil {
		return nil, nil, err
	}
	w := opts.Writer
	if w == nil {
		w = os.Stderr
	}
	level := new(slog.LevelVar)
	level.Set(lvl)
	ho := &slog.HandlerOptions{Level: level, AddSource: opts.AddSource}
	var h slog.Handler
	switch strings.ToLower(opts.Format) {
	case "", "text":
		h = slog.NewTextHandler(w, ho)
	case "json":
		h = slog.NewJSONHandler(w, ho)
	default:
		return nil, nil, fmt.Errorf("log format %q: want text or json", opts.Format)
	}
	return slog.New(h), level, nil
}

// Setup makes the logger for opts the process's only logger: the slog
// default (and so the standard log package) and klog for client-go. Nothing
// changes when opts are invalid.
func Setup(opts Options) (*slog.Logger, *slog.LevelVar, error) {
	l, level, err := New(opts)
	if err != nil {
		return nil, nil, err
	}
	// klog drops V(n) records before they reach the logger unless its own
	// verbosity allows them: let through what the slog level would show
	// (V(n) is slog level -n; debug is -4).
	v := "0"
	if level.Level() <= slog.LevelDebug {
		v = "4"
	}
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	if err := fs.Set("v", v); err != nil {
		return nil, nil, fmt.Errorf("set klog verbosity: %w", err)
	}
	slog.SetDefault(l)
	klog.SetSlogLogger(l)
	return l, level, nil
}

// ListIDs joins at most n of ids with sep, noting how many more there
// are, so that a log line or an event names a small set whole and stays
// short however large the set is.
func ListIDs(ids []string, n int, sep string) string {
	if len(ids) <= n {
		return strings.Join(ids, sep)
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:n], sep), len(ids)-n)
}
