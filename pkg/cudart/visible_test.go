package cudart

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestVisibleDevices(t *testing.T) {
	const a, b, c = "GPU-5f3c0000-1111-2222-3333-444444444444", "GPU-5f3d0000-1111-2222-3333-444444444444", "MIG-aa000000-1111-2222-3333-444444444444"
	abc := a + "," + b + "," + c
	cases := []struct {
		nvidia, cuda string
		want         []string
		err          string
	}{
		{a, "", []string{a}, ""},
		{abc, "", []string{a, b, c}, ""},
		{" " + a + " , " + b + " ", "", []string{a, b}, ""},
		{abc, "2,0", []string{c, a}, ""},
		{abc, "1", []string{b}, ""},
		{abc, "GPU-5f3d", []string{b}, ""},
		{abc, "gpu-5F3C,mig-aa", []string{a, c}, ""},
		{abc, "GPU-5f3", nil, ""}, // ambiguous prefix ends the list at once
		{abc, "0,7,1", []string{a}, ""},
		{abc, "-1,0", nil, ""},
		{abc, "0,GPU-5f3c", nil, "twice"},
		{"3,5", "1", []string{"5"}, ""}, // deviceIDStrategy=index
		{"none", "", nil, ""},
		{"void", "0", nil, ""},
		{"", "", nil, "lists no visible GPUs"},
		{"all", "0", nil, "lists no visible GPUs"},
		{a + ",,", "", nil, "empty entry"},
		{a + "," + strings.ToUpper(a), "", nil, "twice"},
	}
	for _, tc := range cases {
		got, err := VisibleDevices(tc.nvidia, tc.cuda)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("VisibleDevices(%q, %q) = %v, %v; want an error with %q", tc.nvidia, tc.cuda, got, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) || got == nil {
			t.Errorf("VisibleDevices(%q, %q) = %#v, %v; want %#v", tc.nvidia, tc.cuda, got, err, tc.want)
		}
	}
	if _, err := VisibleDevices("all", ""); !errors.Is(err, ErrNoVisibleList) {
		t.Errorf("all: %v is not ErrNoVisibleList", err)
	}
}

// FuzzVisibleDevices: any environment gives a list of distinct entries of
// the NVIDIA list, or an error; never a panic.
func FuzzVisibleDevices(f *testing.F) {
	f.Add("GPU-a,GPU-b,MIG-c", "1,GPU-a")
	f.Add("0,1,2", "2,1,0")
	f.Add("none", "")
	f.Fuzz(func(t *testing.T, nvidia, cuda string) {
		got, err := VisibleDevices(nvidia, cuda)
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, d := range got {
			if strings.TrimSpace(d) != d || d == "" || seen[strings.ToLower(d)] {
				t.Fatalf("VisibleDevices(%q, %q) = %q", nvidia, cuda, got)
			}
			seen[strings.ToLower(d)] = true
		}
	})
}
