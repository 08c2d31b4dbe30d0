#!/usr/bin/env bash
# Runs every test ReFlex has, on a fresh machine: installs what the tests need first.
# Usage: scripts/test.sh            (everything)
#        SKIP_INSTALL=1 scripts/test.sh   (assume the tools are present)
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(libnbd-bin fuse3 python3-libnbd nbdkit qemu-utils fio e2fsprogs util-linux)

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
}

if [ -z "${SKIP_INSTALL:-}" ]; then
    install_apt
    install_cargo_tools
fi

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets -q -- -D warnings
echo "==> cargo build --release (binaries the end-to-end tests run)"
cargo build --release --workspace -q
echo "==> cargo test"
cargo test --workspace --release -q
if [ -d fuzz ]; then
    echo "==> fuzz targets build"
    (cd fuzz && cargo +nightly fuzz build -O)
    echo "==> dataplane fuzz target: 30 s from its seeds"
    fuzz_work=$(mktemp -d)
    (cd fuzz && cargo +nightly fuzz run -O dataplane "$fuzz_work" corpus/dataplane -- \
        -max_total_time=30 -runs=200000 -artifact_prefix=artifacts/ 2>&1 | tail -25)
    rm -rf "$fuzz_work"
fi
echo "==> all tests passed"
