package main

import (
	"bytes"
	"strings"
	"testing"
)

// Whatever GET /status returns, `agent status` either rejects it with an
// error or prints a table; it never panics, and every table line is one line.
func FuzzStatusReport(f *testing.F) {
	f.Add([]byte(`{"node":"n","mode":"standalone","ready":true,"gpus":[{"gpu":0,"numa":0,"readyBytes":268435456,"chunks":{"free":4}}],"sessions":[],"errors":[]}`))
	f.Add([]byte(`{"gpus":[{"gpu":-3,"numa":-9,"targetBytes":-1,"usedBytes":9223372036854775807}],"errors":[{"message":"a\nb","kind":""}]}`))
	f.Add([]byte(`{"started":"2026-11-29T08:00:00Z","time":"2001-01-01T00:00:00Z"}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		rep, err := decodeReport(body)
		if err != nil {
			return
		}
		var out bytes.Buffer
		if err := printStatus(&out, rep); err != nil {
			t.Fatalf("print: %v", err)
		}
		for _, e := range rep.Errors {
			if strings.Contains(oneLine(e.Message), "\n") {
				t.Fatalf("error message kept a newline: %q", e.Message)
			}
		}
	})
}
