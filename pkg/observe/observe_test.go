package observe

import (
	"errors"
	"testing"
)

func TestMulti(t *testing.T) {
	var a, b Recorder
	if Multi() != Nop || Multi(nil, nil) != Nop {
		t.Error("Multi of nothing is not Nop")
	}
	if Multi(nil, &a) != Observer(&a) {
		t.Error("Multi of one observer does not return it")
	}
	m := Multi(&a, nil, &b)
	ops := []Op{{Name: OpOffload, GPU: 1, Pages: 3}, {Name: OpReload, Err: errors.New("x")}}
	for _, op := range ops {
		m.Op(op)
	}
	for _, r := range []*Recorder{&a, &b} {
		got := r.Ops()
		if len(got) != 2 || got[0].Pages != 3 || got[1].Err == nil {
			t.Errorf("recorded %+v", got)
		}
	}
	var n int
	Func(func(Op) { n++ }).Op(Op{})
	Nop.Op(Op{})
	if n != 1 {
		t.Errorf("Func called %d times", n)
	}
}
