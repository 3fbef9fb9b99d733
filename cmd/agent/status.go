package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvpool/kvpool/internal/bytesize"
	"github.com/kvpool/kvpool/internal/report"
)

// defaultStatusAddr is where `agent status` looks for the agent: its health
// port on the loopback interface (inside the agent's pod, or on a node with
// host networking).
const defaultStatusAddr = "127.0.0.1:8081"

// runStatus prints the local agent's pools, sessions and recent errors.
func runStatus(ctx context.Context, args []string) error {
	return statusCmd(ctx, args, os.Stdout)
}

func statusCmd(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(out, "usage: agent status [--addr host:port] [--json] [--timeout d]\n\n"+
			"Prints the local agent's pools, sessions and recent errors, read from GET /status on its health port.\n\n")
		fs.PrintDefaults()
	}
	addr := fs.String("addr", envOr("KVPOOL_STATUS_ADDR", defaultStatusAddr), "agent health address (host:port or URL); env KVPOOL_STATUS_ADDR")
	asJSON := fs.Bool("json", false, "print the agent's report as JSON")
	timeout := fs.Duration("timeout", 5*time.Second, "give up after this long")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("status: unexpected arguments %q", fs.Args())
	}
	if *timeout <= 0 {
		return fmt.Errorf("status: --timeout must be positive, got %s", *timeout)
	}
	url := *addr
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	url = strings.TrimSuffix(url, "/") + "/status"

	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("status: is the agent running? %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return fmt.Errorf("status: read %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status: GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	rep, err := decodeReport(body)
	if err != nil {
		return fmt.Errorf("status: decode the report from %s: %w", url, err)
	}
	if *asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return printStatus(out, rep)
}

// decodeReport parses a /status body. Unknown fields are ignored, so a newer
// agent's report still prints.
func decodeReport(body []byte) (report.Report, error) {
	var rep report.Report
	if err := json.Unmarshal(body, &rep); err != nil {
		return report.Report{}, err
	}
	return rep, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// printStatus writes the report as tables: the agent, its GPUs, its
// sessions, the claims it serves and its recent errors.
func printStatus(out io.Writer, r report.Report) error {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	printAgent(tw, r)
	printGPUs(tw, r)
	printSessions(tw, r)
	printClaims(tw, r)
	printErrors(tw, r)
	return tw.Flush()
}

func printAgent(tw io.Writer, r report.Report) {
	ready := "yes"
	if !r.Ready {
		ready = "no: " + r.Health
	}
	up := "-"
	if !r.Started.IsZero() {
		up = r.Time.Sub(r.Started).Round(time.Second).String()
	}
	mode := dash(r.Mode)
	if r.Door != "" {
		mode += " (" + r.Door + ")"
	}
	fmt.Fprintf(tw, "Node:\t%s\nMode:\t%s\nVersion:\t%s\nUp:\t%s\nReady:\t%s\n", dash(r.Node), mode, dash(r.Version), up, ready)
	if rs := r.Restart; rs != nil {
		fmt.Fprintf(tw, "Restart:\t%d chunks adopted from the keeper, %d fresh, %d locked by the keeper; %d sessions and %d streams restored; gap %s\n",
			rs.AdoptedChunks, rs.FreshChunks, rs.KeeperLockedChunks, rs.Sessions, rs.Streams, time.Duration(rs.LastGapSeconds*float64(time.Second)).Round(time.Millisecond))
		if s := rs.Restore; s != nil {
			ms := func(sec float64) time.Duration {
				return time.Duration(sec * float64(time.Second)).Round(100 * time.Microsecond)
			}
			warm := "heap not warmed"
			if s.WarmBytes > 0 {
				warm = fmt.Sprintf("heap warmed %s (%s)", ms(s.WarmSeconds), bytesize.Exact(s.WarmBytes))
			}
			load := fmt.Sprintf("books replayed %s", ms(s.LoadSeconds))
			if s.ReadAhead {
				load = fmt.Sprintf("books read ahead by the spare (handed over %s into the restore), their last %s replayed %s",
					ms(s.SpareSeconds), bytesize.Exact(s.ReplayedBytes), ms(s.LoadSeconds))
			}
			fmt.Fprintf(tw, "Restore:\t%s, %s, chunks adopted %s, pool rebuilt %s, fresh books waited for %s\n",
				warm, load, ms(s.AdoptSeconds), ms(s.RebuildSeconds), ms(s.BooksSeconds))
		}
	}
}

func printGPUs(tw io.Writer, r report.Report) {
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "GPU\tNUMA\tTARGET\tREADY\tALLOCATED\tUSED\tCHUNKS FREE/GRANTED/DIRTY\tSESSIONS\tSTREAMS\tPAGES USED/PENDING/TOTAL")
	row := func(name, numa string, g report.GPU) {
		target := "-"
		if g.TargetBytes > 0 {
			target = bytesize.Exact(g.TargetBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d/%d/%d\t%d\t%d\t%d/%d/%d\n", name, numa, target,
			bytesize.Exact(g.ReadyBytes), bytesize.Exact(g.AllocatedBytes), bytesize.Exact(g.UsedBytes),
			g.Chunks.Free, g.Chunks.Granted, g.Chunks.Dirty, g.Sessions, g.Streams, g.PagesUsed, g.PagesPending, g.PagesTotal)
	}
	for _, g := range r.GPUs {
		row(fmt.Sprint(g.Index), numaName(g.NUMA), g)
	}
	if len(r.GPUs) > 1 {
		row("all", "", r.Totals())
	}
}

// numaName is a NUMA node as the tables show it: X when unknown.
func numaName(n int) string {
	if n < 0 {
		return "X"
	}
	return fmt.Sprint(n)
}

func printSessions(tw io.Writer, r report.Report) {
	fmt.Fprintln(tw)
	if len(r.Sessions) == 0 {
		fmt.Fprintln(tw, "Sessions: none")
		return
	}
	fmt.Fprintln(tw, "ALLOCATION\tGPU\tNUMA\tCHUNKS LOCAL/REMOTE/UNKNOWN\tPAGE SIZE\tPAGES\tUSED\tPENDING\tSTREAMS\tREQUESTS")
	for _, s := range r.Sessions {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d/%d/%d\t%s\t%d\t%d\t%d\t%d\t%d\n", s.Allocation, s.GPU, numaName(s.GPUNUMA),
			s.Local, s.Remote, s.UnknownNUMA, bytesize.Exact(s.PageSize), s.Pages, s.Used, s.Pending, s.Streams, s.Requests)
	}
}

func printClaims(tw io.Writer, r report.Report) {
	if len(r.Claims) == 0 {
		return
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "CLAIM\tREQUEST\tALLOCATION\tCHUNKS\tBYTES")
	for _, c := range r.Claims {
		for _, q := range c.Requests {
			fmt.Fprintf(tw, "%s/%s\t%s\t%s\t%d\t%s\n", c.Namespace, c.Name, q.Name, q.Allocation, len(q.Chunks), bytesize.Exact(q.Bytes))
		}
	}
}

func printErrors(tw io.Writer, r report.Report) {
	fmt.Fprintln(tw)
	if len(r.Errors) == 0 {
		fmt.Fprintln(tw, "Recent errors: none")
		return
	}
	fmt.Fprintf(tw, "Recent errors (last %d of %d):\n", len(r.Errors), r.ErrorsTotal)
	fmt.Fprintln(tw, "TIME\tCOMPONENT\tOP\tKIND\tSESSION\tALLOCATION\tMESSAGE")
	for i := len(r.Errors) - 1; i >= 0; i-- { // newest first
		e := r.Errors[i]
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Time.UTC().Format(time.RFC3339), e.Component, dash(e.Op), e.Kind,
			dash(e.Session), dash(e.Allocation), oneLine(e.Message))
	}
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}
