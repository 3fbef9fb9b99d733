package config

import (
	"reflect"
	"testing"

	"github.com/kvpool/kvpool/internal/server"
	"github.com/kvpool/kvpool/pkg/plugin"
)

// The configuration's defaults are the components' own: the limits round
// trip to server.DefaultLimits field for field (a limit added to one and
// not the other fails here), and the plugin's part is what a zero
// plugin.Options takes.
func TestDefaultsAreTheComponents(t *testing.T) {
	d := Default()
	if got := d.Limits.Server(); !reflect.DeepEqual(got, server.DefaultLimits) {
		t.Errorf("Default().Limits.Server() = %+v\nwant server.DefaultLimits %+v", got, server.DefaultLimits)
	}
	if got := limitsOf(d.Limits.Server()); !reflect.DeepEqual(got, d.Limits) {
		t.Errorf("limits do not round trip: %+v, want %+v", got, d.Limits)
	}
	for _, c := range []struct{ name, got, want string }{
		{"socketDir", d.SocketDir, plugin.DefaultSocketDir},
		{"kubeletDir", d.KubeletDir, plugin.DefaultKubeletDir},
		{"stateDir", d.StateDir, plugin.DefaultStateDir},
		{"podLogsDir", d.PodLogsDir, plugin.DefaultPodLogsDir},
		{"reclaim.gracePeriod", d.Reclaim.GracePeriod.String(), plugin.DefaultGracePeriod.String()},
		{"reclaim.interval", d.Reclaim.Interval.String(), plugin.DefaultInterval.String()},
	} {
		if c.got != c.want {
			t.Errorf("%s default %q, the plugin's %q", c.name, c.got, c.want)
		}
	}
	// Every limit is set: no zero field left to the server's fallback.
	v := reflect.ValueOf(d.Limits)
	for i := range v.NumField() {
		if v.Field(i).IsZero() {
			t.Errorf("limits.%s has no default", v.Type().Field(i).Name)
		}
	}
}
