# pliant — the two set-up commands are `make demo` and `make test` (see README.md).
# Both install what they need (scripts/install-deps.sh) and build in release mode: the e2e tests push
# real traffic through the packet runtime, which is too slow unoptimised to be a fair test.

CARGO ?= cargo
FUZZ_SECONDS ?= 30
export CARGO_TERM_COLOR ?= never

.PHONY: demo test deps build unit e2e c-test fuzz lint bench clean

demo: deps build
	./target/release/pliant demo

test: deps build unit c-test e2e fuzz
	@echo "make test: all stages passed"

deps:
	@bash scripts/install-deps.sh

build:
	$(CARGO) build --release --workspace --all-targets

# Unit and library tests of every crate except the namespace e2e suite.
unit:
	$(CARGO) test --release --workspace --exclude pliant-cli

# End-to-end tests with real namespaces and traffic; serial, they share two cores with the traffic.
e2e:
	$(CARGO) test --release -p pliant-cli -- --test-threads=1

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
