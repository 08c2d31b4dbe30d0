//! The `dataplane` fuzz target's operation scripts on the stable toolchain: every input of
//! the seed corpus (`fuzz/corpus/dataplane/`) runs against a `VirtualServer` with the target's
//! checks, and a few scripts written out as steps assert what the server did. The harness is
//! `fuzz/src/script.rs`, included here so that a crash input found by the fuzzer replays as
//! an ordinary test.

#[path = "../../../fuzz/src/script.rs"]
mod script;

use std::path::PathBuf;

use script::{Config, Mode, Script, Step};

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
        let trace = std::env::var_os("SCRIPT_TRACE").is_some();
        let outcome = if trace {
            eprintln!("== {}", path.display());
            script::run(&Script::decode(&bytes), true)
        } else {
            script::run_bytes(&bytes)
        };
        eprintln!("{}: {outcome:?}", path.display());
        // The same seed with well-formed clients (the `dataplane_protocol` target).
        let outcome = if trace {
            script::run_mode(&Script::decode(&bytes), Mode::WellFormed, true)
        } else {
            script::run_well_formed_bytes(&bytes)
        };
        eprintln!("{} (well-formed): {outcome:?}", path.display());
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

#[test]
fn well_formed_clients_get_every_answer() {
    let script = Script {
        config: Config([0x01, 0, 0x1f, 0x04]),
        steps: vec![
            Step::Connect {
                thread: 0,
                listener: 0,
                source: 0,
            },
            Step::Connect {
                thread: 1,
                listener: 2,
                source: 4,
            },
            Step::Connect {
                thread: 0,
                listener: 1,
                source: 0,
            },
            Step::Native {
                socket: 0,
                opcode: 1,
                flags: 0,
                id: 0,
                namespace: 1,
                offset: 0,
                length: 8,
                body: [0; 4],
            },
            Step::Native {
                socket: 0,
                opcode: 0,
                flags: 0,
                id: 0,
                namespace: 1,
                offset: 0,
                length: 8,
                body: [0; 4],
            },
            Step::NbdRequest {
                socket: 0,
                command: 0,
                flags: 0,
                cookie: 0,
                offset: 0,
                length: 3,
            },
            Step::Original {
                socket: 0,
                opcode: 0,
                handle: 0,
                lba: 8,
                count: 1,
                payload: 0,
            },
            Step::Fault {
                namespace: 1,
                kind: 1,
                a: 0,
                b: 0,
            },
            Step::Native {
                socket: 0,
                opcode: 0,
                flags: 0,
                id: 0,
                namespace: 1,
                offset: 16,
                length: 3,
                body: [0; 4],
            },
            Step::Advance { mode: 9 },
        ],
    };
    let outcome = script::run_mode(&script, Mode::WellFormed, true);
    assert_eq!(outcome.requests_sent, 5, "{outcome:?}");
}

/// Replays one fuzz input with a trace of every step:
/// `SCRIPT_FILE=fuzz/artifacts/dataplane/crash-… cargo test --release -p reflex-sim --test
/// dataplane_script replay -- --nocapture` (does nothing without `SCRIPT_FILE`;
/// `SCRIPT_MODE=well-formed` for a `dataplane_protocol` input; a directory runs every input in
/// it without a trace).
#[test]
fn replay() {
    let Some(path) = std::env::var_os("SCRIPT_FILE") else {
        return;
    };
    let mode = match std::env::var("SCRIPT_MODE").as_deref() {
        Ok("well-formed") => Mode::WellFormed,
        _ => Mode::Any,
    };
    let path = PathBuf::from(path);
    if path.is_dir() {
        // A whole corpus, without traces.
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .map(|entry| entry.unwrap_or_else(|e| panic!("{e}")).path())
            .collect();
        files.sort();
        for file in &files {
            eprintln!("{}", file.display());
            let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            script::run_mode(&Script::decode(&bytes), mode, false);
        }
        eprintln!("{} inputs ran clean", files.len());
        return;
    }
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let script = Script::decode(&bytes);
    eprintln!("{script:#?}");
    let outcome = script::run_mode(&script, mode, true);
    eprintln!("{outcome:?}");
}
