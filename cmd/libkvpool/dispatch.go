package main

import (
	"os"
	"sync"
)

// Calls from C run on the caller's thread, on a goroutine locked to it. Each
// time such a goroutine parks (waiting on the socket through the netpoller,
// on a copy stream, on a lock), waking it means handing a P to that one
// thread: two thread switches that an ordinary goroutine does not pay. A
// call may park several times, so by default the work runs on an ordinary
// worker goroutine and the locked one parks once, waiting for it.
// KVPOOL_CABI_DIRECT=1 runs calls on the caller's goroutine instead (for
// measuring the difference).
var direct = os.Getenv("KVPOOL_CABI_DIRECT") == "1"

type job struct {
	fn   func()
	done chan struct{}
}

var (
	jobs     = make(chan *job)
	startJob sync.Once
	jobPool  = sync.Pool{New: func() any { return &job{done: make(chan struct{}, 1)} }}
)

func worker() {
	for j := range jobs {
		j.fn()
		j.done <- struct{}{}
	}
}

// do runs fn to completion, on a worker goroutine unless direct.
func do(fn func()) {
	if direct {
		fn()
		return
	}
	startJob.Do(func() {
		for range 4 {
			go worker()
		}
	})
	j := jobPool.Get().(*job)
	j.fn = fn
	select {
	case jobs <- j:
	default:
		go func() { j.fn(); j.done <- struct{}{} }() // every worker busy
	}
	<-j.done
	j.fn = nil
	jobPool.Put(j)
}
