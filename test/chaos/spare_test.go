package chaos

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
	"github.com/kvpool/kvpool/internal/supervise"
)

// TestSpareRestartChaos kills the serving agent under the verifying
// clients as the chart runs it: under the agent's own supervisor
// (restartInPlace), which keeps a spare agent process that reads the books
// ahead while it waits. Each SIGKILL of the serving child wakes the spare,
// whose restore takes over what it read (all of it, or a read the turn
// halted part way) and replays the rest. The clients must end with nothing
// lost or corrupt and one session each, every restart must adopt the whole
// pool and log no error, and most restarts must have read the books ahead
// (else the test tests another path).
//
// KVPOOL_CHAOS_SPARE_KILLS sets the SIGKILLs (default 40); the agent's time
// up between two is KVPOOL_CHAOS_MAX_UP_MS, as in TestAgentRestartChaos.
func TestSpareRestartChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test: skipped with -short")
	}
	kills := envInt(t, "KVPOOL_CHAOS_SPARE_KILLS", 40)
	maxUp := time.Duration(envInt(t, "KVPOOL_CHAOS_MAX_UP_MS", 400)) * time.Millisecond
	agentBin, clientBin, keeperSock, agentSock, args := setup(t)
	kp, keeperLog := startKeeperProc(t, agentBin, keeperSock)
	defer func() { kp.Process.Signal(syscall.SIGTERM); kp.Wait() }()

	// The spare starts 50 ms after each restart: mostly it has read the
	// books by the next kill, now and then it is still reading.
	// The most restarts in a window the supervisor takes, in a window
	// that holds far fewer kills than that.
	args = append(args, "--restart-in-place-max", strconv.Itoa(supervise.MaxRestarts), "--restart-in-place-window", "10s",
		"--restart-in-place-spare=true", "--restart-in-place-spare-after", "50ms")
	sup := &agentProc{cmd: exec.Command(agentBin, args...), log: &logging.SyncBuffer{}}
	sup.cmd.Stderr = sup.log
	if err := sup.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { sup.cmd.Process.Signal(syscall.SIGTERM); sup.cmd.Wait() }()
	waitForAgent(t, sup, 0, 0, func() bool { return hello(agentSock) == nil })
	clients := startClients(t, clientBin, agentSock)
	defer stopClients(clients)

	servingRE := regexp.MustCompile(`msg="kvpool agent serving".* pid=(\d+)`)
	serving := func() []string {
		var pids []string
		for _, m := range servingRE.FindAllSubmatch(sup.log.Bytes(), -1) {
			pids = append(pids, string(m[1]))
		}
		return pids
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	var gaps []time.Duration
	t.Logf("%d SIGKILLs of the serving agent, up for up to %v between them, a spare started 50ms after each restart", kills, maxUp)
	for i := range kills {
		deadline := time.Now().Add(time.Duration(rng.Int64N(int64(maxUp))))
		for time.Now().Before(deadline) {
			time.Sleep(min(20*time.Millisecond, time.Until(deadline)))
			// Pinned memory is never allocated twice.
			if st, err := keeper.Query(keeperSock); err != nil || st.Chunks != chunks {
				t.Fatalf("kill %d: the keeper: %+v, %v; want %d chunks", i, st, err, chunks)
			}
		}
		before := serving()
		pid, _ := strconv.Atoi(before[len(before)-1])
		killed := time.Now()
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill %d: the serving agent %d: %v", i, pid, err)
		}
		waitForAgent(t, sup, i, syscall.SIGKILL, func() bool { return len(serving()) > len(before) && hello(agentSock) == nil })
		gaps = append(gaps, time.Since(killed))
	}
	slices.Sort(gaps)
	t.Logf("gap from kill to serving (harness): p50 %v, p99 %v, max %v over %d restarts", pct(gaps, 50), pct(gaps, 99), gaps[len(gaps)-1], len(gaps))
	time.Sleep(300 * time.Millisecond)
	total := finishClients(t, clients)
	if total.Offloads < kills || total.Reloads == 0 {
		t.Errorf("too little work to mean anything: %d offloads, %d reloads", total.Offloads, total.Reloads)
	}

	adoptRE := regexp.MustCompile(`msg="pool adopted from the keeper" chunks=(\d+) .* readAhead=(true|false) replayed=(\S+)`)
	adopted := adoptRE.FindAllSubmatch(sup.log.Bytes(), -1)
	ahead := 0
	for i, m := range adopted {
		if string(m[1]) != strconv.Itoa(chunks) {
			t.Errorf("restart %d adopted %s chunks, want %d", i, m[1], chunks)
		}
		if string(m[2]) == "true" {
			ahead++
		}
	}
	wokeRE := regexp.MustCompile(`msg="agent ended abnormally; restarting it in place".* spare=true`)
	woke := len(wokeRE.FindAll(sup.log.Bytes(), -1))
	t.Logf("%d restarts: %d woke a spare, %d restores finished the books the spare read ahead", len(adopted), woke, ahead)
	if whole := wholeReplays(sup.log.Bytes()); len(whole) > 0 {
		t.Logf("restores that replayed the books whole, by why: %v", whole)
	}
	t.Log(restoreMedians(sup.log.Bytes()))
	if len(adopted) != kills {
		t.Errorf("%d restores logged for %d kills", len(adopted), kills)
	}
	if ahead < kills/2 {
		t.Errorf("only %d of %d restarts finished books read ahead: the test does not test the spare's path", ahead, kills)
	}
	for _, log := range []*logging.SyncBuffer{sup.log, keeperLog} {
		if regexp.MustCompile(`level=ERROR`).Match(log.Bytes()) {
			t.Errorf("an error was logged:\n%s", log)
		}
	}
}

// wholeReplays counts the restores of an agent log that replayed the books
// whole, by the reason logged (its figures blanked, so that alike reasons
// count together).
func wholeReplays(log []byte) map[string]int {
	re := regexp.MustCompile(`msg="(the spare did not read the books ahead|the spare's read ahead does not finish)[^"]*" err="?([^"\n]*)`)
	digits := regexp.MustCompile(`[0-9][0-9.]*(ms|µs|s)?`)
	n := map[string]int{}
	for _, m := range re.FindAllSubmatch(log, -1) {
		n[digits.ReplaceAllString(string(m[2]), "N")]++
	}
	return n
}

// restoreMedians says where the restores of an agent log spent their time:
// each logged step's median, for the restores that finished books read
// ahead and for those that replayed them whole.
func restoreMedians(log []byte) string {
	steps := []string{"spare", "warm", "load", "adopt", "rebuild", "books"}
	stepRE := regexp.MustCompile(` (` + strings.Join(steps, "|") + `)=(\S+)`)
	byAhead := map[string]map[string][]time.Duration{}
	for _, line := range regexp.MustCompile(`msg="pool adopted from the keeper".*`).FindAll(log, -1) {
		ahead := "read ahead"
		if !bytes.Contains(line, []byte("readAhead=true")) {
			ahead = "replayed whole"
		}
		if byAhead[ahead] == nil {
			byAhead[ahead] = map[string][]time.Duration{}
		}
		for _, m := range stepRE.FindAllSubmatch(line, -1) {
			if d, err := time.ParseDuration(string(m[2])); err == nil {
				byAhead[ahead][string(m[1])] = append(byAhead[ahead][string(m[1])], d)
			}
		}
	}
	var gaps []time.Duration
	for _, m := range regexp.MustCompile(`msg="serving again after a restart" gap=(\S+)`).FindAllSubmatch(log, -1) {
		if d, err := time.ParseDuration(string(m[1])); err == nil {
			gaps = append(gaps, d)
		}
	}
	var b strings.Builder
	if len(gaps) > 0 {
		slices.Sort(gaps)
		fmt.Fprintf(&b, "the agents' own gap (last sign of life to serving) p50 %v over %d; ", pct(gaps, 50), len(gaps))
	}
	b.WriteString("restore steps, median:")
	for _, ahead := range []string{"read ahead", "replayed whole"} {
		if byAhead[ahead] == nil {
			continue
		}
		fmt.Fprintf(&b, " %s (%d):", ahead, len(byAhead[ahead]["load"]))
		for _, st := range steps {
			if d := byAhead[ahead][st]; len(d) > 0 {
				slices.Sort(d)
				fmt.Fprintf(&b, " %s %v", st, pct(d, 50).Round(10*time.Microsecond))
			}
		}
		b.WriteString(";")
	}
	return b.String()
}
