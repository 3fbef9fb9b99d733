package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// gapSteps is where one restart's gap went, in ms: the killed agent's
// exit (Exit), the new process until its main function began (Start:
// exec, the Go runtime's and the packages' initialisation, and the client
// poll's last ms), the restore's steps as the agent logged them (Warm,
// Load, Adopt, Rebuild, Books) and the rest of its start-up until it
// served (Other: flags, configuration, the keeper's connection, the
// socket). They add up to the gap.
type gapSteps struct {
	Exit    float64 `json:"exit_ms"`
	Start   float64 `json:"process_start_ms"`
	Warm    float64 `json:"warm_ms"`
	Load    float64 `json:"load_ms"`
	Adopt   float64 `json:"adopt_ms"`
	Rebuild float64 `json:"rebuild_ms"`
	Books   float64 `json:"books_ms"`
	Other   float64 `json:"other_ms"`
}

// splitGaps reads the restarted agents' start-up from log (every agent of
// one count, in order: the first one's start, then one start a restart)
// and splits each gap by it. It returns nil when the log lacks a line it
// needs (agents logging above info).
func splitGaps(log string, gaps, exits []float64) []gapSteps {
	var adopted, serving []map[string]string
	for _, line := range strings.Split(log, "\n") {
		switch {
		case strings.Contains(line, `msg="pool adopted from the keeper"`):
			adopted = append(adopted, logFields(line))
		case strings.Contains(line, `msg="kvpool agent serving"`):
			serving = append(serving, logFields(line))
		}
	}
	if len(adopted) != len(gaps) || len(serving) != len(gaps)+1 {
		return nil
	}
	ms := func(f map[string]string, key string) (float64, bool) {
		d, err := time.ParseDuration(f[key])
		return float64(d.Microseconds()) / 1e3, err == nil
	}
	out := make([]gapSteps, len(gaps))
	for i := range gaps {
		s := &out[i]
		a := adopted[i]
		var ok [6]bool
		s.Warm, ok[0] = ms(a, "warm")
		s.Load, ok[1] = ms(a, "load")
		s.Adopt, ok[2] = ms(a, "adopt")
		s.Rebuild, ok[3] = ms(a, "rebuild")
		s.Books, ok[4] = ms(a, "books")
		startup, up := ms(serving[i+1], "startup")
		ok[5] = up
		if ok != [6]bool{true, true, true, true, true, true} {
			return nil
		}
		s.Exit = exits[i]
		s.Start = gaps[i] - exits[i] - startup
		s.Other = startup - s.Warm - s.Load - s.Adopt - s.Rebuild - s.Books
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
	fmt.Fprintln(w, "where the gaps went, ms (median of each step over the restarts): the killed agent's exit, the new process until the agent's start-up")
	fmt.Fprintln(w, "began, the restore's steps as the agent logged them, the rest of its start-up until it served")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "streams\tgap p50\texit\tprocess\twarm\tload\tadopt\trebuild\tbooks\tother")
	for _, c := range rows {
		step := func(f func(gapSteps) float64) float64 {
			v := make([]float64, len(c.Steps))
			for i, s := range c.Steps {
				v[i] = f(s)
			}
			return median(v)
		}
		fmt.Fprintf(tw, "%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\n", c.Streams, c.GapP50Ms,
			step(func(s gapSteps) float64 { return s.Exit }), step(func(s gapSteps) float64 { return s.Start }),
			step(func(s gapSteps) float64 { return s.Warm }), step(func(s gapSteps) float64 { return s.Load }),
			step(func(s gapSteps) float64 { return s.Adopt }), step(func(s gapSteps) float64 { return s.Rebuild }),
			step(func(s gapSteps) float64 { return s.Books }), step(func(s gapSteps) float64 { return s.Other }))
	}
	tw.Flush()
}
