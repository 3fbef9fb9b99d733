package report

// Restart says what the agent took over from the keeper when it started:
// chunks adopted (the same memory, not pinned again) and chunks it
// allocated fresh, the sessions and streams it restored, and how long the
// pool went unserved (from the previous agent's last sign of life until
// this one served).
type Restart struct {
	Keeper         string  `json:"keeper"` // the keeper's socket
	AdoptedChunks  int     `json:"adoptedChunks"`
	FreshChunks    int     `json:"freshChunks"`
	Sessions       int     `json:"sessions"`
	Streams        int     `json:"streams"`
	LastGapSeconds float64 `json:"lastGapSeconds"`
}
