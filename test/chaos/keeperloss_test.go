package chaos

import (
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvpool/kvpool/internal/keeper"
	"github.com/kvpool/kvpool/internal/logging"
)

// TestKeeperLossChaos takes the keeper away under the verifying clients,
// the three ways it goes: SIGKILL and SIGTERM (a new keeper process is
// started on the same socket, as the keeper's DaemonSet does), and SIGSTOP
// for longer than the agent's deadline on keeper calls (then SIGCONT). The
// agent must see each loss, stay up, connect to the keeper that answers
// next and hand it the whole pool; after every other round the agent is
// killed too, and the next one must adopt the whole pool from the new
// keeper. The clients end with nothing lost or corrupt and one session
// each: a keeper's loss loses nothing while the agent lives, and the agent
// acknowledges nothing it could not keep meanwhile (changes are refused,
// "retry", until a keeper holds the pool).
//
// KVPOOL_CHAOS_KEEPER_ROUNDS sets the rounds (default 6, two of each).
func TestKeeperLossChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test: skipped with -short")
	}
	rounds := envInt(t, "KVPOOL_CHAOS_KEEPER_ROUNDS", 6)
	agentBin, clientBin, keeperSock, agentSock, args := setup(t)
	startKeeper := func() *exec.Cmd {
		kp, _ := startKeeperProc(t, agentBin, keeperSock)
		return kp
	}
	kp := startKeeper()
	defer func() { kp.Process.Signal(syscall.SIGCONT); kp.Process.Signal(syscall.SIGTERM); kp.Wait() }()
	startAgent := func() *agentProc {
		a := &agentProc{cmd: exec.Command(agentBin, args...), log: &logging.SyncBuffer{}}
		a.cmd.Stderr = a.log
		if err := a.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		waitFor(t, func() bool { return hello(agentSock) == nil })
		return a
	}
	ag := startAgent()
	exited := make(chan struct{}) // closed when ag exits (watch waits for it)
	watch := func(a *agentProc) {
		done := exited
		go func() { a.cmd.Wait(); close(done) }()
	}
	watch(ag)
	defer func() { ag.cmd.Process.Kill(); <-exited }()
	clients := startClients(t, clientBin, agentSock)
	defer stopClients(clients)

	lostRE := regexp.MustCompile(`msg="keeper lost`)
	backRE := regexp.MustCompile(`msg="keeper reconnected`)
	count := func(re *regexp.Regexp) int { return len(re.FindAllIndex(ag.log.Bytes(), -1)) }
	wait := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			select {
			case <-exited:
				t.Fatalf("%s: the agent exited: %v\n%s", what, ag.cmd.ProcessState, ag.log)
			case <-time.After(10 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 30s\n%s", what, ag.log)
			}
		}
	}
	actions := []string{"SIGKILL", "SIGTERM", "SIGSTOP"}
	for round := range rounds {
		time.Sleep(time.Duration(200+100*(round%5)) * time.Millisecond) // the clients at work
		action := actions[round%len(actions)]
		lost, back := count(lostRE), count(backRE)
		start := time.Now()
		switch action {
		case "SIGKILL", "SIGTERM":
			sig := syscall.SIGKILL
			if action == "SIGTERM" {
				sig = syscall.SIGTERM
			}
			kp.Process.Signal(sig)
			kp.Wait()
			wait("the loss seen", func() bool { return count(lostRE) > lost })
			seen := time.Since(start)
			kp = startKeeper()
			wait("a new keeper takes the pool", func() bool { return count(backRE) > back })
			t.Logf("round %d, keeper %s: loss seen after %v, a new keeper held the pool %v after the signal",
				round, action, seen.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		case "SIGSTOP":
			kp.Process.Signal(syscall.SIGSTOP)
			wait("the stall seen", func() bool { return count(lostRE) > lost })
			seen := time.Since(start)
			kp.Process.Signal(syscall.SIGCONT)
			wait("the keeper takes the pool again", func() bool { return count(backRE) > back })
			t.Logf("round %d, keeper SIGSTOP: loss seen after %v (deadline %v), held again %v after SIGCONT",
				round, seen.Round(time.Millisecond), keeper.CallTimeout, (time.Since(start) - seen).Round(time.Millisecond))
		}
		if st, err := keeper.Query(keeperSock); err != nil || st.Chunks != chunks || !st.Agent || !st.Books {
			t.Fatalf("round %d: the keeper holds %+v (%v), want %d chunks, the books and the agent", round, st, err, chunks)
		}
		if round%2 == 1 {
			// The agent's own restart now: the new keeper must hold it all.
			ag.cmd.Process.Kill()
			<-exited
			exited = make(chan struct{})
			ag = startAgent()
			watch(ag)
			waitFor(t, func() bool {
				return regexp.MustCompile(`pool adopted from the keeper" chunks=` + strconv.Itoa(chunks)).Match(ag.log.Bytes())
			})
			if strings.Contains(ag.log.String(), "the keeper lost the pool") {
				t.Fatalf("round %d: the agent after a kept pool says it was lost:\n%s", round, ag.log)
			}
		}
	}
	time.Sleep(300 * time.Millisecond)
	total := finishClients(t, clients)
	t.Logf("streams: %d offloaded, %d reloaded and verified, %d verified at the end; the longest call %.3fs",
		total.Offloads, total.Reloads, total.Final, total.LongestCall)
	if total.Offloads == 0 || total.Reloads == 0 {
		t.Errorf("too little work to mean anything: %d offloads, %d reloads", total.Offloads, total.Reloads)
	}
}
