//! Fault injection over real devices: memory and the emulated device here, a real file
//! through a real io_uring in `ring` below.

use std::sync::Arc;

use reflex_qos::Nanos;

use super::*;
use crate::emu::EmuFlash;
use crate::mem::MemDevice;

const MEM_SIZE_BYTES: u64 = 1 << 20;
const BLOCK: usize = 512;

fn plan(params: &str) -> FaultPlan {
    FaultPlan::parse(params).unwrap_or_else(|e| panic!("{params}: {e}"))
}

fn mem() -> Arc<MemDevice> {
    Arc::new(MemDevice::new(MEM_SIZE_BYTES).unwrap_or_else(|e| panic!("{e}")))
}

fn wrap(inner: Arc<dyn Device>, plan: FaultPlan) -> FaultDevice {
    FaultDevice::new(inner, plan).unwrap_or_else(|e| panic!("{e}"))
}

fn over_mem(params: &str) -> FaultDevice {
    wrap(mem(), plan(params))
}

fn op(user_data: u64, kind: OpKind<'_>) -> DeviceOp<'_> {
    DeviceOp {
        user_data,
        kind,
        buf_index: None,
        queue: 0,
    }
}

/// `Some(result)` for `Submit::Done`, `None` for `Submit::Pending`.
fn submitted(submit: Submit) -> Option<Result<u32, FlashError>> {
    match submit {
        Submit::Done(result) => Some(result),
        Submit::Pending => None,
        #[cfg(feature = "uring")]
        Submit::Ring(_) => panic!("memory devices never use the ring"),
    }
}

fn read(
    queue: &mut dyn DeviceQueue,
    user_data: u64,
    offset: u64,
    buf: &mut [u8],
    now: Nanos,
) -> Option<Result<u32, FlashError>> {
    submitted(queue.submit(op(user_data, OpKind::Read { offset, buf }), now))
}

fn write(
    queue: &mut dyn DeviceQueue,
    user_data: u64,
    offset: u64,
    buf: &[u8],
    now: Nanos,
) -> Option<Result<u32, FlashError>> {
    let kind = OpKind::Write {
        offset,
        buf,
        fua: false,
    };
    submitted(queue.submit(op(user_data, kind), now))
}

fn poll(queue: &mut dyn DeviceQueue, now: Nanos) -> Vec<Completion> {
    let mut out = Vec::new();
    queue.poll_completions(now, &mut out);
    out
}

const EIO: Result<u32, FlashError> = Err(FlashError::Io { errno: libc::EIO });

/// Which of `count` one-block reads failed, for a plan.
fn read_failures(params: &str, count: u64) -> Vec<bool> {
    let device = over_mem(params);
    let mut queue = device.queue();
    let mut buf = [0u8; BLOCK];
    (0..count)
        .map(|index| {
            let offset = (index % 2048) * BLOCK as u64;
            match read(queue.as_mut(), index, offset, &mut buf, Nanos(index)) {
                Some(Ok(bytes)) => {
                    assert_eq!(bytes, BLOCK as u32);
                    false
                }
                Some(Err(FlashError::Io { errno })) => {
                    assert_eq!(errno, libc::EIO);
                    true
                }
                other => panic!("read {index}: {other:?}"),
            }
        })
        .collect()
}

#[test]
fn error_rate_is_deterministic_for_a_seed_and_near_the_rate() {
    let count = 20_000;
    let first = read_failures("read_error_rate=0.05,seed=42", count);
    let again = read_failures("read_error_rate=0.05,seed=42", count);
    assert_eq!(first, again, "the same seed fails the same operations");
    let other_seed = read_failures("read_error_rate=0.05,seed=43", count);
    assert_ne!(first, other_seed);
    let failed = first.iter().filter(|failed| **failed).count() as f64;
    let rate = failed / count as f64;
    // Binomial standard deviation is 0.0015 here; 0.01 is more than six of them.
    assert!((0.04..=0.06).contains(&rate), "observed rate {rate}");
    // Another rate of another kind draws from the same numbers: read errors do not move.
    let with_short = read_failures("read_error_rate=0.05,seed=42,short_rate=0", count);
    assert_eq!(first, with_short);
    assert!(read_failures("", 1000).iter().all(|failed| !failed));
    assert!(
        read_failures("read_error_rate=100%", 1000)
            .iter()
            .all(|failed| *failed)
    );
}

#[test]
fn lba_range_errors_hit_exactly_the_range() {
    let device = over_mem("write_error_lba=8-15,trim_error_lba=100");
    let mut queue = device.queue();
    let block = [7u8; BLOCK];
    for lba in 0..64u64 {
        let result = write(queue.as_mut(), lba, lba * BLOCK as u64, &block, Nanos(lba));
        let expected = if (8..=15).contains(&lba) {
            EIO
        } else {
            Ok(BLOCK as u32)
        };
        assert_eq!(result, Some(expected), "lba {lba}");
    }
    // Multi-block operations fail when any block overlaps, and only then.
    let two_blocks = [1u8; 2 * BLOCK];
    assert_eq!(
        write(
            queue.as_mut(),
            100,
            7 * BLOCK as u64,
            &two_blocks,
            Nanos(100)
        ),
        Some(EIO)
    );
    assert_eq!(
        write(
            queue.as_mut(),
            101,
            16 * BLOCK as u64,
            &two_blocks,
            Nanos(101)
        ),
        Some(Ok(2 * BLOCK as u32))
    );
    assert_eq!(
        write(
            queue.as_mut(),
            102,
            6 * BLOCK as u64,
            &two_blocks,
            Nanos(102)
        ),
        Some(Ok(2 * BLOCK as u32))
    );
    // Reads of the range are untouched; trims fail on their own range only.
    let mut back = [0u8; BLOCK];
    assert_eq!(
        read(queue.as_mut(), 103, 8 * BLOCK as u64, &mut back, Nanos(103)),
        Some(Ok(BLOCK as u32))
    );
    let trim = |offset: u64, len: u64| OpKind::Trim { offset, len };
    let trimmed = queue.submit(
        op(104, trim(99 * BLOCK as u64, 2 * BLOCK as u64)),
        Nanos(104),
    );
    assert_eq!(submitted(trimmed), Some(EIO));
    let trimmed = queue.submit(
        op(105, trim(101 * BLOCK as u64, 4 * BLOCK as u64)),
        Nanos(105),
    );
    assert_eq!(submitted(trimmed), Some(Ok(0)));
    assert_eq!(device.controls().counts().errors_injected, 8 + 1 + 1);
}

#[test]
fn refused_writes_do_not_change_the_inner_data() {
    let inner = mem();
    let device = wrap(inner.clone(), plan("write_error_rate=1,errno=ENOSPC"));
    let mut direct = inner.queue();
    let mut faulty = device.queue();
    let old = [0xAAu8; 4096];
    assert_eq!(
        write(direct.as_mut(), 1, 8192, &old, Nanos::ZERO),
        Some(Ok(4096))
    );
    let new = [0x55u8; 4096];
    assert_eq!(
        write(faulty.as_mut(), 2, 8192, &new, Nanos(1)),
        Some(Err(FlashError::Io {
            errno: libc::ENOSPC
        }))
    );
    let mut back = [0u8; 4096];
    assert_eq!(
        read(direct.as_mut(), 3, 8192, &mut back, Nanos(2)),
        Some(Ok(4096))
    );
    assert_eq!(back, old);
    // Delayed or stalled, a refused write still never reaches the device.
    device
        .controls()
        .set_plan(plan("write_error_rate=1,delay=1ms,stall"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(write(faulty.as_mut(), 4, 8192, &new, Nanos(3)), None);
    device.controls().set_stalled(false);
    let done = poll(faulty.as_mut(), Nanos(3) + Nanos::from_millis(1));
    assert_eq!(
        done,
        [Completion {
            user_data: 4,
            result: EIO
        }]
    );
    assert_eq!(
        read(direct.as_mut(), 5, 8192, &mut back, Nanos::from_secs(1)),
        Some(Ok(4096))
    );
    assert_eq!(back, old);
}

#[test]
fn delays_complete_at_the_right_virtual_time() {
    let device = over_mem("delay=5ms,delay_every=2");
    let mut queue = device.queue();
    let mut buf = [0u8; 4096];
    let start = Nanos::from_millis(100);
    assert_eq!(
        read(queue.as_mut(), 1, 0, &mut buf, start),
        Some(Ok(4096)),
        "the first operation is not delayed"
    );
    assert_eq!(queue.next_deadline(), None);
    let second_at = start + Nanos::from_millis(1);
    assert_eq!(read(queue.as_mut(), 2, 0, &mut buf, second_at), None);
    let due = second_at + Nanos::from_millis(5);
    assert_eq!(queue.next_deadline(), Some(due));
    assert_eq!(poll(queue.as_mut(), due - Nanos(1)), []);
    assert_eq!(
        poll(queue.as_mut(), due),
        [Completion {
            user_data: 2,
            result: Ok(4096)
        }]
    );
    assert_eq!(queue.next_deadline(), None);
    assert_eq!(device.controls().counts().completions_delayed, 1);
}

#[test]
fn delays_add_to_a_device_that_completes_later() {
    let emu = EmuFlash::open("device-a-small", 64 << 20).unwrap_or_else(|e| panic!("{e}"));
    let device = wrap(Arc::new(emu), plan("delay=1ms"));
    let mut queue = device.queue();
    let mut buf = [0u8; 4096];
    assert_eq!(read(queue.as_mut(), 9, 4096, &mut buf, Nanos::ZERO), None);
    let Some(model_due) = queue.next_deadline() else {
        panic!("the model has a completion pending");
    };
    assert!(model_due > Nanos::ZERO);
    assert_eq!(poll(queue.as_mut(), model_due), [], "held for the delay");
    let due = model_due + Nanos::from_millis(1);
    assert_eq!(queue.next_deadline(), Some(due));
    assert_eq!(poll(queue.as_mut(), due - Nanos(1)), []);
    assert_eq!(
        poll(queue.as_mut(), due),
        [Completion {
            user_data: 9,
            result: Ok(4096)
        }]
    );
}

#[test]
fn a_stall_holds_everything_and_release_delivers_all() {
    let device = wrap(mem(), plan("stall,flush_error_rate=1"));
    let controls = device.controls();
    assert!(controls.is_stalled());
    let mut queue = device.queue();
    let data = [3u8; 4096];
    let mut buf = [0u8; 4096];
    for index in 0..8u64 {
        assert_eq!(
            write(queue.as_mut(), index, index * 4096, &data, Nanos(index)),
            None
        );
    }
    assert_eq!(read(queue.as_mut(), 8, 0, &mut buf, Nanos(8)), None);
    assert_eq!(
        buf, data,
        "the inner device did the work; only the answer waits"
    );
    let flush = queue.submit(op(9, OpKind::Flush), Nanos(9));
    assert_eq!(submitted(flush), None, "injected errors wait too");
    for later in [1u64, 1_000, 1_000_000_000] {
        assert_eq!(poll(queue.as_mut(), Nanos(later)), []);
    }
    // Stalled with something held: polled every STALL_RECHECK to see a lift.
    assert_eq!(
        queue.next_deadline(),
        Some(Nanos(1_000_000_000) + STALL_RECHECK)
    );
    assert_eq!(controls.counts().completions_stalled, 10);
    controls.set_stalled(false);
    let done = poll(queue.as_mut(), Nanos(1_000_000_001));
    let user_data: Vec<u64> = done.iter().map(|c| c.user_data).collect();
    assert_eq!(user_data, (0..10).collect::<Vec<u64>>(), "in arrival order");
    for completion in &done[..9] {
        assert_eq!(completion.result, Ok(4096));
    }
    assert_eq!(done[9].result, EIO);
    assert_eq!(queue.next_deadline(), None);
    assert_eq!(poll(queue.as_mut(), Nanos(1_000_000_002)), []);
}

#[test]
fn without_stall_recheck_a_stalled_queue_asks_for_no_poll_and_a_lift_is_seen_at_the_next() {
    let device = wrap(mem(), plan("stall")).without_stall_recheck();
    let controls = device.controls();
    let mut queue = device.queue();
    let data = [5u8; 4096];
    assert_eq!(write(queue.as_mut(), 1, 0, &data, Nanos(1)), None);
    assert_eq!(poll(queue.as_mut(), Nanos(2)), []);
    assert_eq!(queue.next_deadline(), None, "no recheck while stalled");
    controls.set_stalled(false);
    // The held completion is due already: the next poll releases it.
    assert!(queue.next_deadline().is_some_and(|due| due <= Nanos(3)));
    let done = poll(queue.as_mut(), Nanos(3));
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(4096));
    assert_eq!(queue.next_deadline(), None);
}

#[test]
fn short_completions_report_fewer_bytes() {
    let inner = mem();
    let device = wrap(inner.clone(), plan("short_rate=1"));
    let mut queue = device.queue();
    let data = [9u8; 4096];
    assert_eq!(
        write(queue.as_mut(), 1, 0, &data, Nanos::ZERO),
        Some(Ok(2048))
    );
    let mut back = [0u8; 4096];
    assert_eq!(
        read(inner.queue().as_mut(), 2, 0, &mut back, Nanos::ZERO),
        Some(Ok(4096))
    );
    assert_eq!(back, data, "a short write still moved every byte");
    assert_eq!(
        read(queue.as_mut(), 3, 0, &mut back, Nanos::ZERO),
        Some(Ok(2048))
    );
    let mut one_block = [0u8; BLOCK];
    assert_eq!(
        read(queue.as_mut(), 4, 0, &mut one_block, Nanos::ZERO),
        Some(Ok(0))
    );
    assert_eq!(
        submitted(queue.submit(op(5, OpKind::Flush), Nanos::ZERO)),
        Some(Ok(0)),
        "flush moves no bytes to shorten"
    );
    assert_eq!(device.controls().counts().completions_shortened, 3);
}

#[test]
fn a_plan_switched_at_run_time_takes_effect_for_the_next_operation() {
    let device: Arc<dyn Device> = Arc::new(over_mem(""));
    let Some(controls) = device.fault_controls() else {
        panic!("reachable from Arc<dyn Device>");
    };
    let mut queue = device.queue();
    let mut buf = [0u8; BLOCK];
    assert_eq!(
        read(queue.as_mut(), 1, 0, &mut buf, Nanos(1)),
        Some(Ok(512))
    );
    controls
        .set_plan(plan("read_error_rate=1,errno=ETIMEDOUT"))
        .unwrap_or_else(|e| panic!("{e}"));
    let timed_out = Err(FlashError::Io {
        errno: libc::ETIMEDOUT,
    });
    assert_eq!(
        read(queue.as_mut(), 2, 0, &mut buf, Nanos(2)),
        Some(timed_out)
    );
    // A delay decided under one plan survives the next plan.
    controls
        .set_plan(plan("delay=1ms"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read(queue.as_mut(), 3, 0, &mut buf, Nanos(3)), None);
    controls.clear();
    assert!(controls.plan().is_empty());
    assert_eq!(
        read(queue.as_mut(), 4, 0, &mut buf, Nanos(4)),
        Some(Ok(512))
    );
    assert_eq!(
        poll(queue.as_mut(), Nanos(3) + Nanos::from_millis(1)),
        [Completion {
            user_data: 3,
            result: Ok(512)
        }]
    );
    // A queue created after the change starts with the plan in force.
    controls.set_stalled(true);
    let mut late = device.queue();
    assert_eq!(read(late.as_mut(), 5, 0, &mut buf, Nanos(5)), None);
    controls.set_stalled(false);
    assert_eq!(poll(late.as_mut(), Nanos(5)).len(), 1);
    // An invalid plan is refused and the old one stays.
    let mut invalid = FaultPlan::default();
    invalid.read.error_rate = 1.5;
    assert!(controls.set_plan(invalid).is_err());
    assert!(controls.plan().is_empty());
}

#[test]
fn queues_draw_from_different_streams() {
    let device = over_mem("read_error_rate=0.5,seed=1");
    let mut first = device.queue();
    let mut second = device.queue();
    let mut buf = [0u8; BLOCK];
    let mut outcomes = |queue: &mut dyn DeviceQueue| -> Vec<bool> {
        (0..256)
            .map(|index| read(queue, index, 0, &mut buf, Nanos(index)) == Some(EIO))
            .collect()
    };
    assert_ne!(outcomes(first.as_mut()), outcomes(second.as_mut()));
}

#[test]
fn plans_round_trip_through_their_text() {
    for text in [
        "",
        "read_error_rate=0.01",
        "write_error_lba=0-2047;errno=ENOSPC",
        "read_error_rate=0.5;read_error_lba=3-3;flush_error_rate=1;trim_error_lba=0-9;errno=77",
        "delay=5ms;delay_every=100",
        "delay=250us;delay_rate=0.25",
        "delay=1s",
        "delay=7ns",
        "short_rate=0.001;stall;seed=99",
    ] {
        let parsed = plan(text);
        assert_eq!(parsed.to_string(), text);
        assert_eq!(plan(&parsed.to_string()), parsed);
    }
    assert_eq!(
        plan("read_error_rate=1%,seed=3,stall"),
        plan("read_error_rate=1%;seed=3;stall"),
        "commas and semicolons both separate"
    );
    assert_eq!(plan("read_error_rate=1%").read.error_rate, 0.01);
    assert!(!plan("stall=false").stall);
    assert_eq!(
        plan("delay=2ms").delay,
        Some(Delay {
            added: Nanos::from_millis(2),
            pick: DelayPick::Every(NonZeroU64::MIN)
        })
    );
    assert_eq!(
        plan("read_error_lba=5").read.error_lba,
        Some(LbaRange { first: 5, last: 5 })
    );
}

#[test]
fn bad_plans_are_refused_with_the_reason() {
    let check = |text: &str, expected: FaultSpecError| {
        assert_eq!(FaultPlan::parse(text), Err(expected), "{text}");
    };
    check(
        "bogus=1",
        FaultSpecError::UnknownKey {
            key: "bogus".into(),
        },
    );
    check("seed=1,seed=2", FaultSpecError::Duplicate { key: "seed" });
    check("delay", FaultSpecError::MissingValue { key: "delay" });
    check("stall,,seed=1", FaultSpecError::EmptyParameter);
    check("flush_error_lba=1-2", FaultSpecError::FlushHasNoLba);
    check(
        "delay_rate=0.5",
        FaultSpecError::Conflict("delay_every or delay_rate needs delay=DURATION"),
    );
    check(
        "delay=1ms,delay_every=2,delay_rate=0.5",
        FaultSpecError::Conflict("delay_every and delay_rate are alternatives: give one"),
    );
    for (text, key) in [
        ("read_error_rate=1.5", "read_error_rate"),
        ("read_error_rate=-1", "read_error_rate"),
        ("short_rate=x", "short_rate"),
        ("write_error_lba=9-3", "write_error_lba"),
        ("write_error_lba=a-b", "write_error_lba"),
        ("errno=0", "errno"),
        ("errno=EWHAT", "errno"),
        ("delay=5", "delay"),
        ("delay=2h", "delay"),
        ("delay=3601s", "delay"),
        ("delay=1ms,delay_every=0", "delay_every"),
        ("seed=-1", "seed"),
        ("stall=maybe", "stall"),
    ] {
        match FaultPlan::parse(text) {
            Err(FaultSpecError::BadValue { key: bad_key, .. }) => assert_eq!(bad_key, key),
            other => panic!("{text}: {other:?}"),
        }
    }
    assert_eq!(
        split_spec("fault:mem:1M").map(|(_, inner)| inner),
        Ok("mem:1M")
    );
    assert_eq!(
        split_spec("fault(stall):null").map(|(plan, inner)| (plan.stall, inner)),
        Ok((true, "null"))
    );
    assert_eq!(split_spec("fault(stall"), Err(FaultSpecError::Unclosed));
    assert_eq!(
        split_spec("fault(stall)x"),
        Err(FaultSpecError::MissingColon)
    );
    assert_eq!(split_spec("fault:"), Err(FaultSpecError::MissingInner));
    let invalid = FaultPlan {
        errno: 0,
        ..FaultPlan::default()
    };
    assert!(FaultDevice::new(mem(), invalid).is_err());
    let message = FaultSpecError::UnknownKey { key: "x".into() }.to_string();
    for key in FAULT_KEYS {
        assert!(message.contains(key), "{message}");
    }
}

/// A real file through a real io_uring: ring entries pass through, and the wrapper defers
/// their CQEs (`complete_ring` returns `None`) to delay, stall or shorten them.
#[cfg(feature = "uring")]
mod ring {
    use super::*;
    use crate::aligned::AlignedBuf;
    use crate::aligned::test_ring::{Outcome, TestRing};
    use crate::file::FileDevice;

    fn file_device(dir: &tempfile::TempDir) -> Arc<FileDevice> {
        let path = dir.path().join("ns");
        Arc::new(
            FileDevice::open(&path, Some(MEM_SIZE_BYTES), false).unwrap_or_else(|e| panic!("{e}")),
        )
    }

    fn filled(byte: u8) -> AlignedBuf {
        let mut buf = AlignedBuf::new_zeroed(4096);
        buf.as_mut_slice().fill(byte);
        buf
    }

    fn write_of(buf: &AlignedBuf) -> OpKind<'_> {
        OpKind::Write {
            offset: 0,
            buf: buf.as_slice(),
            fua: false,
        }
    }

    fn read_all(buf: &mut AlignedBuf) -> OpKind<'_> {
        OpKind::Read {
            offset: 0,
            buf: buf.as_mut_slice(),
        }
    }

    #[test]
    fn faults_on_a_file_through_a_real_ring() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let inner = file_device(&dir);
        let device = wrap(inner.clone(), FaultPlan::default());
        let controls = device.controls();
        let mut queue = device.queue();
        let mut ring = TestRing::new();
        let old = filled(0xA1);
        let mut back = AlignedBuf::new_zeroed(4096);
        let mut run = |queue: &mut dyn DeviceQueue, kind: OpKind<'_>, user_data, at, cqe_at| {
            ring.submit_and_wait(queue, op(user_data, kind), at, cqe_at)
        };

        // No faults: the ring completes as usual.
        let t = Nanos::from_millis(10);
        assert_eq!(
            run(queue.as_mut(), write_of(&old), 1, t, t),
            Outcome::Done(Ok(4096))
        );

        // An LBA-range error is refused before the ring; the file keeps the old data.
        controls
            .set_plan(plan("write_error_lba=0-7"))
            .unwrap_or_else(|e| panic!("{e}"));
        let new = filled(0x5E);
        let refused = match queue.submit(op(2, write_of(&new)), t) {
            Submit::Done(result) => result,
            other => panic!("a refused write must not reach the ring: {other:?}"),
        };
        assert_eq!(refused, EIO);
        assert_eq!(
            run(inner.queue().as_mut(), read_all(&mut back), 3, t, t),
            Outcome::Done(Ok(4096))
        );
        assert_eq!(back.as_slice(), old.as_slice());

        // A delay defers the CQE: due at the CQE's time plus the delay.
        controls
            .set_plan(plan("delay=2ms"))
            .unwrap_or_else(|e| panic!("{e}"));
        let cqe_at = t + Nanos::from_micros(100);
        assert_eq!(
            run(queue.as_mut(), read_all(&mut back), 4, t, cqe_at),
            Outcome::Deferred
        );
        let due = cqe_at + Nanos::from_millis(2);
        assert_eq!(queue.next_deadline(), Some(due));
        assert_eq!(poll(queue.as_mut(), due - Nanos(1)), []);
        assert_eq!(
            poll(queue.as_mut(), due),
            [Completion {
                user_data: 4,
                result: Ok(4096)
            }]
        );

        // A stall holds ring completions (the kernel has finished with the buffers) until
        // it is lifted; nothing is lost.
        controls
            .set_plan(FaultPlan {
                stall: true,
                ..FaultPlan::default()
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let t = Nanos::from_millis(20);
        let newer = filled(0x77);
        assert_eq!(
            run(queue.as_mut(), write_of(&newer), 5, t, t),
            Outcome::Deferred
        );
        assert_eq!(
            run(queue.as_mut(), read_all(&mut back), 6, t, t),
            Outcome::Deferred
        );
        assert_eq!(
            run(queue.as_mut(), OpKind::Flush, 7, t, t),
            Outcome::Deferred
        );
        assert_eq!(poll(queue.as_mut(), t + Nanos::from_secs(5)), []);
        assert_eq!(
            back.as_slice(),
            newer.as_slice(),
            "the read ran, unreported"
        );
        controls.set_stalled(false);
        let done = poll(queue.as_mut(), t + Nanos::from_secs(5));
        assert_eq!(
            done,
            [
                Completion {
                    user_data: 5,
                    result: Ok(4096)
                },
                Completion {
                    user_data: 6,
                    result: Ok(4096)
                },
                Completion {
                    user_data: 7,
                    result: Ok(0)
                },
            ]
        );

        // Short completions: the CQE's count is halved.
        controls
            .set_plan(plan("short_rate=1"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            run(queue.as_mut(), read_all(&mut back), 8, t, t),
            Outcome::Done(Ok(2048))
        );
        assert_eq!(queue.next_deadline(), None);
    }
}
