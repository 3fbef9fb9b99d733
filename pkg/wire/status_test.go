package wire

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"strings"
	"testing"

	"github.com/kvpool/kvpool/pkg/poolerr"
)

// poolErrors names every error of pkg/poolerr. TestEveryPoolErrorRoundTrips
// reads poolerr.go and fails when an error is missing here, so a new one
// is given a status (or a reason it has none) when it is added.
var poolErrors = map[string]error{
	"ErrFull": poolerr.ErrFull, "ErrPending": poolerr.ErrPending, "ErrNoPages": poolerr.ErrNoPages,
	"ErrUnknownStream": poolerr.ErrUnknownStream, "ErrDuplicateStream": poolerr.ErrDuplicateStream,
	"ErrPageCount": poolerr.ErrPageCount, "ErrBadSize": poolerr.ErrBadSize, "ErrOutOfRange": poolerr.ErrOutOfRange,
	"ErrDuplicateIndex": poolerr.ErrDuplicateIndex, "ErrBadFence": poolerr.ErrBadFence, "ErrClosed": poolerr.ErrClosed,
	"ErrBadName": poolerr.ErrBadName, "ErrUnknownChunk": poolerr.ErrUnknownChunk, "ErrDuplicateChunk": poolerr.ErrDuplicateChunk,
	"ErrChunkBusy": poolerr.ErrChunkBusy, "ErrChunkDirty": poolerr.ErrChunkDirty,
	"ErrUnknownAllocation": poolerr.ErrUnknownAllocation, "ErrAllocationExists": poolerr.ErrAllocationExists,
	"ErrNoCapacity": poolerr.ErrNoCapacity, "ErrNoGPUChunks": poolerr.ErrNoGPUChunks,
	"ErrUnknownGPU": poolerr.ErrUnknownGPU, "ErrNotReady": poolerr.ErrNotReady,
}

// offWire names the pool errors no client meets as a refusal, and why:
// they have no status, and StatusOf calls them internal.
var offWire = map[string]string{
	"ErrFull":             "an offload answered ok=false",
	"ErrNoPages":          "an offload answered ok=false",
	"ErrUnknownChunk":     "the device plugin's and the agent's chunk bookkeeping",
	"ErrDuplicateChunk":   "the device plugin's and the agent's chunk bookkeeping",
	"ErrChunkBusy":        "the device plugin's and the agent's chunk bookkeeping",
	"ErrChunkDirty":       "the device plugin's and the agent's chunk bookkeeping",
	"ErrAllocationExists": "the device plugin's grants",
}

// declaredPoolErrors returns the names of the package-level Err* variables
// of pkg/poolerr, from its source.
func declaredPoolErrors(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "../poolerr/poolerr.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.VAR {
			continue
		}
		for _, sp := range g.Specs {
			for _, n := range sp.(*ast.ValueSpec).Names {
				if strings.HasPrefix(n.Name, "Err") {
					names = append(names, n.Name)
				}
			}
		}
	}
	if len(names) < 20 {
		t.Fatalf("found only %d errors in poolerr.go: %v", len(names), names)
	}
	return names
}

// Every pool error a client can meet goes to its status and back to the
// same error, wrapped or not; the others are internal; no two share a
// status.
func TestEveryPoolErrorRoundTrips(t *testing.T) {
	seen := map[Status]string{}
	for _, name := range declaredPoolErrors(t) {
		e, ok := poolErrors[name]
		if !ok {
			t.Errorf("poolerr.%s is not in this test's list: give it a status in statusTable or a reason in offWire", name)
			continue
		}
		st := StatusOf(e)
		if why, off := offWire[name]; off {
			if st != StatusInternal {
				t.Errorf("poolerr.%s (%s) has status %s", name, why, st)
			}
			continue
		}
		if st == StatusInternal || st == StatusOK {
			t.Errorf("poolerr.%s has no status", name)
			continue
		}
		if prev, dup := seen[st]; dup {
			t.Errorf("poolerr.%s and poolerr.%s share status %s", prev, name, st)
		}
		seen[st] = name
		if got := ErrorOf(st); got != e {
			t.Errorf("poolerr.%s -> %s -> %v", name, st, got)
		}
		if got := StatusOf(fmt.Errorf("offload %q: %w", "r", e)); got != st {
			t.Errorf("wrapped poolerr.%s -> %s, want %s", name, got, st)
		}
	}
}

// Every status maps to its error and back; statuses of no pool error give
// nil; StatusOf of nil is ok and of a foreign error internal.
func TestStatusErrorTable(t *testing.T) {
	for _, st := range Statuses() {
		e := ErrorOf(st)
		if e == nil {
			continue
		}
		if got := StatusOf(e); got != st {
			t.Errorf("%s -> %v -> %s", st, e, got)
		}
	}
	for _, st := range []Status{StatusOK, StatusBadRequest, StatusUnknownOp, StatusVersion, StatusNoSession,
		StatusBusy, StatusUnexpectedFDs, StatusInternal, StatusLimit} {
		if e := ErrorOf(st); e != nil {
			t.Errorf("%s means %v, want no pool error", st, e)
		}
	}
	if st := StatusOf(nil); st != StatusOK {
		t.Errorf("StatusOf(nil) = %s", st)
	}
	if st := StatusOf(errors.New("disk on fire")); st != StatusInternal {
		t.Errorf("StatusOf(foreign error) = %s", st)
	}
	// A pool error joined after a foreign one is still found.
	if st := StatusOf(errors.Join(errors.New("x"), poolerr.ErrBadFence)); st != StatusBadFence {
		t.Errorf("joined: %s", st)
	}
}

// A code this version does not know (a newer agent's, or a gap in the
// table) gets an error that says so and names the code.
func TestUnknownStatusError(t *testing.T) {
	for _, st := range []Status{22, 24, 27, 29, 255} {
		e := ErrorOf(st)
		if !errors.Is(e, ErrUnknownStatus) || !strings.Contains(e.Error(), fmt.Sprint(uint8(st))) {
			t.Errorf("status %d: %v", st, e)
		}
		if StatusOf(e) != StatusInternal {
			t.Errorf("status %d: its error has status %s", st, StatusOf(e))
		}
	}
}
