//! The emulated device on the real clock: a [`Device`] for `reflexd` (`emu:device-a-small`).
//!
//! One [`EmuDevice`] model is shared by every dataplane thread behind a mutex, because
//! interference is device-wide: thread A's writes must slow thread B's reads. Each thread gets
//! its own [`DeviceQueue`]. `submit` copies the data at once (into the page store for writes,
//! out of it for reads; the dataplane's buffer is not kept) and returns [`Submit::Pending`];
//! the completion becomes due at the time the model computes. `poll_completions(now)` advances
//! the model and routes each completion to the queue that submitted it: a completion of
//! thread A's request found by thread B's poll waits in A's outbox until A polls.
//!
//! `now` comes from the caller (the dataplane reads a monotonic clock once per loop); threads
//! may hand in slightly different `now`s, and the model never goes back in time.
//!
//! A read-only device ([`EmuFlash::with_read_only`]) refuses writes and trims with `EROFS`
//! before they reach the model.
//!
//! Drift: `emu(slow=2x@10s;stall=40s-41s):NAME` opens the device with a schedule whose times
//! count from the first `now` any thread hands in (its first I/O or poll), and
//! [`EmuFlash::controls`] (also [`Device::emu_controls`]) changes speed or stalls it at run
//! time ([`super::drift`]).
//!
//! The lock is held for a few hundred nanoseconds per call (one heap operation and a 4 KiB
//! copy per command), far below the 10 µs per request of 100K IOPS.

use std::sync::{Arc, Mutex, MutexGuard};

use reflex_qos::Nanos;

use super::{
    EmuCompletion, EmuControls, EmuDevice, EmuError, EmuOpKind, EmuProfile, EmuRequest,
    EmuSchedule, PriorityClass,
};
use crate::{Completion, Device, DeviceInfo, DeviceOp, DeviceQueue, FlashError, OpKind, Submit};

/// Namespace size used when the configuration gives none.
pub const EMU_SIZE_DEFAULT_BYTES: u64 = 1 << 30;

/// Seed of the model behind `open` (its only randomness is where background work lands).
const REALTIME_SEED: u64 = 0x5eed_f1a5;

/// Opens the emulated device `spec` (`emu:device-a`, `emu:device-a-small`, `emu:/path/x.toml`,
/// the same without `emu:`, or any of them with a drift schedule:
/// `emu(slow=2x@10s):device-a-small`) with a namespace of `size_bytes`.
pub fn open(spec: &str, size_bytes: u64) -> Result<Arc<dyn Device>, FlashError> {
    Ok(Arc::new(EmuFlash::open(spec, size_bytes)?))
}

/// Which queue submitted a command still in the model.
#[derive(Debug, Clone, Copy)]
struct Owner {
    queue_index: u32,
    user_data: u64,
    result_bytes: u32,
}

struct Shared {
    device: EmuDevice,
    /// Indexed by the model tag; `None` marks a free entry (listed in `free_tags`).
    owners: Vec<Option<Owner>>,
    free_tags: Vec<u32>,
    /// Completions waiting for their queue's next poll; `None` once the queue is dropped.
    outboxes: Vec<Option<Vec<Completion>>>,
    scratch: Vec<EmuCompletion>,
}

/// The shared emulated device.
pub struct EmuFlash {
    info: DeviceInfo,
    shared: Arc<Mutex<Shared>>,
}

impl EmuFlash {
    pub fn open(spec: &str, size_bytes: u64) -> Result<EmuFlash, FlashError> {
        let fail = |reason: String| FlashError::Open {
            spec: spec.to_string(),
            reason,
        };
        let (schedule, name) = super::split_spec(spec).map_err(|e| fail(e.to_string()))?;
        let profile = EmuProfile::lookup(name).map_err(|e| fail(e.to_string()))?;
        EmuFlash::with_schedule(profile, size_bytes, schedule).map_err(|e| fail(e.to_string()))
    }

    pub fn with_profile(profile: EmuProfile, size_bytes: u64) -> Result<EmuFlash, EmuError> {
        EmuFlash::with_schedule(profile, size_bytes, EmuSchedule::default())
    }

    /// A device that drifts by `schedule` (its times count from the first `now` any queue
    /// hands in, unless the schedule says `origin=zero`).
    pub fn with_schedule(
        profile: EmuProfile,
        size_bytes: u64,
        schedule: EmuSchedule,
    ) -> Result<EmuFlash, EmuError> {
        let drift = if schedule.is_empty() {
            String::new()
        } else {
            format!(", drift schedule {schedule}")
        };
        let description = format!(
            "emu:{} (emulated Flash: {} dies, {} command slots, {:?}{drift})",
            profile.name,
            profile.die_count(),
            profile.queue_depth_max,
            profile.arbitration.policy
        );
        let queue_count = profile.queue_count;
        let mut device = EmuDevice::new(profile, size_bytes, REALTIME_SEED)?;
        device.set_schedule(schedule)?;
        // One submission queue per priority class (PriorityClass::submission_queue), so the
        // dataplane can arbitrate by class without knowing the profile's queue layout.
        if queue_count >= PriorityClass::ALL.len() as u16 {
            for class in PriorityClass::ALL {
                device.set_queue_class(class.submission_queue(), class)?;
            }
        }
        Ok(EmuFlash {
            info: DeviceInfo {
                size_bytes,
                block_size: super::EMU_BLOCK_BYTES,
                read_only: false,
                supports_trim: true,
                description,
            },
            shared: Arc::new(Mutex::new(Shared {
                device,
                owners: Vec::new(),
                free_tags: Vec::new(),
                outboxes: Vec::new(),
                scratch: Vec::new(),
            })),
        })
    }

    /// Marks the device read-only (in its [`DeviceInfo`]); its queues then refuse writes and
    /// trims.
    pub fn with_read_only(mut self, read_only: bool) -> EmuFlash {
        self.info.read_only = read_only;
        self
    }

    /// The priority class of submission queue `queue`; `None` past the profile's queues.
    pub fn queue_class(&self, queue: u16) -> Option<PriorityClass> {
        lock(&self.shared).device.queue_class(queue)
    }

    /// Puts submission queue `queue` in a priority class (for WRR/DRR arbitration).
    pub fn set_queue_class(&self, queue: u16, class: PriorityClass) -> Result<(), EmuError> {
        lock(&self.shared).device.set_queue_class(queue, class)
    }

    /// The shared run-time handle: slow down, speed up or stall the device.
    pub fn controls(&self) -> Arc<EmuControls> {
        lock(&self.shared).device.controls()
    }

    /// Runs `f` on the model (statistics, tests).
    pub fn with_model<R>(&self, f: impl FnOnce(&EmuDevice) -> R) -> R {
        f(&lock(&self.shared).device)
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // A panic while holding the lock is a bug already reported; the model stays usable.
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Device for EmuFlash {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn emu_controls(&self) -> Option<Arc<EmuControls>> {
        Some(self.controls())
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        let mut shared = lock(&self.shared);
        let queue_index = shared.outboxes.len() as u32;
        shared.outboxes.push(Some(Vec::new()));
        Box::new(EmuQueue {
            shared: Arc::clone(&self.shared),
            queue_index,
            read_only: self.info.read_only,
        })
    }
}

struct EmuQueue {
    shared: Arc<Mutex<Shared>>,
    queue_index: u32,
    read_only: bool,
}

impl Drop for EmuQueue {
    fn drop(&mut self) {
        let mut shared = lock(&self.shared);
        if let Some(outbox) = shared.outboxes.get_mut(self.queue_index as usize) {
            *outbox = None;
        }
    }
}

fn to_flash_error(error: &EmuError) -> FlashError {
    let errno = match error {
        EmuError::Arbiter(super::ArbiterError::QueueFull { .. }) => libc::EAGAIN,
        _ => libc::EINVAL,
    };
    FlashError::Io { errno }
}

impl DeviceQueue for EmuQueue {
    fn submit(&mut self, op: DeviceOp<'_>, now: Nanos) -> Submit {
        if self.read_only && matches!(op.kind, OpKind::Write { .. } | OpKind::Trim { .. }) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        let mut guard = lock(&self.shared);
        let shared = &mut *guard;
        let (kind, offset, len) = match &op.kind {
            OpKind::Read { offset, buf } => (EmuOpKind::Read, *offset, buf.len() as u64),
            OpKind::Write { offset, buf, .. } => (EmuOpKind::Write, *offset, buf.len() as u64),
            OpKind::Flush => (EmuOpKind::Flush, 0, 0),
            OpKind::Trim { offset, len } => (EmuOpKind::Trim, *offset, *len),
        };
        let Ok(len_u32) = u32::try_from(len) else {
            return Submit::Done(Err(FlashError::Io {
                errno: libc::EINVAL,
            }));
        };
        let result_bytes = match kind {
            EmuOpKind::Read | EmuOpKind::Write => len_u32,
            EmuOpKind::Flush | EmuOpKind::Trim => 0,
        };
        // Trims of any size cost the controller the same: time one block of it, after checking
        // the whole range.
        let timed_len = match kind {
            EmuOpKind::Trim => {
                if let Err(error) = shared.device.trim_data_check(offset, len) {
                    return Submit::Done(Err(to_flash_error(&error)));
                }
                super::EMU_BLOCK_BYTES
            }
            _ => len_u32,
        };
        let tag = match shared.free_tags.pop() {
            Some(tag) => tag,
            None => {
                shared.owners.push(None);
                (shared.owners.len() - 1) as u32
            }
        };
        let request = EmuRequest {
            tag: u64::from(tag),
            kind,
            offset,
            len: timed_len,
            queue: op.queue,
        };
        // The model validates range and queue first, so a refused command changes no data.
        if let Err(error) = shared.device.submit(now, request) {
            shared.free_tags.push(tag);
            return Submit::Done(Err(to_flash_error(&error)));
        }
        shared.owners[tag as usize] = Some(Owner {
            queue_index: self.queue_index,
            user_data: op.user_data,
            result_bytes,
        });
        let copied = match op.kind {
            OpKind::Read { offset, buf } => shared.device.read_data(offset, buf),
            OpKind::Write { offset, buf, .. } => shared.device.write_data(offset, buf),
            OpKind::Flush => Ok(()),
            OpKind::Trim { offset, len } => shared.device.trim_data(offset, len),
        };
        assert!(copied.is_ok(), "range validated by the model: {copied:?}");
        Submit::Pending
    }

    fn poll_completions(&mut self, now: Nanos, out: &mut Vec<Completion>) {
        let mut guard = lock(&self.shared);
        let shared = &mut *guard;
        if let Some(Some(outbox)) = shared.outboxes.get_mut(self.queue_index as usize) {
            out.append(outbox);
        }
        let mut scratch = std::mem::take(&mut shared.scratch);
        shared.device.advance(now, &mut scratch);
        for done in scratch.drain(..) {
            let tag = done.tag as usize;
            let Some(owner) = shared.owners.get_mut(tag).and_then(Option::take) else {
                unreachable!("completion for unknown tag {tag}");
            };
            shared.free_tags.push(tag as u32);
            let completion = Completion {
                user_data: owner.user_data,
                result: Ok(owner.result_bytes),
            };
            if owner.queue_index == self.queue_index {
                out.push(completion);
            } else if let Some(Some(outbox)) = shared.outboxes.get_mut(owner.queue_index as usize) {
                outbox.push(completion);
            }
        }
        shared.scratch = scratch;
    }

    fn next_deadline(&self) -> Option<Nanos> {
        let shared = lock(&self.shared);
        let own_waiting = shared
            .outboxes
            .get(self.queue_index as usize)
            .is_some_and(|outbox| outbox.as_ref().is_some_and(|o| !o.is_empty()));
        if own_waiting {
            return Some(Nanos::ZERO);
        }
        shared.device.next_event()
    }
}

#[cfg(test)]
mod class_queue_tests {
    use super::*;

    #[test]
    fn the_first_four_queues_are_the_four_priority_classes() {
        let flash = EmuFlash::open("device-a-small", 64 << 20).unwrap();
        for class in PriorityClass::ALL {
            assert_eq!(flash.queue_class(class.submission_queue()), Some(class));
        }
        // A client's ionice reaches the class it asks for: RT → urgent, BE 7 → low.
        let rt = super::super::class_from_ioprio(1 << 13).unwrap();
        let be7 = super::super::class_from_ioprio((2 << 13) | 7).unwrap();
        assert_eq!(
            flash.queue_class(rt.submission_queue()),
            Some(PriorityClass::Urgent)
        );
        assert_eq!(
            flash.queue_class(be7.submission_queue()),
            Some(PriorityClass::Low)
        );
    }
}
