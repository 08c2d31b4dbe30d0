//! The step logic against a model: requests run to their answer on a byte vector standing in
//! for the device, exactly as the dataplane drives them (payload into the run, edges merged
//! or zeroed after their read, parts sent in order), and the result is compared with what
//! the request means.

use super::*;

const MIB: u32 = 1 << 20;
const RUN: u32 = MIB;
const SECTOR: u32 = 512;

/// What happened while a request ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Step(IoStep),
    /// A WRITE received the payload of this part.
    Receive(u32),
    /// A READ sent this part before its last.
    Send(u32),
}

struct Outcome {
    events: Vec<Event>,
    answer: Answer,
    /// READ data sent, in order.
    sent: Vec<u8>,
}

/// A device: bytes, whether it discards, and a failure to inject.
struct Disk {
    bytes: Vec<u8>,
    discards: bool,
    fail: Option<(IoStep, Result<u32, FlashError>)>,
}

impl Disk {
    fn new(size_bytes: usize, seed: u64) -> Disk {
        Disk {
            bytes: pattern(seed, size_bytes),
            discards: true,
            fail: None,
        }
    }

    fn run_op(
        &mut self,
        step: IoStep,
        operation: Operation,
        run: &mut [u8],
    ) -> Result<u32, FlashError> {
        if let Some((failing, result)) = &self.fail
            && *failing == step
        {
            return result.clone();
        }
        match operation {
            Operation::Read {
                offset_bytes,
                length_bytes,
                buffer_start,
            } => {
                let (at, len) = (offset_bytes as usize, length_bytes as usize);
                let start = buffer_start as usize;
                assert_eq!(offset_bytes % u64::from(SECTOR), 0, "unaligned device read");
                assert_eq!(len % SECTOR as usize, 0);
                run[start..start + len].copy_from_slice(&self.bytes[at..at + len]);
                Ok(length_bytes)
            }
            Operation::Write {
                offset_bytes,
                length_bytes,
                buffer_start,
                ..
            } => {
                let (at, len) = (offset_bytes as usize, length_bytes as usize);
                let start = buffer_start as usize;
                assert_eq!(
                    offset_bytes % u64::from(SECTOR),
                    0,
                    "unaligned device write"
                );
                assert_eq!(len % SECTOR as usize, 0);
                self.bytes[at..at + len].copy_from_slice(&run[start..start + len]);
                Ok(length_bytes)
            }
            Operation::Flush => Ok(0),
            Operation::Discard {
                offset_bytes,
                length_bytes,
            } => {
                if !self.discards {
                    return Err(FlashError::Unsupported);
                }
                let at = offset_bytes as usize;
                self.bytes[at..at + length_bytes as usize].fill(0);
                Ok(0)
            }
        }
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Runs a request to its answer on `disk`, with runs of at most `run_max` bytes.
fn execute(
    kind: IoKind,
    offset: u64,
    payload_or_length: Payload<'_>,
    disk: &mut Disk,
    run_max: u32,
) -> Outcome {
    let length = match payload_or_length {
        Payload::Data(data) => data.len() as u32,
        Payload::Length(length) => length,
    };
    let layout = Layout::new(kind, offset, length, SECTOR, run_max);
    let run_bytes = layout.run_bytes(kind);
    assert!(
        run_bytes <= run_max as usize,
        "run of {run_bytes} over {run_max}"
    );
    // Garbage, so a byte the logic forgets to fill shows.
    let mut run = vec![0xEE; run_bytes];
    let mut events = Vec::new();
    let mut sent = Vec::new();
    let receive = |run: &mut Vec<u8>, events: &mut Vec<Event>, step: IoStep| {
        let part = layout.part(layout.receiving_part(step));
        let Payload::Data(data) = payload_or_length else {
            panic!("a payload for a request without one");
        };
        let from = (part.data_offset_bytes - offset) as usize;
        let (start, len) = (part.data_start as usize, part.data_bytes as usize);
        run[start..start + len].copy_from_slice(&data[from..from + len]);
        events.push(Event::Receive(layout.receiving_part(step)));
    };
    let mut step = match first_step(kind, &layout, disk.discards) {
        Start::Answer(answer) => {
            return Outcome {
                events,
                answer,
                sent,
            };
        }
        Start::Submit(step) => step,
        Start::Receive(step) => {
            receive(&mut run, &mut events, step);
            step
        }
    };
    let mut previous: Option<IoStep> = None;
    for _ in 0..100_000 {
        if step == (IoStep::ZeroFill { written_bytes: 0 })
            && !matches!(previous, Some(IoStep::ZeroFill { .. }))
        {
            run.fill(0);
        }
        events.push(Event::Step(step));
        let result = disk.run_op(step, operation(kind, &layout, step, run_bytes), &mut run);
        if result.is_ok()
            && let IoStep::EdgeRead { edge } = step
        {
            match kind {
                IoKind::Write { .. } => merge_edge(&layout, edge, &mut run),
                _ => zero_edge(&layout, edge, &mut run),
            }
        }
        previous = Some(step);
        match after_step(kind, &layout, step, run_bytes, disk.discards, &result) {
            Next::Continue(next) => step = next,
            Next::Receive(next) => {
                receive(&mut run, &mut events, next);
                step = next;
            }
            Next::Send { part } => {
                events.push(Event::Send(part));
                let part_data = layout.part(part);
                let start = part_data.data_start as usize;
                sent.extend_from_slice(&run[start..start + part_data.data_bytes as usize]);
                step = IoStep::Transfer { part: part + 1 };
            }
            Next::Done(answer) => {
                if answer.is_ok() && kind == IoKind::Read {
                    let last = layout.part(layout.part_count() - 1);
                    let start = last.data_start as usize;
                    sent.extend_from_slice(&run[start..start + last.data_bytes as usize]);
                }
                return Outcome {
                    events,
                    answer,
                    sent,
                };
            }
        }
    }
    panic!("request never finished: {events:?}");
}

#[derive(Clone, Copy)]
enum Payload<'a> {
    Data(&'a [u8]),
    Length(u32),
}

fn steps_of(events: &[Event]) -> Vec<IoStep> {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Step(step) => Some(*step),
            _ => None,
        })
        .collect()
}

use IoStep::{EdgeRead, EdgeWrite, FlushAfter, Primary, Transfer, ZeroFill};

fn zero(written_bytes: u32) -> IoStep {
    ZeroFill { written_bytes }
}

const WRITE: IoKind = IoKind::Write { fua: false };
const ZEROES: IoKind = IoKind::WriteZeroes {
    fua: false,
    no_hole: false,
    fast: false,
};

/// Checks a WRITE of `data` at `offset`: the disk holds it, every other byte is unchanged.
fn check_write(disk: &mut Disk, offset: u64, data: &[u8], run_max: u32) -> Vec<Event> {
    let mut expected = disk.bytes.clone();
    expected[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    let outcome = execute(WRITE, offset, Payload::Data(data), disk, run_max);
    assert_eq!(outcome.answer, Answer::Ok, "write {offset}+{}", data.len());
    let first_wrong = disk.bytes.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(
        first_wrong,
        None,
        "write {offset}+{}: disk differs",
        data.len()
    );
    outcome.events
}

/// Checks a READ: the bytes sent are the disk's.
fn check_read(disk: &mut Disk, offset: u64, length: u32, run_max: u32) -> Vec<Event> {
    let outcome = execute(IoKind::Read, offset, Payload::Length(length), disk, run_max);
    assert_eq!(outcome.answer, Answer::Ok);
    let expected = &disk.bytes[offset as usize..offset as usize + length as usize];
    assert!(
        outcome.sent == expected,
        "read {offset}+{length}: other bytes sent"
    );
    outcome.events
}

#[test]
fn single_operations() {
    let mut disk = Disk::new(1 << 20, 1);
    assert_eq!(
        check_read(&mut disk, 4096, 4096, RUN),
        vec![Event::Step(Transfer { part: 0 })]
    );
    let data = pattern(2, 4096);
    assert_eq!(
        check_write(&mut disk, 8192, &data, RUN),
        vec![Event::Receive(0), Event::Step(Transfer { part: 0 })]
    );
    let flush = execute(IoKind::Flush, 0, Payload::Length(1), &mut disk, RUN);
    assert_eq!(
        (steps_of(&flush.events), flush.answer),
        (vec![Primary], Answer::Ok)
    );
    // An aligned request needs no edges, and its run is exactly its data.
    let layout = Layout::new(WRITE, 8192, 4096, SECTOR, RUN);
    assert!(!layout.has_edges());
    assert_eq!(layout.run_bytes(WRITE), 4096);
    // Short transfers are I/O errors; device errors are passed on.
    disk.fail = Some((Transfer { part: 0 }, Ok(512)));
    let short = execute(IoKind::Read, 0, Payload::Length(4096), &mut disk, RUN);
    assert_eq!(short.answer, Answer::DeviceError { errno: libc::EIO });
    disk.fail = Some((
        Transfer { part: 0 },
        Err(FlashError::Io {
            errno: libc::ENOSPC,
        }),
    ));
    let failed = execute(WRITE, 0, Payload::Data(&data), &mut disk, RUN);
    assert_eq!(
        failed.answer,
        Answer::DeviceError {
            errno: libc::ENOSPC
        }
    );
}

#[test]
fn a_32_mib_read_and_write_go_in_parts_of_one_run() {
    let length = 32 * MIB;
    let mut disk = Disk::new(40 << 20, 3);
    // Aligned: 32 parts of 1 MiB, each sent before the next is read.
    let events = check_read(&mut disk, 4 * u64::from(MIB), length, RUN);
    let mut expected = Vec::new();
    for part in 0..32 {
        expected.push(Event::Step(Transfer { part }));
        if part < 31 {
            expected.push(Event::Send(part));
        }
    }
    assert_eq!(events, expected);
    // Unaligned: the enclosing sectors span one more part; the first and last send only
    // the bytes asked for.
    let events = check_read(&mut disk, 1_000_003, length, RUN);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::Send(_)))
            .count(),
        32
    );
    // A WRITE receives each part's payload, then writes it; the run never grows.
    let data = pattern(4, length as usize);
    let events = check_write(&mut disk, 2 * u64::from(MIB), &data, RUN);
    assert_eq!(events.len(), 64);
    assert_eq!(
        events[..2],
        [Event::Receive(0), Event::Step(Transfer { part: 0 })]
    );
    let data = pattern(5, length as usize);
    let events = check_write(&mut disk, 7_777_777, &data, RUN);
    // Read-modify-write: parts give the scratch page up, so there are 33 of them; the head
    // edge is read before part 0 is written and the tail edge before the last.
    let layout = Layout::new(WRITE, 7_777_777, length, SECTOR, RUN);
    assert_eq!(layout.part_count(), 33);
    assert_eq!(layout.run_bytes(WRITE), RUN as usize);
    assert_eq!(
        events[..3],
        [
            Event::Receive(0),
            Event::Step(EdgeRead { edge: Edge::Head }),
            Event::Step(Transfer { part: 0 })
        ]
    );
    assert_eq!(
        events[events.len() - 3..],
        [
            Event::Receive(32),
            Event::Step(EdgeRead { edge: Edge::Tail }),
            Event::Step(Transfer { part: 32 })
        ]
    );
    check_read(&mut disk, 7_777_777 - 5, length + 10, RUN);
}

#[test]
fn unaligned_writes_merge_the_bytes_around_them() {
    let mut disk = Disk::new(1 << 20, 6);
    // Inside one sector: one edge read covers both sides.
    let events = check_write(&mut disk, 1000, b"abc", RUN);
    assert_eq!(
        steps_of(&events),
        vec![EdgeRead { edge: Edge::Head }, Transfer { part: 0 }]
    );
    let layout = Layout::new(WRITE, 1000, 3, SECTOR, RUN);
    assert_eq!(
        layout.edge(Edge::Head),
        EdgeSector {
            sector_offset_bytes: 512,
            owned_start: 488,
            owned_end: 491,
        }
    );
    assert!(!layout.has_edge(Edge::Tail));
    // Across a sector boundary: both edges.
    let events = check_write(&mut disk, 1000, &pattern(7, 100), RUN);
    assert_eq!(
        steps_of(&events),
        vec![
            EdgeRead { edge: Edge::Head },
            EdgeRead { edge: Edge::Tail },
            Transfer { part: 0 }
        ]
    );
    // Aligned start, unaligned end: only the tail.
    let events = check_write(&mut disk, 4096, &pattern(8, 5000), RUN);
    assert_eq!(
        steps_of(&events),
        vec![EdgeRead { edge: Edge::Tail }, Transfer { part: 0 }]
    );
    // One byte at the very end of the device, and at its start.
    check_write(&mut disk, (1 << 20) - 1, b"z", RUN);
    check_write(&mut disk, 0, b"a", RUN);
    check_read(&mut disk, (1 << 20) - 3, 3, RUN);
    // A failed edge read ends the request before anything is written.
    let before = disk.bytes.clone();
    disk.fail = Some((
        EdgeRead { edge: Edge::Head },
        Err(FlashError::Io { errno: libc::EIO }),
    ));
    let failed = execute(WRITE, 77, Payload::Data(b"xyz"), &mut disk, RUN);
    assert_eq!(failed.answer, Answer::DeviceError { errno: libc::EIO });
    assert!(disk.bytes == before, "a failed read-modify-write wrote");
    disk.fail = Some((EdgeRead { edge: Edge::Head }, Ok(256)));
    let short = execute(WRITE, 77, Payload::Data(b"xyz"), &mut disk, RUN);
    assert_eq!(short.answer, Answer::DeviceError { errno: libc::EIO });
}

/// Many random requests with small runs (so they have many parts) and with real ones,
/// against the model.
#[test]
fn random_requests_match_the_model() {
    let size = 4 << 20;
    let mut disk = Disk::new(size, 9);
    let mut state = 0x1234_5678_9abc_def1u64;
    let mut next = |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    for round in 0..3000u64 {
        let run_max = [8192, 16384, 65536, RUN][(round % 4) as usize];
        let length = 1 + next(if round % 5 == 0 { 300_000 } else { 3000 }) as u32;
        let offset = next(size as u64 - u64::from(length));
        let layout = Layout::new(WRITE, offset, length, SECTOR, run_max);
        // Parts tile the aligned span and the request's bytes exactly.
        let mut device_at = layout.aligned_start();
        let mut data_at = offset;
        for index in 0..layout.part_count() {
            let part = layout.part(index);
            assert_eq!(part.device_offset_bytes, device_at);
            assert_eq!(part.data_offset_bytes, data_at);
            assert!(part.data_start + part.data_bytes <= part.device_bytes);
            assert!((part.device_bytes as usize) <= layout.run_bytes(WRITE));
            device_at += u64::from(part.device_bytes);
            data_at += u64::from(part.data_bytes);
        }
        assert_eq!(device_at, layout.aligned_end());
        assert_eq!(data_at, offset + u64::from(length));
        match round % 3 {
            0 => {
                check_read(&mut disk, offset, length, run_max);
            }
            1 => {
                let data = pattern(round, length as usize);
                check_write(&mut disk, offset, &data, run_max);
            }
            _ => {
                let mut expected = disk.bytes.clone();
                expected[offset as usize..(offset + u64::from(length)) as usize].fill(0);
                disk.discards = round % 2 == 0;
                let outcome = execute(ZEROES, offset, Payload::Length(length), &mut disk, run_max);
                disk.discards = true;
                assert_eq!(outcome.answer, Answer::Ok);
                assert!(disk.bytes == expected, "write zeroes {offset}+{length}");
            }
        }
    }
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
    let mut disk = Disk::new(4 << 20, 10);
    let trim = |disk: &mut Disk, kind, offset, length| {
        let outcome = execute(kind, offset, Payload::Length(length), disk, RUN);
        (steps_of(&outcome.events), outcome.answer)
    };
    assert_eq!(trim(&mut disk, nbd, 0, MIB), (vec![Primary], Answer::Ok));
    assert!(disk.bytes[..MIB as usize].iter().all(|&b| b == 0));
    // Unaligned: only the sectors covered whole are discarded; the edges keep their bytes.
    let before = disk.bytes.clone();
    assert_eq!(
        trim(&mut disk, nbd, MIB as u64 + 100, 2000),
        (vec![Primary], Answer::Ok)
    );
    let m = MIB as usize;
    assert!(disk.bytes[m..m + 512] == before[m..m + 512]);
    assert!(disk.bytes[m + 512..m + 2048].iter().all(|&b| b == 0));
    assert!(disk.bytes[m + 2048..m + 2560] == before[m + 2048..m + 2560]);
    // Nothing covered whole: nothing to do.
    assert_eq!(
        trim(&mut disk, nbd, MIB as u64 + 3000, 100),
        (vec![], Answer::Ok)
    );
    disk.discards = false;
    assert_eq!(trim(&mut disk, nbd, 0, MIB), (vec![], Answer::Ok));
    disk.discards = true;
    disk.fail = Some((Primary, Err(FlashError::Unsupported)));
    assert_eq!(trim(&mut disk, nbd, 0, MIB), (vec![Primary], Answer::Ok));
    assert_eq!(
        trim(&mut disk, native, 0, MIB),
        (vec![Primary], Answer::Unsupported)
    );
    disk.fail = None;
    let fua = IoKind::Trim {
        fua: true,
        hint: true,
    };
    assert_eq!(
        trim(&mut disk, fua, 0, MIB),
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
        Transfer { part: 0 },
        &Err(FlashError::Unsupported)
    ));
}

#[test]
fn write_zeroes_discards_or_fills_and_zeroes_unaligned_edges() {
    let mut disk = Disk::new(8 << 20, 11);
    let zeroes = |disk: &mut Disk, kind, offset, length| {
        let outcome = execute(kind, offset, Payload::Length(length), disk, RUN);
        (steps_of(&outcome.events), outcome.answer)
    };
    assert_eq!(
        zeroes(&mut disk, ZEROES, 0, 3 * MIB),
        (vec![Primary], Answer::Ok)
    );
    // The device refuses to discard: zeroes are written, a run at a time.
    disk.fail = Some((Primary, Err(FlashError::Unsupported)));
    assert_eq!(
        zeroes(&mut disk, ZEROES, 0, 3 * MIB),
        (vec![Primary, zero(0), zero(MIB), zero(2 * MIB)], Answer::Ok)
    );
    disk.fail = None;
    disk.discards = false;
    assert_eq!(
        zeroes(&mut disk, ZEROES, 0, 3 * MIB),
        (vec![zero(0), zero(MIB), zero(2 * MIB)], Answer::Ok)
    );
    disk.discards = true;
    let no_hole = IoKind::WriteZeroes {
        fua: true,
        no_hole: true,
        fast: false,
    };
    // Shorter than a run: one write, then the flush FUA asks for.
    assert_eq!(
        Layout::new(no_hole, 0, 8192, SECTOR, RUN).run_bytes(no_hole),
        8192
    );
    assert_eq!(
        zeroes(&mut disk, no_hole, 0, 8192),
        (vec![zero(0), FlushAfter], Answer::Ok)
    );
    // Longer than the maximum payload, not a multiple of the run.
    let length = 2 * MIB + 4096;
    assert_eq!(
        Layout::new(no_hole, 0, length, SECTOR, RUN).run_bytes(no_hole),
        RUN as usize
    );
    assert_eq!(
        zeroes(&mut disk, no_hole, 0, length),
        (
            vec![zero(0), zero(MIB), zero(2 * MIB), FlushAfter],
            Answer::Ok
        )
    );
    // Unaligned: each edge sector is read, zeroed where the request owns it and written
    // back; then the middle as usual.
    let before = disk.bytes.clone();
    let (steps, answer) = zeroes(&mut disk, ZEROES, 5 * u64::from(MIB) + 100, 10_000);
    assert_eq!(
        steps,
        vec![
            EdgeRead { edge: Edge::Head },
            EdgeWrite { edge: Edge::Head },
            EdgeRead { edge: Edge::Tail },
            EdgeWrite { edge: Edge::Tail },
            Primary
        ]
    );
    assert_eq!(answer, Answer::Ok);
    let at = 5 * MIB as usize;
    assert!(disk.bytes[at..at + 100] == before[at..at + 100]);
    assert!(disk.bytes[at + 100..at + 10_100].iter().all(|&b| b == 0));
    assert!(disk.bytes[at + 10_100..at + 10_240] == before[at + 10_100..at + 10_240]);
    // A failure in the middle ends the request with that error.
    disk.fail = Some((zero(MIB), Err(FlashError::Io { errno: libc::EIO })));
    let (steps, answer) = zeroes(&mut disk, no_hole, 0, length);
    assert_eq!(steps, vec![zero(0), zero(MIB)]);
    assert_eq!(answer, Answer::DeviceError { errno: libc::EIO });
    // A short zero write is an I/O error too.
    disk.fail = Some((zero(0), Ok(512)));
    let (_, answer) = zeroes(&mut disk, no_hole, 0, length);
    assert_eq!(answer, Answer::DeviceError { errno: libc::EIO });
}

#[test]
fn fast_zero_fails_fast_where_zeroing_would_write() {
    let fast = IoKind::WriteZeroes {
        fua: false,
        no_hole: false,
        fast: true,
    };
    let fast_no_hole = IoKind::WriteZeroes {
        fua: false,
        no_hole: true,
        fast: true,
    };
    let not_supported = Answer::Nbd(Errno::NotSup);
    let mut disk = Disk::new(4 << 20, 12);
    let zeroes = |disk: &mut Disk, kind, offset, length| {
        let outcome = execute(kind, offset, Payload::Length(length), disk, RUN);
        (steps_of(&outcome.events), outcome.answer)
    };
    // A discard is fast.
    assert_eq!(zeroes(&mut disk, fast, 0, MIB), (vec![Primary], Answer::Ok));
    // Writes would be needed: refused before touching anything.
    let before = disk.bytes.clone();
    assert_eq!(
        zeroes(&mut disk, fast_no_hole, 0, MIB),
        (vec![], not_supported)
    );
    assert_eq!(
        zeroes(&mut disk, fast, MIB as u64 + 1, 4096),
        (vec![], not_supported)
    );
    disk.discards = false;
    assert_eq!(zeroes(&mut disk, fast, 0, MIB), (vec![], not_supported));
    disk.discards = true;
    // The device refuses the discard: no fallback to writing.
    disk.fail = Some((Primary, Err(FlashError::Unsupported)));
    assert_eq!(
        zeroes(&mut disk, fast, MIB as u64, MIB),
        (vec![Primary], not_supported)
    );
    assert!(disk.bytes == before, "a refused fast zero changed the disk");
}
