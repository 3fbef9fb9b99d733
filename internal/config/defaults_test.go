package config

import (
	"reflect"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
)

// The configuration's limits are the server's own defaults: they round
// trip to server.DefaultLimits field for field (a limit added to one and
// not the other fails here).
func TestDefaultLimitsAreTheServers(t *testing.T) {
	d := Default()
	if got := d.Limits.Server(); !reflect.DeepEqual(got, server.DefaultLimits) {
		t.Errorf("Default().Limits.Server() = %+v\nwant server.DefaultLimits %+v", got, server.DefaultLimits)
	}
	if got := limitsOf(d.Limits.Server()); !reflect.DeepEqual(got, d.Limits) {
		t.Errorf("limits do not round trip: %+v, want %+v", got, d.Limits)
	}
	// Every limit is set: no zero field left to the server's fallback.
	// MaxPages is the pool's, not the server's: its zero is the pool's
	// default, derived from the pool's bytes (pool.DefaultMaxPages).
	v := reflect.ValueOf(d.Limits)
	for i := range v.NumField() {
		if v.Type().Field(i).Name == "MaxPages" {
			continue
		}
		if v.Field(i).IsZero() {
			t.Errorf("limits.%s has no default", v.Type().Field(i).Name)
		}
	}
}
