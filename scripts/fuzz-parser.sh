#!/usr/bin/env bash
# Builds the libFuzzer target for pliant-net's frame parser (fuzz/) on *stable* rustc and runs
# it for a bounded time. Exits non-zero if the fuzzer finds a crash (the input is saved under
# target/fuzz/artifacts/) or the build fails.
#
#   scripts/fuzz-parser.sh [SECONDS]      (default 60)
#
# Coverage guidance comes from LLVM's SanitizerCoverage passes, which stable rustc exposes via
# -C passes / -C llvm-args (cargo-fuzz uses the same flags, plus nightly-only -Zsanitizer which
# safe Rust does not need). --target is passed explicitly so these RUSTFLAGS do not apply to
# build scripts (which would then fail to link against the coverage callbacks).
set -euo pipefail

secs="${1:-60}"
[[ "$secs" =~ ^[0-9]+$ ]] || { echo "usage: $0 [SECONDS]" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target_dir="${FUZZ_TARGET_DIR:-$root/target/fuzz}"
host="$(rustc -vV | sed -n 's/^host: //p')"

# libfuzzer-sys compiles libFuzzer's C++ sources: use clang++ if there is no default c++.
if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null && command -v clang++ >/dev/null; then
  export CXX=clang++
fi

export RUSTFLAGS="-Cpasses=sancov-module \
 -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
 -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares \
 --cfg fuzzing -Cdebug-assertions"

echo "fuzz-parser: building (stable $(rustc --version | cut -d' ' -f2), target dir $target_dir)" >&2
cargo build --release --quiet --manifest-path "$root/fuzz/Cargo.toml" \
  --target "$host" --target-dir "$target_dir" --bin parse
bin="$target_dir/$host/release/parse"

# Work on a copy of the checked-in seeds: libFuzzer adds every new-coverage input to the
# corpus directory, and that must not dirty the repository.
corpus="$target_dir/corpus"
artifacts="$target_dir/artifacts"
mkdir -p "$corpus" "$artifacts"
cp -n "$root"/fuzz/seeds/* "$corpus"/ 2>/dev/null || true

echo "fuzz-parser: fuzzing for ${secs}s (corpus $corpus)" >&2
log="$target_dir/fuzz-parser.log"
set +e
# -timeout: a single input taking >10 s is a hang worth reporting; the outer timeout is a
# backstop in case libFuzzer itself wedges.
timeout --kill-after=10 "$((secs + 60))" "$bin" "$corpus" \
  -max_total_time="$secs" -max_len=2048 -timeout=10 -rss_limit_mb=1024 \
  -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1
rc=$?
set -e
grep -E "^(stat::number_of_executed_units|stat::new_units_added)|Done [0-9]+ runs" "$log" >&2 || true
if [ "$rc" -ne 0 ]; then
  tail -40 "$log" >&2
  echo "fuzz-parser: FAILED (exit $rc); crashing inputs in $artifacts, full log $log" >&2
  exit 1
fi
echo "fuzz-parser: ok, no crash in ${secs}s" >&2
