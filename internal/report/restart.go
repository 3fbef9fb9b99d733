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
	// KeeperLockedChunks counts the chunks whose lock the keeper holds:
	// the agent maps none of them, so its death unmaps nothing of them
	// (fewer than the pool's while the hand-over runs, none where the
	// keeper cannot lock).
	KeeperLockedChunks int `json:"keeperLockedChunks"`
	// KeeperConnected says whether the keeper holds the pool and its books
	// now; while it does not (KeeperLostSeconds long, for KeeperError) the
	// agent refuses changes ("retry") and reconnects. KeeperLosses counts
	// the keepers this agent lost.
	KeeperConnected   bool    `json:"keeperConnected"`
	KeeperLosses      int     `json:"keeperLosses"`
	KeeperLostSeconds float64 `json:"keeperLostSeconds,omitempty"`
	KeeperError       string  `json:"keeperError,omitempty"`
	// PoolLost says that at start the keeper held none of the pool an
	// earlier agent had kept in it (LostChunks chunks and about
	// LostSessions sessions then): those sessions and streams are gone.
	PoolLost     bool `json:"poolLost,omitempty"`
	LostChunks   int  `json:"lostChunks,omitempty"`
	LostSessions int  `json:"lostSessions,omitempty"`
	// The books: the bytes of their memfd in use (its 4 KiB header, the
	// snapshot and the records after it) and of the snapshot, the compactions since this
	// agent started, and the longest one of them held every session's
	// changes up.
	BooksLogBytes           int64   `json:"booksLogBytes"`
	BooksSnapshotBytes      int64   `json:"booksSnapshotBytes"`
	BooksCompactions        int64   `json:"booksCompactions"`
	BooksLongestHoldSeconds float64 `json:"booksLongestHoldSeconds"`
	// Restore is how long each step of the restore at this agent's start
	// took; nil when the keeper held nothing to restore (a first start).
	Restore *RestoreSteps `json:"restore,omitempty"`
}

// RestoreSteps are the steps of a restore from the keeper, in the order
// they ran, all before the agent served: the wait for what a spare read
// ahead (Spare: from the restore's start until the spare's reading,
// halted at the turn, handed it over; zero without a spare), the heap
// made resident for it (Warm), the books replayed (Load), the kept chunks adopted (Adopt), the
// pool's tables rebuilt (Rebuild, while the fresh books memfd is written
// beside it), and the wait for that memfd after the rebuild (Books).
type RestoreSteps struct {
	SpareSeconds   float64 `json:"spareSeconds,omitempty"`
	WarmSeconds    float64 `json:"warmSeconds"`
	WarmBytes      int64   `json:"warmBytes"`
	LoadSeconds    float64 `json:"loadSeconds"`
	AdoptSeconds   float64 `json:"adoptSeconds"`
	RebuildSeconds float64 `json:"rebuildSeconds"`
	BooksSeconds   float64 `json:"booksSeconds"`
	// ReadAhead: a spare had read the books ahead of its turn, and the
	// restore replayed only ReplayedBytes of them (the records committed
	// since its last read); otherwise it replayed them whole.
	ReadAhead     bool  `json:"readAhead,omitempty"`
	ReplayedBytes int64 `json:"replayedBytes"`
}
