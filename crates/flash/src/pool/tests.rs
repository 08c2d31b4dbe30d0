//! The ring-less file queue on real files: data written through the pool reads back, FUA,
//! FLUSH and TRIM do what the ring does, many operations in flight all complete once, the
//! thread is notified, and the fault wrapper works over it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reflex_qos::Nanos;

use crate::aligned::AlignedBuf;
use crate::fault::{FaultDevice, FaultPlan};
use crate::file::FileDevice;
use crate::{Completion, Device, DeviceOp, DeviceQueue, FlashError, Notify, OpKind, Submit};

const FILE_SIZE_BYTES: u64 = 8 << 20;
/// How long a test waits for the pool before it fails (the operations take microseconds).
const WAIT_MAX: Duration = Duration::from_secs(20);

#[derive(Default)]
struct CountingNotify {
    count: AtomicUsize,
}

impl Notify for CountingNotify {
    fn notify(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    device: Arc<FileDevice>,
    notify: Arc<CountingNotify>,
}

fn setup(read_only_copy: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("ns");
    if read_only_copy {
        std::fs::write(&path, vec![0x5Au8; FILE_SIZE_BYTES as usize])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let size = (!read_only_copy).then_some(FILE_SIZE_BYTES);
    let device = FileDevice::open(&path, size, read_only_copy).unwrap_or_else(|e| panic!("{e}"));
    Setup {
        _dir: dir,
        device: Arc::new(device),
        notify: Arc::new(CountingNotify::default()),
    }
}

/// A ring-less queue on `device`.
///
/// Every test keeps the buffers it submits alive until their completions have been drained
/// (it waits for all of them before the buffers go out of scope).
fn queue(device: &dyn Device, notify: &Arc<CountingNotify>) -> Box<dyn DeviceQueue> {
    let notify: Arc<dyn Notify> = Arc::clone(notify) as Arc<dyn Notify>;
    // SAFETY: see above: buffers outlive their operations in every test of this module.
    unsafe { device.queue_without_ring(notify) }
}

fn op(user_data: u64, kind: OpKind<'_>) -> DeviceOp<'_> {
    DeviceOp {
        user_data,
        kind,
        buf_index: None,
        queue: 0,
    }
}

/// Submits and returns `Some(result)` when done at once, `None` when pending.
fn submit(queue: &mut dyn DeviceQueue, op: DeviceOp<'_>) -> Option<Result<u32, FlashError>> {
    match queue.submit(op, Nanos::ZERO) {
        Submit::Done(result) => Some(result),
        Submit::Pending => None,
        Submit::Ring(_) => panic!("a ring-less queue returned a ring entry"),
    }
}

/// Polls until `count` completions came out; then the queue has nothing left to report.
fn wait_for(queue: &mut dyn DeviceQueue, count: usize, now: Nanos) -> Vec<Completion> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < count {
        queue.poll_completions(now, &mut out);
        if out.len() == count {
            break;
        }
        assert!(
            started.elapsed() < WAIT_MAX,
            "{} of {count} completions after {WAIT_MAX:?}",
            out.len()
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(out.len(), count, "more completions than operations");
    assert_eq!(queue.next_deadline(), None, "nothing left to wait for");
    out
}

/// One operation to completion: done at once or through the pool.
fn run(queue: &mut dyn DeviceQueue, op: DeviceOp<'_>) -> Result<u32, FlashError> {
    let user_data = op.user_data;
    if let Some(result) = submit(queue, op) {
        return result;
    }
    let completions = wait_for(queue, 1, Nanos::ZERO);
    assert_eq!(completions[0].user_data, user_data);
    completions[0].result.clone()
}

fn filled(byte: u8, len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::new_zeroed(len);
    buf.as_mut_slice().fill(byte);
    buf
}

#[test]
fn writes_read_back_and_flush_fua_and_trim_work_without_a_ring() {
    let setup = setup(false);
    let mut queue = queue(setup.device.as_ref(), &setup.notify);
    let queue = queue.as_mut();
    let first = filled(0xA1, 64 << 10);
    let second = filled(0xB2, 4096);
    let written = run(
        queue,
        op(
            1,
            OpKind::Write {
                offset: 1 << 20,
                buf: first.as_slice(),
                fua: false,
            },
        ),
    );
    assert_eq!(written, Ok(64 << 10));
    let written = run(
        queue,
        op(
            2,
            OpKind::Write {
                offset: 4096,
                buf: second.as_slice(),
                fua: true,
            },
        ),
    );
    assert_eq!(written, Ok(4096));
    assert_eq!(run(queue, op(3, OpKind::Flush)), Ok(0));

    let mut back = AlignedBuf::new_zeroed(64 << 10);
    let read = run(
        queue,
        op(
            4,
            OpKind::Read {
                offset: 1 << 20,
                buf: back.as_mut_slice(),
            },
        ),
    );
    assert_eq!(read, Ok(64 << 10));
    assert!(back.as_slice().iter().all(|&b| b == 0xA1));

    let trimmed = run(
        queue,
        op(
            5,
            OpKind::Trim {
                offset: 1 << 20,
                len: 32 << 10,
            },
        ),
    );
    assert_eq!(trimmed, Ok(0));
    let read = run(
        queue,
        op(
            6,
            OpKind::Read {
                offset: 1 << 20,
                buf: back.as_mut_slice(),
            },
        ),
    );
    assert_eq!(read, Ok(64 << 10));
    assert!(back.as_slice()[..32 << 10].iter().all(|&b| b == 0));
    assert!(back.as_slice()[32 << 10..].iter().all(|&b| b == 0xA1));

    // Each completion waited alone here, so each one woke the thread once.
    let notified = setup.notify.count.load(Ordering::Relaxed);
    assert!((1..=6).contains(&notified), "notified {notified} times");
    // And the bytes are in the file, for any reader.
    let file = std::fs::read(setup._dir.path().join("ns")).unwrap_or_else(|e| panic!("{e}"));
    assert!(file[4096..8192].iter().all(|&b| b == 0xB2));
}

#[test]
fn many_operations_in_flight_complete_once_each() {
    let setup = setup(false);
    let mut queue = queue(setup.device.as_ref(), &setup.notify);
    let queue = queue.as_mut();
    // More operations than the job channel holds, so the backlog is exercised when the
    // workers fall behind.
    let count = 3000usize;
    let block = 512usize;
    let mut source = AlignedBuf::new_zeroed(count * block);
    for (index, chunk) in source.as_mut_slice().chunks_mut(block).enumerate() {
        chunk.fill((index % 251) as u8);
    }
    let mut pending = 0;
    for (index, chunk) in source.as_slice().chunks(block).enumerate() {
        let kind = OpKind::Write {
            offset: (index * block) as u64,
            buf: chunk,
            fua: false,
        };
        if let Some(result) = submit(queue, op(index as u64, kind)) {
            panic!("a pool write finished at once: {result:?}");
        }
        pending += 1;
    }
    let completions = wait_for(queue, pending, Nanos::ZERO);
    let seen: BTreeSet<u64> = completions.iter().map(|c| c.user_data).collect();
    assert_eq!(seen.len(), count, "each operation completes exactly once");
    assert!(completions.iter().all(|c| c.result == Ok(block as u32)));

    let mut back = AlignedBuf::new_zeroed(count * block);
    let mut pending = 0;
    for (index, chunk) in back.as_mut_slice().chunks_mut(block).enumerate() {
        let kind = OpKind::Read {
            offset: (index * block) as u64,
            buf: chunk,
        };
        match submit(queue, op(index as u64, kind)) {
            None => pending += 1,
            Some(result) => assert_eq!(result, Ok(block as u32)),
        }
    }
    let completions = wait_for(queue, pending, Nanos::ZERO);
    assert!(completions.iter().all(|c| c.result == Ok(block as u32)));
    assert!(back.as_slice() == source.as_slice());
    let notified = setup.notify.count.load(Ordering::Relaxed);
    assert!((1..=2 * count).contains(&notified), "notified {notified}");
}

#[test]
fn a_read_only_file_refuses_writes_and_trims_without_a_ring() {
    let setup = setup(true);
    let mut queue = queue(setup.device.as_ref(), &setup.notify);
    let queue = queue.as_mut();
    let buf = filled(0xEE, 4096);
    let erofs = Some(Err(FlashError::Io { errno: libc::EROFS }));
    let write = OpKind::Write {
        offset: 0,
        buf: buf.as_slice(),
        fua: true,
    };
    assert_eq!(submit(queue, op(1, write)), erofs);
    let trim = OpKind::Trim {
        offset: 0,
        len: 4096,
    };
    assert_eq!(submit(queue, op(2, trim)), erofs);
    let mut back = AlignedBuf::new_zeroed(4096);
    let read = OpKind::Read {
        offset: 4096,
        buf: back.as_mut_slice(),
    };
    assert_eq!(run(queue, op(3, read)), Ok(4096));
    assert!(back.as_slice().iter().all(|&b| b == 0x5A));
}

#[test]
fn the_fault_wrapper_delays_pool_completions() {
    let setup = setup(false);
    let plan = FaultPlan::parse("delay=1ms;short_rate=0").unwrap_or_else(|e| panic!("{e}"));
    let inner: Arc<dyn Device> = Arc::clone(&setup.device) as Arc<dyn Device>;
    let device = FaultDevice::new(inner, plan).unwrap_or_else(|e| panic!("{e}"));
    let mut queue = queue(&device, &setup.notify);
    let queue = queue.as_mut();
    let buf = filled(0x42, 4096);
    let write = OpKind::Write {
        offset: 8192,
        buf: buf.as_slice(),
        fua: false,
    };
    assert_eq!(submit(queue, op(9, write)), None);
    // The pool finishes the write; the wrapper holds its completion for the delay.
    let started = Instant::now();
    let mut out = Vec::new();
    while queue.next_deadline() != Some(Nanos::from_millis(1)) {
        assert!(started.elapsed() < WAIT_MAX, "the write never came back");
        queue.poll_completions(Nanos::ZERO, &mut out);
        std::thread::sleep(Duration::from_micros(100));
    }
    assert!(out.is_empty(), "held until its due time");
    queue.poll_completions(Nanos::from_millis(1), &mut out);
    assert_eq!(
        out,
        vec![Completion {
            user_data: 9,
            result: Ok(4096)
        }]
    );
}
