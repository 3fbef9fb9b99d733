package client_test

import (
	"errors"
	"testing"

	"github.com/kvpool/kvpool/pkg/client"
	"github.com/kvpool/kvpool/pkg/wire"
)

// A refusal is the pool error its status means (wire.ErrorOf, the one
// table the agent's wire.StatusOf reads the other way), and has the
// status's kind, the agent's word for it; a status of a newer agent says
// that it is unknown.
func TestErrorIsItsStatusError(t *testing.T) {
	for _, st := range wire.Statuses() {
		e := &client.Error{Op: wire.OpOffload, Status: st, Message: "m"}
		if pe := wire.ErrorOf(st); pe != nil && (!errors.Is(e, pe) || wire.StatusOf(e) != st) {
			t.Errorf("%s: errors.Is(%v) %v, StatusOf %s", st, pe, errors.Is(e, pe), wire.StatusOf(e))
		}
		if e.Kind() != st.Kind() {
			t.Errorf("%s: kind %q", st, e.Kind())
		}
	}
	e := &client.Error{Op: wire.OpOffload, Status: 29, Message: "m"}
	if !errors.Is(e, wire.ErrUnknownStatus) {
		t.Errorf("status 29: %v does not say the status is unknown", e)
	}
}
