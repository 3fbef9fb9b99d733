#!/usr/bin/env bash
# Compares the one-CPU round trips of two commits over several code layouts
# of each (docs/benchmarks.md, "A fourth machine kind"): on some machines a
# build's code layout alone moves latbench's one-CPU p50 by up to 0.05 of the
# C echo, as much as a change may, so one build of each side says little.
#
#   hack/layouts.sh BASE [REV]     (REV: the working tree's HEAD by default)
#
# Each side is built in a temporary worktree LAYOUTS times (default 4), each
# build with a function of a different size added at the head of pkg/wire,
# which moves the wire, client and server code by 32-byte steps. The builds
# then run `latbench -n N -placements one` in alternation, ROUNDS times each
# (default 2), and the medians of `is_offloaded` and the Go echo are printed
# per side, with every run's figures above them. Needs cc (the C echo floor).
set -euo pipefail

base=${1:?usage: hack/layouts.sh BASE [REV]}
rev=${2:-HEAD}
layouts=${LAYOUTS:-4}
rounds=${ROUNDS:-2}
n=${N:-40000}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'for w in "$work"/src-*; do git -C "$root" worktree remove --force "$w" 2>/dev/null || true; done; rm -rf "$work"' EXIT

# pad writes a function of $2 statements into pkg/wire of worktree $1, in a
# file that sorts first, so that the code after it moves (the wire package's
# own included); an init that never calls it keeps it in the binary.
pad() {
	{
		printf 'package wire\n\nimport "os"\n\nvar layoutPadSink int\n\n'
		printf 'func init() {\n\tif os.Getpid() < 0 {\n\t\tlayoutPad(1)\n\t}\n}\n\n'
		printf '//go:noinline\nfunc layoutPad(x int) {\n'
		for ((i = 0; i < $2; i++)); do printf '\tlayoutPadSink = layoutPadSink*%d + x\n' $((i + 3)); done
		printf '}\n'
	} > "$1/pkg/wire/aa_layout_pad.go"
}

# run is one latbench run of build $1; a failed one shows what it said.
run() {
	"$work/latbench.$1" -n "$n" -placements one 2> "$work/run.log" || {
		cat "$work/run.log" >&2
		return 1
	}
}

bins=()
for side in base rev; do
	commit=$base
	[ $side = rev ] && commit=$rev
	src=$work/src-$side
	git -C "$root" worktree add -q --detach "$src" "$commit"
	for ((l = 0; l < layouts; l++)); do
		pad "$src" $((1 + 5 * l))
		# cgo's warnings (go-nvml) are noise; a failed build shows its log.
		if ! (cd "$src" && go build -o "$work/latbench.$side.$l" ./cmd/latbench > "$work/build.log" 2>&1); then
			cat "$work/build.log" >&2
			exit 1
		fi
		bins+=("$side.$l")
	done
done

echo "base $(git -C "$root" rev-parse --short "$base"), rev $(git -C "$root" rev-parse --short "$rev"): $layouts layouts each, $rounds rounds, $n calls a run"
for ((r = 0; r < rounds; r++)); do
	for b in "${bins[@]}"; do
		run "$b" |
			awk -v b="$b" -F'  +' '/Go echo over wire.Conn/ {e = $NF} /is_offloaded/ {i = $NF} END {print b, "|", e, "|", i}'
	done
done | tee "$work/runs"

# Each run's line: "side.layout | echo p50 / p90 / p99 | is_offloaded p50 / p90 / p99".
awk -F'|' '
	function med(a, k,   m, i, j, t) {
		m = cnt[k]
		for (i = 1; i <= m; i++) t[i] = a[k, i]
		for (i = 2; i <= m; i++) for (j = i; j > 1 && t[j-1] > t[j]; j--) { x = t[j]; t[j] = t[j-1]; t[j-1] = x }
		return m % 2 ? t[(m+1)/2] : (t[m/2] + t[m/2+1]) / 2
	}
	{
		split($1, s, "."); k = s[1]; c = ++cnt[k]
		split($2, e, "/"); split($3, o, "/")
		ep50[k, c] = e[1] + 0; op50[k, c] = o[1] + 0; op90[k, c] = o[2] + 0
	}
	END {
		print ""
		print "side  runs  is_offloaded p50  is_offloaded p90  Go echo p50   (medians, ratios to the C echo)"
		for (k in cnt) printf "%-5s %4d  %16.3f  %16.3f  %11.3f\n", k, cnt[k], med(op50, k), med(op90, k), med(ep50, k)
	}' "$work/runs"
