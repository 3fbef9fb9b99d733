package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/kvpool/kvpool/pkg/standalone"
)

// tokenList is a repeatable --token flag.
type tokenList []string

func (t *tokenList) String() string     { return strings.Join(*t, ",") }
func (t *tokenList) Set(v string) error { *t = append(*t, v); return nil }

// newLogger returns a slog logger writing to stderr at level in format.
func newLogger(level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %w", level, err)
	}
	o := &slog.HandlerOptions{Level: l}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, o)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, o)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// runServe is `agent [serve]`.
func runServe(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	standaloneMode := fs.Bool("standalone", false, "run without kubelet: simulated GPUs and a memfd pool on a local socket")
	socket := fs.String("socket", "", "socket path (standalone default: "+standalone.DefaultSocket()+")")
	gpus := fs.Int("gpus", 2, "standalone: simulated GPUs")
	chunks := fs.Int("chunks-per-gpu", 4, "standalone: chunks per GPU")
	chunkMiB := fs.Int("chunk-mib", 64, "standalone: chunk size in MiB")
	var tokens tokenList
	fs.Var(&tokens, "token", "standalone: allocation token (repeatable; default one random token)")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	format := fs.String("log-format", "text", "text or json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	log, err := newLogger(*level, *format)
	if err != nil {
		return err
	}
	slog.SetDefault(log)
	if !*standaloneMode {
		return errors.New("only --standalone is implemented in this build (the kubelet device plugin comes with pkg/plugin)")
	}
	if *chunkMiB <= 0 || *chunkMiB > 1<<20 {
		return fmt.Errorf("--chunk-mib %d out of range", *chunkMiB)
	}
	a, err := standalone.Start(standalone.Config{GPUs: *gpus, ChunksPerGPU: *chunks, ChunkBytes: int64(*chunkMiB) << 20,
		Tokens: tokens, Socket: *socket, Logger: log})
	if err != nil {
		return err
	}
	defer a.Close()
	for tok, ids := range a.Tokens {
		log.Info("allocation", "token", tok, "chunks", strings.Join(ids, ","))
	}
	var first string
	for tok := range a.Tokens {
		first = tok
		break
	}
	log.Info("kvpool agent serving", "mode", "standalone", "socket", a.Socket, "gpus", *gpus,
		"chunks", *gpus**chunks, "chunk_mib", *chunkMiB,
		"try", fmt.Sprintf("KVPOOL_SOCKET=%s KVPOOL_TOKEN=%s go run ./cmd/kvclient", a.Socket, first))
	err = a.Serve(ctx)
	log.Info("kvpool agent stopped", "err", err)
	return err
}
