#!/usr/bin/env bash
# The first step of `make test`, `make unit`, `make e2e` (and `make demo`, through `deps`): refuse
# a run that cannot do what it promises before anything is installed or built, and start the skip
# log afresh.
#
#   scripts/preflight.sh          check, then truncate target/test-skips.log
#   scripts/preflight.sh report   print how many tests were skipped, and which
#
# The suite needs root (network namespaces, AF_PACKET, tc, BPF; apt-get for the packages). As any
# other user this fails within seconds, unless PLIANT_ALLOW_SKIP=1: then every test that needs
# root (or a missing tool) records itself in target/test-skips.log instead of failing
# (crates/testkit), and the report at the end of the run counts and lists them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The same path pliant-testkit compiles in (SKIP_LOG): target/ at the workspace root.
log="$root/target/test-skips.log"

if [ "${1:-}" = report ]; then
  n=0
  [ -f "$log" ] && n=$(wc -l <"$log")
  echo "skipped: $n test(s)"
  if [ "$n" != 0 ]; then sed 's/^/  skipped: /' "$log"; fi
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  if [ "${PLIANT_ALLOW_SKIP:-}" != 1 ]; then
    echo "preflight: needs root (network namespaces, AF_PACKET, tc, apt-get): run as root, or set" \
      "PLIANT_ALLOW_SKIP=1 to skip the tests that need root (they are counted and listed at the end)" >&2
    exit 1
  fi
  echo "preflight: not root, PLIANT_ALLOW_SKIP=1: tests that need root are skipped, counted and listed at the end" >&2
fi
mkdir -p "$root/target"
: >"$log"
