package server

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// rateLog logs through a token bucket per key, so that a tenant that
// provokes the same refusal thousands of times a second costs a few lines a
// second, not a line per attempt. The first line after a quiet spell says
// how many were suppressed.
type rateLog struct {
	log   *slog.Logger
	burst float64
	rate  float64 // tokens per second
	now   func() time.Time

	mu      sync.Mutex
	buckets map[string]*bucket
}

type bucket struct {
	tokens     float64
	last       time.Time
	suppressed int
}

// maxBuckets bounds the keys a rateLog remembers; the keys are the
// server's own refusal reasons, a fixed handful.
const maxBuckets = 64

func newRateLog(log *slog.Logger, burst int, perSecond float64) *rateLog {
	return &rateLog{log: log, burst: float64(burst), rate: perSecond, now: time.Now, buckets: map[string]*bucket{}}
}

// allow takes a token of key's bucket. It returns whether to log and how
// many lines were suppressed since the last one logged.
func (r *rateLog) allow(key string) (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	b := r.buckets[key]
	if b == nil {
		if len(r.buckets) >= maxBuckets {
			key = "other"
			if b = r.buckets[key]; b == nil {
				b = &bucket{tokens: r.burst, last: now}
				r.buckets[key] = b
			}
		} else {
			b = &bucket{tokens: r.burst, last: now}
			r.buckets[key] = b
		}
	}
	b.tokens = min(r.burst, b.tokens+now.Sub(b.last).Seconds()*r.rate)
	b.last = now
	if b.tokens < 1 {
		b.suppressed++
		return false, 0
	}
	b.tokens--
	n := b.suppressed
	b.suppressed = 0
	return true, n
}

// Log writes msg at level unless key's bucket is empty; a line that follows
// suppressed ones carries "suppressed", their count.
func (r *rateLog) Log(level slog.Level, key, msg string, args ...any) {
	if !r.log.Enabled(context.Background(), level) {
		return
	}
	ok, n := r.allow(key)
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	r.log.Log(context.Background(), level, msg, args...)
}

// Flush logs, for every key with suppressed lines and a token to spend,
// "N more suppressed", so that the count is not lost when the flood stops.
func (r *rateLog) Flush() {
	type line struct {
		key string
		n   int
	}
	var out []line
	r.mu.Lock()
	now := r.now()
	for k, b := range r.buckets {
		b.tokens = min(r.burst, b.tokens+now.Sub(b.last).Seconds()*r.rate)
		b.last = now
		if b.suppressed > 0 && b.tokens >= 1 {
			b.tokens--
			out = append(out, line{k, b.suppressed})
			b.suppressed = 0
		}
	}
	r.mu.Unlock()
	for _, l := range out {
		r.log.Warn("log lines suppressed", "kind", l.key, "suppressed", l.n)
	}
}
