#!/usr/bin/env bash
# Runs every test ReFlex has, on a fresh machine: installs what the tests need first.
# Usage: scripts/test.sh            (everything)
#        SKIP_INSTALL=1 scripts/test.sh   (assume the tools are present)
set -euo pipefail
cd "$(dirname "$0")/.."

# The tests build the release profile without its fat LTO and single codegen unit: the same
# optimisation level, but the build the tests need takes a fraction of the time on two cores
# (LTO only decides what is inlined; bench/ measures the shipped fat-LTO build). A
# `cargo build --release` after this script rebuilds with the committed profile.
export CARGO_PROFILE_RELEASE_LTO=off
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
export CARGO_PROFILE_RELEASE_DEBUG=false

# Every step says how long it took: the whole run must fit the CI's time limit.
step_started=$SECONDS
run_started=$SECONDS
step() {
    echo "    ($((SECONDS - step_started)) s)"
    step_started=$SECONDS
    echo "==> $*"
}

APT_PACKAGES=(libnbd-bin fuse3 python3-libnbd nbdkit qemu-utils fio e2fsprogs util-linux
    prometheus systemd gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user tshark openssl
    libssl-dev pkg-config perl make)

# The aarch64 step: cross-built with Debian's gcc, run by qemu-user (which implements no
# io_uring, so reflexd falls back to epoll by itself). Bounded in time.
AARCH64_TARGET=aarch64-unknown-linux-gnu
AARCH64_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
AARCH64_STEP_TIMEOUT=40m

need_sudo() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

install_apt() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "==> installing apt packages: ${missing[*]}"
        need_sudo apt-get update -qq
        need_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

install_cargo_tools() {
    rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
    command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked -q
    rustup component list --installed | grep -q clippy || rustup component add clippy rustfmt
    rustup target list --installed | grep -q "^$AARCH64_TARGET\$" || rustup target add "$AARCH64_TARGET"
}

# The workspace cross-built for aarch64, then reflex-server's tests under qemu-user. Binaries
# the tests spawn (reflexd) go through REFLEX_TEST_RUNNER too: binfmt_misc need not be set up.
aarch64_tests() {
    local started=$SECONDS
    local linker=CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
    env "$linker" timeout "$AARCH64_STEP_TIMEOUT" \
        cargo build --workspace --release --target "$AARCH64_TARGET" -q
    echo "    cross-build: $((SECONDS - started)) s"
    env "$linker" CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$AARCH64_RUNNER" \
        REFLEX_TEST_RUNNER="$AARCH64_RUNNER" timeout "$AARCH64_STEP_TIMEOUT" \
        cargo test --release -p reflex-server --target "$AARCH64_TARGET" -q
    echo "    aarch64 step: $((SECONDS - started)) s"
}

if [ -z "${SKIP_INSTALL:-}" ]; then
    install_apt
    install_cargo_tools
fi

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -q -- -D warnings
step "cargo doc -D warnings (every intra-doc link resolves, private items included)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items -q
step "cargo build --release (binaries the end-to-end tests run)"
cargo build --release --workspace -q
step "cargo test"
cargo test --workspace --release -q
step "docs: every command in README.md and docs/ checked, the short ones run"
python3 scripts/check-docs.py
step "deploy/: systemd unit, Prometheus configuration, dashboard, configs/"
bash scripts/check-deploy.sh
step "schemathesis: the admin API against docs/admin-openapi.json, live"
bash scripts/schemathesis.sh
step "cargo test -p reflex-server on the epoll driver"
REFLEX_DRIVER=epoll cargo test --release -p reflex-server -q
step "aarch64: cross-build, reflex-server's tests under qemu-user (epoll)"
aarch64_tests
if [ -d fuzz ]; then
    step "fuzz targets build"
    (cd fuzz && cargo +nightly fuzz build -O)
    step "dataplane fuzz target: 30 s from its seeds"
    fuzz_work=$(mktemp -d)
    (cd fuzz && cargo +nightly fuzz run -O dataplane "$fuzz_work" corpus/dataplane -- \
        -max_total_time=30 -runs=200000 -artifact_prefix=artifacts/ 2>&1 | tail -25)
    rm -rf "$fuzz_work"
fi
step "all tests passed in $((SECONDS - run_started)) s"
