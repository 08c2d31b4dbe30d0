//! How one validated request becomes a sequence of device operations, and what its answer is.
//!
//! Why: most requests are one device operation, but NBD asks for a few that are not.
//! `WRITE_ZEROES` is a discard, or zeroes written from a zeroed buffer run, possibly in
//! several chunks (its length is not bounded by the maximum payload), and it falls back to
//! writing when the device turns out not to discard. `TRIM` is only a hint, so a device without
//! discard makes it succeed, not fail. FUA on `TRIM` or `WRITE_ZEROES` means a device flush
//! after the operation. These decisions are plain functions of the request, the step that
//! just finished and its result, so they are tested here without a ring; the dataplane only
//! submits the step they name, and every step passes through the scheduler like any request.
//!
//! Invariants: a request is in exactly one step at a time; `ZeroFill` progress only grows and
//! never passes the request's length; an answer is produced exactly once, by [`first_step`]
//! or [`after_step`].

use reflex_flash::FlashError;

use crate::frontend::{Answer, IoKind};

/// The device operation a request is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoStep {
    /// The operation the request names (for `WriteZeroes`: a discard).
    Primary,
    /// Writing zeroes from the request's zeroed run; `written_bytes` done so far.
    ZeroFill { written_bytes: u32 },
    /// A device flush making an earlier step durable (FUA on a discard or zero fill).
    FlushAfter,
}

/// How a request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Submit this step.
    Submit(IoStep),
    /// Nothing to do on the device: answer at once.
    Answer(Answer),
}

/// What follows a finished step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Continue(IoStep),
    Done(Answer),
}

/// Bytes of buffer run a request needs: its data for READ and WRITE, the zero source for
/// `WriteZeroes` (at most `run_bytes_max`, written repeatedly), none otherwise.
pub fn run_bytes(kind: IoKind, length_bytes: u32, run_bytes_max: usize) -> usize {
    match kind {
        IoKind::Read | IoKind::Write { .. } => length_bytes as usize,
        IoKind::WriteZeroes { .. } => (length_bytes as usize).min(run_bytes_max),
        IoKind::Flush | IoKind::Trim { .. } => 0,
    }
}

/// The first step. `discards`: whether the device is believed to discard (it said so, and has
/// not refused a discard since).
pub fn first_step(kind: IoKind, discards: bool) -> Start {
    match kind {
        IoKind::Trim { hint: true, .. } if !discards => Start::Answer(Answer::Ok),
        IoKind::WriteZeroes { no_hole, .. } if no_hole || !discards => {
            Start::Submit(IoStep::ZeroFill { written_bytes: 0 })
        }
        _ => Start::Submit(IoStep::Primary),
    }
}

/// Bytes the next zero-fill write covers.
pub fn zero_chunk_bytes(length_bytes: u32, written_bytes: u32, run_bytes: usize) -> u32 {
    assert!(written_bytes < length_bytes, "zero fill past its end");
    assert!(run_bytes > 0);
    let remaining = length_bytes - written_bytes;
    remaining.min(u32::try_from(run_bytes).unwrap_or(u32::MAX))
}

/// What follows `step` of a request of `kind` and `length_bytes` (its zero run holds
/// `run_bytes`), given the device's `result`.
pub fn after_step(
    kind: IoKind,
    step: IoStep,
    length_bytes: u32,
    run_bytes: usize,
    result: &Result<u32, FlashError>,
) -> Next {
    let fua = match kind {
        IoKind::Trim { fua, .. } | IoKind::WriteZeroes { fua, .. } => fua,
        _ => false,
    };
    let finished = if fua {
        Next::Continue(IoStep::FlushAfter)
    } else {
        Next::Done(Answer::Ok)
    };
    let short = Next::Done(Answer::DeviceError { errno: libc::EIO });
    match (step, result) {
        (IoStep::Primary, Err(FlashError::Unsupported)) => match kind {
            // A discard is a hint: nothing changed, nothing to make durable.
            IoKind::Trim { hint: true, .. } => Next::Done(Answer::Ok),
            IoKind::WriteZeroes { .. } => Next::Continue(IoStep::ZeroFill { written_bytes: 0 }),
            _ => Next::Done(Answer::Unsupported),
        },
        (_, Err(error)) => Next::Done(Answer::from_device(error)),
        (IoStep::Primary, Ok(bytes)) => match kind {
            // A short transfer: never send (or acknowledge) the unfilled part.
            IoKind::Read | IoKind::Write { .. } if *bytes != length_bytes => short,
            IoKind::Read | IoKind::Write { .. } | IoKind::Flush => Next::Done(Answer::Ok),
            IoKind::Trim { .. } | IoKind::WriteZeroes { .. } => finished,
        },
        (IoStep::ZeroFill { written_bytes }, Ok(bytes)) => {
            let chunk = zero_chunk_bytes(length_bytes, written_bytes, run_bytes);
            if *bytes != chunk {
                return short;
            }
            let written_bytes = written_bytes + chunk;
            if written_bytes < length_bytes {
                Next::Continue(IoStep::ZeroFill { written_bytes })
            } else {
                finished
            }
        }
        (IoStep::FlushAfter, Ok(_)) => Next::Done(Answer::Ok),
    }
}

/// Whether `result` of `step` shows that the device does not discard (so later requests skip
/// straight to the fallback).
pub fn reveals_no_discard(kind: IoKind, step: IoStep, result: &Result<u32, FlashError>) -> bool {
    step == IoStep::Primary
        && matches!(kind, IoKind::Trim { .. } | IoKind::WriteZeroes { .. })
        && matches!(result, Err(FlashError::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u32 = 1 << 20;
    const RUN: usize = 1 << 20;

    /// Runs a request against a device that answers every step with `device(step)`; returns
    /// the steps submitted and the answer.
    fn run(
        kind: IoKind,
        length_bytes: u32,
        discards: bool,
        device: impl Fn(IoStep) -> Result<u32, FlashError>,
    ) -> (Vec<IoStep>, Answer) {
        let run_bytes = run_bytes(kind, length_bytes, RUN);
        let mut steps = Vec::new();
        let mut step = match first_step(kind, discards) {
            Start::Answer(answer) => return (steps, answer),
            Start::Submit(step) => step,
        };
        for _ in 0..10_000 {
            steps.push(step);
            match after_step(kind, step, length_bytes, run_bytes, &device(step)) {
                Next::Continue(next) => step = next,
                Next::Done(answer) => return (steps, answer),
            }
        }
        panic!("request never finished: {steps:?}");
    }

    /// A device that completes everything in full, discards included.
    fn good(length_bytes: u32) -> impl Fn(IoStep) -> Result<u32, FlashError> {
        move |step| match step {
            IoStep::ZeroFill { written_bytes } => {
                Ok(zero_chunk_bytes(length_bytes, written_bytes, RUN))
            }
            IoStep::Primary => Ok(length_bytes),
            IoStep::FlushAfter => Ok(0),
        }
    }

    /// Like `good`, but discards are unsupported.
    fn no_discard(length_bytes: u32) -> impl Fn(IoStep) -> Result<u32, FlashError> {
        move |step| match step {
            IoStep::Primary => Err(FlashError::Unsupported),
            other => good(length_bytes)(other),
        }
    }

    use IoStep::{FlushAfter, Primary, ZeroFill};

    fn zero(written_bytes: u32) -> IoStep {
        ZeroFill { written_bytes }
    }

    #[test]
    fn single_operations() {
        for kind in [IoKind::Read, IoKind::Write { fua: true }, IoKind::Flush] {
            let length = if kind == IoKind::Flush { 0 } else { 4096 };
            assert_eq!(
                run(kind, length, true, good(length)),
                (vec![Primary], Answer::Ok)
            );
        }
        assert_eq!(run_bytes(IoKind::Read, 4096, RUN), 4096);
        assert_eq!(run_bytes(IoKind::Flush, 0, RUN), 0);
        // Short transfers are I/O errors.
        let (_, answer) = run(IoKind::Read, 4096, true, |_| Ok(512));
        assert_eq!(answer, Answer::DeviceError { errno: libc::EIO });
        // Device errors are passed on.
        let (_, answer) = run(IoKind::Write { fua: false }, 4096, true, |_| {
            Err(FlashError::Io {
                errno: libc::ENOSPC,
            })
        });
        assert_eq!(
            answer,
            Answer::DeviceError {
                errno: libc::ENOSPC
            }
        );
    }

    #[test]
    fn trim_is_a_hint_for_nbd_and_a_refusal_for_native() {
        let nbd = IoKind::Trim {
            fua: false,
            hint: true,
        };
        let native = IoKind::Trim {
            fua: false,
            hint: false,
        };
        assert_eq!(run(nbd, MIB, true, good(MIB)), (vec![Primary], Answer::Ok));
        assert_eq!(
            run(nbd, MIB, true, no_discard(MIB)),
            (vec![Primary], Answer::Ok)
        );
        // Known not to discard: answered without touching the device.
        assert_eq!(run(nbd, MIB, false, good(MIB)), (vec![], Answer::Ok));
        assert_eq!(
            run(native, MIB, true, no_discard(MIB)),
            (vec![Primary], Answer::Unsupported)
        );
        let fua = IoKind::Trim {
            fua: true,
            hint: true,
        };
        assert_eq!(
            run(fua, MIB, true, good(MIB)),
            (vec![Primary, FlushAfter], Answer::Ok)
        );
        assert!(reveals_no_discard(
            nbd,
            Primary,
            &Err(FlashError::Unsupported)
        ));
        assert!(!reveals_no_discard(nbd, Primary, &Ok(0)));
        assert!(!reveals_no_discard(
            IoKind::Read,
            Primary,
            &Err(FlashError::Unsupported)
        ));
    }

    #[test]
    fn write_zeroes_discards_or_fills() {
        let punch = IoKind::WriteZeroes {
            fua: false,
            no_hole: false,
        };
        assert_eq!(
            run(punch, 3 * MIB, true, good(3 * MIB)),
            (vec![Primary], Answer::Ok)
        );
        // The device refuses to discard: zeroes are written, a run at a time.
        assert_eq!(
            run(punch, 3 * MIB, true, no_discard(3 * MIB)),
            (vec![Primary, zero(0), zero(MIB), zero(2 * MIB)], Answer::Ok)
        );
        assert_eq!(
            run(punch, 3 * MIB, false, good(3 * MIB)),
            (vec![zero(0), zero(MIB), zero(2 * MIB)], Answer::Ok)
        );
        let no_hole = IoKind::WriteZeroes {
            fua: true,
            no_hole: true,
        };
        // Shorter than a run: one write, then the flush FUA asks for.
        assert_eq!(run_bytes(no_hole, 8192, RUN), 8192);
        assert_eq!(
            run(no_hole, 8192, true, good(8192)),
            (vec![zero(0), FlushAfter], Answer::Ok)
        );
        // Longer than the maximum payload, not a multiple of the run.
        let length = 2 * MIB + 4096;
        assert_eq!(run_bytes(no_hole, length, RUN), RUN);
        let (steps, answer) = run(no_hole, length, true, good(length));
        assert_eq!(steps, vec![zero(0), zero(MIB), zero(2 * MIB), FlushAfter]);
        assert_eq!(answer, Answer::Ok);
        // A failure in the middle ends the request with that error.
        let (steps, answer) = run(no_hole, length, true, |step| match step {
            ZeroFill { written_bytes } if written_bytes == MIB => {
                Err(FlashError::Io { errno: libc::EIO })
            }
            other => good(length)(other),
        });
        assert_eq!(steps, vec![zero(0), zero(MIB)]);
        assert_eq!(answer, Answer::DeviceError { errno: libc::EIO });
        // A short zero write is an I/O error too.
        let (_, answer) = run(no_hole, length, true, |_| Ok(512));
        assert_eq!(answer, Answer::DeviceError { errno: libc::EIO });
    }
}
