#!/usr/bin/env bash
# Installs what `make demo` / `make test` need on a fresh Debian 12 machine of this kind, once.
# Idempotent: only calls apt-get when a package is missing.
set -euo pipefail

# Debian packages and why:
#   iproute2 (ip, tc)        namespaces, veths, tc clsact filters of the lab and the runtime
#   nftables                 the kernel NAT peer (masquerade) measured by the benchmark
#   iperf3                   TCP throughput through each system
#   nginx-light              HTTP server in the lab's server namespace
#   netsniff-ng (trafgen)    64-byte packet generator (iperf3 tops out at ~190k pps here)
#   curl                     HTTP client in the client namespace
#   iputils-ping             RTT measurements
#   traceroute               the NAT hop seen by traceroute -n (router TTL handling, e2e)
#   cbindgen                 generates include/pliant.h from the ffi crate
#   clang, llvm              libFuzzer-compatible sancov builds (and BPF programs later)
#   ethtool, tcpdump         diagnostics used by tests when something fails
#   fonts-dejavu-core        font for benchmark PNG charts
#   postgresql-15            primary/standby servers, pg_rewind and pgbench for `pliant pg` and its tests
#   postgresql-client-15     psql sessions in the pg session-survival test
#   conntrackd, keepalived   the kernel NAT HA peer (conntrack state sync + VRRP) in `pliant bench ha`
#   patroni, etcd-server, etcd-client  the PostgreSQL HA peer measured by `pliant bench pg`; etcd
#                            is also the controller's shared store (`[store] backend = "etcd"`)
#   protobuf-compiler (protoc)  builds the etcd gRPC client crate (it compiles etcd's .proto files)
#                            and raft-proto (pliant-smr's Raft messages, protobuf-codec)
#   libprotobuf-dev          google/protobuf/*.proto, which etcd's .proto files import (protoc
#                            alone does not ship them; only a recommends pulled them in before)
#   coinor-libcbc-dev        the CBC MILP solver the placement planner links (crates/placement)
#   default-jdk-headless, libpostgresql-jdbc-java  a JDBC client (pgJDBC) through the pg proxy in the e2e test
#   pgbouncer                the pooler a user would put in front of PostgreSQL instead, in `pliant bench pg`
#   python3                  stand-in replica processes in the host agent's tests
#   redis-server, redis-tools  the partitions (Redis Cluster nodes) of `pliant kv` and redis-cli for checks;
#                            the replicated server of pliant-smr's tests, redis-benchmark for its measurement
pkgs=(iproute2 nftables iperf3 nginx-light netsniff-ng curl iputils-ping traceroute cbindgen clang llvm ethtool
      conntrackd keepalived patroni etcd-server etcd-client default-jdk-headless libpostgresql-jdbc-java
      tcpdump fonts-dejavu-core gcc g++ make pkg-config postgresql-15 postgresql-client-15 pgbouncer
      protobuf-compiler libprotobuf-dev python3 coinor-libcbc-dev redis-server redis-tools)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "$(id -u)" != 0 ]; then
  # Only a PLIANT_ALLOW_SKIP=1 run gets here as another user (scripts/preflight.sh); apt-get and
  # /run/pliant need root, and the tests that need a missing tool record a skip instead.
  if [ "${PLIANT_ALLOW_SKIP:-}" != 1 ]; then
    echo "install-deps: needs root (apt-get, /run/pliant): run as root, or set PLIANT_ALLOW_SKIP=1" >&2
    exit 1
  fi
  echo "install-deps: not root, PLIANT_ALLOW_SKIP=1: skipping apt-get (missing: ${missing[*]:-none})" >&2
elif ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian's nginx package may start a system nginx; pliant runs its own per lab.
  if [ -f /run/nginx.pid ]; then kill "$(cat /run/nginx.pid)" 2>/dev/null || true; fi
  # Likewise a system pgbouncer (the bench starts its own, per run, in the lab's namespace).
  if [ -f /run/postgresql/pgbouncer.pid ]; then
    kill "$(cat /run/postgresql/pgbouncer.pid)" 2>/dev/null || true
  fi
  # Likewise Debian's default PostgreSQL cluster: pliant runs its own servers in namespaces, and
  # nothing should listen on the host that the configuration did not ask for.
  if command -v pg_ctlcluster >/dev/null; then pg_ctlcluster 15 main stop 2>/dev/null || true; fi
  # Likewise Debian's system redis-server (pliant kv starts its own, per host namespace).
  if command -v systemctl >/dev/null; then systemctl stop redis-server 2>/dev/null || true; fi
  if [ -f /run/redis/redis-server.pid ]; then kill "$(cat /run/redis/redis-server.pid)" 2>/dev/null || true; fi
fi
command -v cargo >/dev/null || { echo "install-deps: cargo not found (install Rust with rustup)" >&2; exit 1; }
if [ "$(id -u)" = 0 ]; then mkdir -p /run/pliant; fi
