//! Tidy checks over the whole repository (as rust-analyzer's `tidy.rs`): rules that keep the
//! architecture true and that no compiler checks.
//!
//! - `unsafe` appears only in the modules allowed to hold it (where the kernel or shared
//!   memory receives raw pointers), each block with a `// SAFETY:` comment (clippy's
//!   `undocumented_unsafe_blocks` checks the comment; this checks the place);
//! - the sans-IO crates (`proto`, `qos`, `flash`, `dataplane`) never read a clock: time is a
//!   parameter;
//! - every relative link in the Markdown documents points to a file that exists (rustdoc's
//!   intra-doc links are `scripts/test.sh`'s `cargo doc -D warnings`);
//! - no absolute path of a developer's machine is written in the tree.

use std::path::{Path, PathBuf};

/// Files that may contain `unsafe`, relative to the repository root.
const UNSAFE_ALLOWED: &[&str] = &[
    "crates/flash/src/aligned.rs",
    "crates/flash/src/pool",
    // The `mem` device's copy-on-write blocks, lent to sends.
    "crates/flash/src/pages.rs",
    // The unsafe `Device::queue_without_ring` and its implementations.
    "crates/flash/src/device.rs",
    "crates/flash/src/fault.rs",
    "crates/flash/src/file.rs",
    "crates/server/src/driver.rs",
    "crates/kv/src/device.rs",
    "crates/dataplane/src/memory.rs",
    // A key-value request of another thread is stepped on its run in that thread's arena
    // (one call of `LentRun::bytes_mut`, whose contract the module's exchange keeps).
    "crates/dataplane/src/core/kv_owner.rs",
    // OpenSSL's TLS 1.3 session-based PSK callbacks (48-byte NVMe/TCP keys).
    "crates/dataplane/src/core/tls/psk_session.rs",
    "crates/client/src/nvme_tcp_psk_session.rs",
    "crates/server/src/sys.rs",
    // A read migrated from another thread lands in that thread's arena.
    "crates/server/src/migration.rs",
    "crates/server/src/uring/ring.rs",
    "crates/server/src/uring/driver.rs",
    "crates/server/src/uring/mod.rs",
    "crates/server/src/epoll",
    "crates/client/src/sys.rs",
    "crates/cli/src/bench/uring.rs",
    "bench/limit/src/uring.rs",
    // Tests that set socket options std does not offer.
    "crates/server/tests/hostile.rs",
    "crates/server/tests/native.rs",
    "crates/server/tests/epoll.rs",
    // This file names the word.
    "crates/server/tests/tidy.rs",
    // The whole-server fuzz targets tune the allocator (mallopt) before fuzzing.
    "fuzz/fuzz_targets/dataplane",
];

/// Crates whose library code takes time as a parameter and never reads a clock.
const CLOCK_FREE: &[&str] = &[
    "crates/proto/src",
    "crates/qos/src",
    "crates/flash/src",
    "crates/dataplane/src",
];

/// Parts of those crates that run on real threads: the file pool's workers (its tests wait
/// for them with a bound).
const CLOCK_ALLOWED: &[&str] = &["crates/flash/src/pool"];

/// Absolute paths of the machines this was written on, which must not leak into the tree.
const MACHINE_PATHS: &[&str] = &["/work/", "/root/", "/home/"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under `dir` (relative to the root), skipping build output, VCS data and
/// fuzzing artefacts.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if matches!(
                name.as_ref(),
                "target" | ".git" | "corpus" | "artifacts" | "coverage" | "reflex-data"
            ) || name.starts_with("target")
                // The fuzzers' working corpora and logs (`scripts/fuzz.sh`).
                || path.ends_with("fuzz/work")
            {
                continue;
            }
            files(&path, out);
        } else if name != ".git" {
            // (A worktree's `.git` is a file naming the main checkout: not part of the tree.)
            out.push(path);
        }
    }
}

fn relative(path: &Path) -> String {
    let root = root().canonicalize().unwrap_or_else(|e| panic!("{e}"));
    let path = path.canonicalize().unwrap_or_else(|e| panic!("{e}"));
    path.strip_prefix(&root)
        .unwrap_or(&path)
        .to_string_lossy()
        .into_owned()
}

fn all_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    files(&root(), &mut out);
    out
}

/// The code of a Rust line, without a trailing `//` comment (crudely: string contents are
/// not parsed, which is fine for the words checked here).
fn code_of(line: &str) -> &str {
    match line.find("//") {
        Some(at) => &line[..at],
        None => line,
    }
}

#[test]
fn unsafe_code_lives_only_in_the_allowed_modules() {
    let mut offenders = Vec::new();
    for path in all_files() {
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = relative(&path);
        if UNSAFE_ALLOWED
            .iter()
            .any(|allowed| name.starts_with(allowed))
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (number, line) in text.lines().enumerate() {
            let code = code_of(line);
            let words: Vec<&str> = code
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .collect();
            if words.contains(&"unsafe") && !code.contains("unsafe_code") {
                offenders.push(format!("{name}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "unsafe outside the allowed modules:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_sans_io_crates_read_no_clock() {
    let mut offenders = Vec::new();
    for path in all_files() {
        let name = relative(&path);
        if path.extension().is_none_or(|e| e != "rs")
            || !CLOCK_FREE.iter().any(|dir| name.starts_with(dir))
            || CLOCK_ALLOWED.iter().any(|dir| name.starts_with(dir))
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (number, line) in text.lines().enumerate() {
            let code = code_of(line);
            if [
                "Instant::now",
                "SystemTime::now",
                "Instant::elapsed",
                ".elapsed()",
            ]
            .iter()
            .any(|word| code.contains(word))
            {
                offenders.push(format!("{name}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "clock reads in sans-IO crates:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn every_relative_doc_link_resolves() {
    let mut broken = Vec::new();
    for path in all_files() {
        if path.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let name = relative(&path);
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let directory = path.parent().unwrap_or(Path::new("."));
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else {
                break;
            };
            let target = rest[..end].trim();
            rest = &rest[end..];
            let target = target.split_whitespace().next().unwrap_or_default();
            if target.is_empty()
                || target.starts_with('#')
                || target.contains("://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let file = target.split('#').next().unwrap_or_default();
            if file.is_empty() || !directory.join(file).exists() {
                broken.push(format!("{name}: {target}"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to files that do not exist:\n{}",
        broken.join("\n")
    );
}

/// Whether `line` holds `prefix` as the start of an absolute path (not inside a relative one
/// such as `fuzz/work/`).
fn contains_absolute(line: &str, prefix: &str) -> bool {
    line.match_indices(prefix).any(|(at, _)| {
        line[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')))
    })
}

#[test]
fn no_machine_paths_in_the_tree() {
    let mut offenders = Vec::new();
    for path in all_files() {
        let name = relative(&path);
        if name == "crates/server/tests/tidy.rs" {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue; // binary
        };
        for (number, line) in text.lines().enumerate() {
            if MACHINE_PATHS
                .iter()
                .any(|prefix| contains_absolute(line, prefix))
            {
                offenders.push(format!("{name}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "absolute machine paths:\n{}",
        offenders.join("\n")
    );
}

/// The checks are not vacuous: they see the files and would flag an offending line.
#[test]
fn the_checks_see_the_tree_and_flag_what_they_look_for() {
    let rust_files = all_files()
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .count();
    assert!(rust_files > 100, "only {rust_files} Rust files found");
    let offending = "    let x = unsafe { std::ptr::read(p) }; // SAFETY: no";
    let code = code_of(offending);
    assert!(
        code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == "unsafe")
    );
    assert!(!code_of("// unsafe in a comment").contains("unsafe"));
    let machine = MACHINE_PATHS[0];
    assert!(contains_absolute(&format!("cd {machine}x"), machine));
    assert!(contains_absolute(&format!("`{machine}x`"), machine));
    assert!(!contains_absolute(&format!("fuzz{machine}x"), machine));
}
