//! The `dataplane` fuzz target's operation scripts on the stable toolchain: every input of
//! the seed corpus (`fuzz/corpus/dataplane/`) runs against a `VirtualServer` with the target's
//! checks, and a few scripts written out as steps assert what the server did. The harness is
//! `fuzz/src/script.rs`, included here so that a crash input found by the fuzzer replays as
//! an ordinary test.

#[path = "../../../fuzz/src/script.rs"]
mod script;

use std::path::PathBuf;

use script::{Config, Script, Step};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/dataplane")
}

#[test]
fn every_seed_runs_clean() {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .unwrap_or_else(|e| panic!("{}: {e}", corpus_dir().display()))
        .map(|entry| entry.unwrap_or_else(|e| panic!("{e}")).path())
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "no seed in {}", corpus_dir().display());
    for path in entries {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let outcome = if std::env::var_os("SCRIPT_TRACE").is_some() {
            eprintln!("== {}", path.display());
            script::run(&Script::decode(&bytes), true)
        } else {
            script::run_bytes(&bytes)
        };
        eprintln!("{}: {outcome:?}", path.display());
    }
}

/// The seed files are what `script::seeds` builds (`UPDATE_SEEDS=1` writes them).
#[test]
fn seed_files_are_current() {
    let update = std::env::var_os("UPDATE_SEEDS").is_some();
    for (name, script) in script::seeds() {
        let path = corpus_dir().join(name);
        let bytes = script.encode();
        assert_eq!(
            Script::decode(&bytes),
            script,
            "{name} does not decode to itself"
        );
        if update {
            std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        } else {
            let stored = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(
                stored, bytes,
                "{name}: run UPDATE_SEEDS=1 cargo test -p reflex-sim"
            );
        }
    }
}

#[test]
fn a_native_write_and_read_are_answered() {
    let script = Script {
        config: Config::default(),
        steps: vec![
            Step::Connect {
                thread: 0,
                listener: 0,
                source: 0,
            },
            Step::Native {
                socket: 0,
                opcode: 2,
                flags: 0,
                id: 1,
                namespace: 0,
                offset: 8,
                length: 3,
                body: [0; 4],
            },
            Step::Native {
                socket: 0,
                opcode: 1,
                flags: 0,
                id: 2,
                namespace: 0,
                offset: 8,
                length: 3,
                body: [0; 4],
            },
            Step::Advance { mode: 7 },
        ],
    };
    let outcome = script::run(&script, true);
    assert_eq!(outcome.responses, 2, "{outcome:?}");
    assert_eq!(Script::decode(&script.encode()), script);
}

/// Replays one fuzz input with a trace of every step:
/// `SCRIPT_FILE=fuzz/artifacts/dataplane/crash-… cargo test --release -p reflex-sim --test
/// dataplane_script replay -- --nocapture` (does nothing without `SCRIPT_FILE`).
#[test]
fn replay() {
    let Some(path) = std::env::var_os("SCRIPT_FILE") else {
        return;
    };
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let script = Script::decode(&bytes);
    eprintln!("{script:#?}");
    let outcome = script::run(&script, true);
    eprintln!("{outcome:?}");
}
