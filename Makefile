# pliant — the two set-up commands are `make demo` and `make test` (see README.md).
# Both install what they need (scripts/install-deps.sh) and build in release mode: the e2e tests push
# real traffic through the packet runtime, which is too slow unoptimised to be a fair test.

CARGO ?= cargo
FUZZ_SECONDS ?= 30
export CARGO_TERM_COLOR ?= never

.PHONY: demo test preflight deps build unit e2e c-test fuzz lint bench clean

demo: deps build
	./target/release/pliant demo

# One feature resolution for everything (`--workspace` everywhere): splitting the suite with
# `--exclude`/`-p` re-resolved features and rebuilt half the dependency graph a second time.
# Tests run one at a time: the e2e tests push real traffic and share two cores with it.
test: deps build
	$(CARGO) test --release --workspace --no-run
	$(MAKE) c-test
	$(CARGO) test --release --workspace -- --test-threads=1
	# The unit tests again with debug assertions (the invariants) and overflow checks on.
	$(CARGO) test --profile test-da --workspace --lib --bins -- --test-threads=2
	$(MAKE) fuzz
	@bash scripts/preflight.sh report
	@echo "make test: all stages passed"

# Not root and no PLIANT_ALLOW_SKIP=1: fail here, in seconds, not after the install and the build
# (scripts/preflight.sh). Every target that installs goes through it, and it truncates the skip
# log that `preflight.sh report` counts at the end of a test run.
preflight:
	@bash scripts/preflight.sh

deps: preflight
	@bash scripts/install-deps.sh

# Binaries and libpliant.so (the C example and the e2e tests need them next to each other).
build:
	$(CARGO) build --release --workspace

# Developer shortcuts: everything but the namespace e2e suite, or only that suite.
unit: deps
	$(CARGO) test --release --workspace --lib --bins
	@bash scripts/preflight.sh report

e2e: deps build
	$(CARGO) test --release --workspace --test '*' -- --test-threads=1
	@bash scripts/preflight.sh report

# The C network function built against include/pliant.h and libpliant.so.
c-test:
	$(MAKE) -C examples/c test

# Coverage-guided fuzzing of the frame parser for a bounded time.
fuzz:
	bash scripts/fuzz-parser.sh $(FUZZ_SECONDS)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

bench: deps build
	./target/release/pliant bench forward --json --png out/bench-forward.png

clean:
	$(CARGO) clean
