package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// gapSteps is where one restart's gap went, in ms: from the SIGKILL until
// the killed agent was reaped and the new one started (Exit); the new
// process until its first log line (Start: exec, Go's initialisation of
// the binary's packages, flags and configuration); the restore's steps as
// the agent logged them (Spare, the wait for a spare's hand-over, zero in
// the logs of agents older than it; Warm, Load, Adopt, Rebuild, Books); the rest of
// its start-up until it logged that it serves again (Other: the node
// step, the keeper's connection, the observability and socket steps); and
// from then until the probe's call succeeded (After: the poll's last ms,
// the client's reconnection, the call). They add up to the gap; those read
// off the log's timestamps are good to its millisecond.
type gapSteps struct {
	Exit    float64 `json:"exit_ms"`
	Start   float64 `json:"process_start_ms"`
	Spare   float64 `json:"spare_ms,omitempty"`
	Warm    float64 `json:"warm_ms"`
	Load    float64 `json:"load_ms"`
	Adopt   float64 `json:"adopt_ms"`
	Rebuild float64 `json:"rebuild_ms"`
	Books   float64 `json:"books_ms"`
	Other   float64 `json:"other_ms"`
	After   float64 `json:"after_serving_ms"`
	// ReadAhead: the restarted agent was a spare that had read the
	// books ahead, and replayed only what was committed since.
	ReadAhead bool `json:"read_ahead,omitempty"`
}

// total is the steps' sum, the gap they split.
func (s gapSteps) total() float64 {
	return s.Exit + s.Start + s.Spare + s.Warm + s.Load + s.Adopt + s.Rebuild + s.Books + s.Other + s.After
}

// restartTimes are one restart's instants as the probe saw them.
type restartTimes struct {
	kill, exec, ok time.Time
}

// splitGaps reads the agents' start-ups from log (every agent of one
// count, in order: the first one's, then one a restart) and splits each
// restart's gap by it. It returns nil when the log lacks a line it needs
// (agents logging above info).
func splitGaps(log string, times []restartTimes) []gapSteps {
	var configs, adopted, serving []map[string]string
	for _, line := range strings.Split(log, "\n") {
		switch f := logFields(line); {
		case f["msg"] == "configuration" && f["setFrom"] != "":
			configs = append(configs, f)
		case f["msg"] == "pool adopted from the keeper":
			adopted = append(adopted, f)
		case f["msg"] == "serving again after a restart":
			serving = append(serving, f)
		}
	}
	n := len(times)
	if len(configs) != n+1 || len(adopted) != n || len(serving) != n {
		return nil
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
	out := make([]gapSteps, n)
	for i, tm := range times {
		first, err1 := time.Parse(time.RFC3339Nano, configs[i+1]["time"])
		served, err2 := time.Parse(time.RFC3339Nano, serving[i]["time"])
		if err1 != nil || err2 != nil {
			return nil
		}
		s := &out[i]
		for _, st := range []struct {
			key string
			v   *float64
		}{{"warm", &s.Warm}, {"load", &s.Load}, {"adopt", &s.Adopt}, {"rebuild", &s.Rebuild}, {"books", &s.Books}} {
			d, err := time.ParseDuration(adopted[i][st.key])
			if err != nil {
				return nil
			}
			*st.v = ms(d)
		}
		if v, ok := adopted[i]["spare"]; ok {
			d, err := time.ParseDuration(v)
			if err != nil {
				return nil
			}
			s.Spare = ms(d)
		}
		s.ReadAhead = adopted[i]["readAhead"] == "true"
		s.Exit = ms(tm.exec.Sub(tm.kill))
		s.Start = ms(first.Sub(tm.exec))
		s.Other = ms(served.Sub(first)) - s.Spare - s.Warm - s.Load - s.Adopt - s.Rebuild - s.Books
		s.After = ms(tm.ok.Sub(served))
	}
	return out
}

// logFields are the key=value pairs of one line of the agent's text log
// (values quoted where they hold spaces are taken whole).
func logFields(line string) map[string]string {
	out := map[string]string{}
	for line != "" {
		line = strings.TrimLeft(line, " ")
		eq, sp := strings.IndexByte(line, '='), strings.IndexByte(line, ' ')
		if eq < 0 {
			break
		}
		if eq == 0 || sp >= 0 && sp < eq {
			// A word without a key or without a value: not slog's.
			if sp < 0 {
				break
			}
			line = line[sp:]
			continue
		}
		key, rest := line[:eq], line[eq+1:]
		var val string
		if strings.HasPrefix(rest, `"`) {
			end := 1
			for end < len(rest) && (rest[end] != '"' || rest[end-1] == '\\') {
				end++
			}
			val, line = rest[1:min(end, len(rest))], rest[min(end+1, len(rest)):]
		} else {
			sp := strings.IndexByte(rest, ' ')
			if sp < 0 {
				sp = len(rest)
			}
			val, line = rest[:sp], rest[sp:]
		}
		out[key] = val
	}
	return out
}

// printSteps prints where the gaps went, each step's median over a
// count's restarts, for the counts whose agents said.
func printSteps(w io.Writer, rep *restartReport) {
	var rows []restartRow
	for _, c := range rep.Cases {
		if len(c.Steps) > 0 {
			rows = append(rows, c)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "where the gaps went, ms (each step's median over the restarts): the killed agent's exit, the new process until its first log line,")
	fmt.Fprintln(w, "the restore's steps as the agent logged them, the rest of its start-up until it served, and then until the probe's call succeeded")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "streams\tgap p50\texit\tprocess\tspare\twarm\tload\tadopt\trebuild\tbooks\tother\tafter")
	for _, c := range rows {
		step := func(f func(gapSteps) float64) float64 {
			v := make([]float64, len(c.Steps))
			for i, s := range c.Steps {
				v[i] = f(s)
			}
			return median(v)
		}
		fmt.Fprintf(tw, "%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\n", c.Streams, c.GapP50Ms,
			step(func(s gapSteps) float64 { return s.Exit }), step(func(s gapSteps) float64 { return s.Start }),
			step(func(s gapSteps) float64 { return s.Spare }),
			step(func(s gapSteps) float64 { return s.Warm }), step(func(s gapSteps) float64 { return s.Load }),
			step(func(s gapSteps) float64 { return s.Adopt }), step(func(s gapSteps) float64 { return s.Rebuild }),
			step(func(s gapSteps) float64 { return s.Books }), step(func(s gapSteps) float64 { return s.Other }),
			step(func(s gapSteps) float64 { return s.After }))
	}
	tw.Flush()
}
