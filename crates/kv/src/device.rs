//! A synchronous [`BlockStore`] over a `reflex_flash` [`Device`] (memory, file, emulated, or
//! a fault injector around any of them), for tests and tools. It waits for each operation
//! before returning; the dataplane will drive the table's I/O through its own queues instead.
//!
//! It takes the device's ring-less queue ([`Device::queue_without_ring`]): file devices then run
//! I/O on their small thread pool, memory finishes at once, and the emulated device completes at
//! a virtual time this driver jumps to (`next_deadline`), so no clock is read. The one `unsafe`
//! call is that queue's: its contract is that every buffer handed to `submit` stays alive and
//! untouched until the operation's completion has been drained, which holds because the only
//! buffer is owned here, every operation is waited for before `submit_and_wait` returns, and a
//! buffer still lent when this value drops (an unwinding panic mid-wait) is leaked, not freed.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use reflex_flash::aligned::AlignedBuf;
use reflex_flash::{Completion, Device, DeviceOp, DeviceQueue, FlashError, Notify, OpKind, Submit};
use reflex_qos::Nanos;

use crate::layout::{BLOCK_SIZE_BYTES, VALUE_BLOCKS_MAX};
use crate::store::BlockStore;

/// Largest transfer: one largest value.
const TRANSFER_SIZE_MAX_BYTES: usize = VALUE_BLOCKS_MAX * BLOCK_SIZE_BYTES;
/// How long one wait for the pool sleeps before polling again (a missed wake-up costs this).
const WAIT_SLICE: Duration = Duration::from_millis(5);

/// Wakes the waiting thread when the file pool posts a completion.
#[derive(Default)]
struct Wakeup {
    pending: Mutex<bool>,
    condvar: Condvar,
}

impl Notify for Wakeup {
    fn notify(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        *pending = true;
        self.condvar.notify_one();
    }
}

impl Wakeup {
    fn wait(&self) {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let (mut pending, _) = self
            .condvar
            .wait_timeout_while(pending, WAIT_SLICE, |pending| !*pending)
            .unwrap_or_else(|e| e.into_inner());
        *pending = false;
    }
}

/// A device seen as 4 KiB blocks, one operation at a time.
pub struct DeviceBlocks {
    device: Arc<dyn Device>,
    queue: Box<dyn DeviceQueue>,
    wakeup: Arc<Wakeup>,
    buffer: AlignedBuf,
    /// An operation was submitted and its completion not yet drained.
    in_flight: bool,
    /// Virtual time handed to the queue; moves to the queue's deadlines while waiting.
    now: Nanos,
    next_user_data: u64,
    completions: Vec<Completion>,
}

impl DeviceBlocks {
    /// The device must be writable, its block size must divide 4 KiB, and its size is rounded
    /// down to whole 4 KiB blocks.
    pub fn new(device: Arc<dyn Device>) -> Result<DeviceBlocks, FlashError> {
        let info = device.info();
        if info.read_only {
            return Err(FlashError::Open {
                spec: info.description.clone(),
                reason: "a key-value table needs a writable device".into(),
            });
        }
        if info.block_size == 0 || !BLOCK_SIZE_BYTES.is_multiple_of(info.block_size as usize) {
            return Err(FlashError::Open {
                spec: info.description.clone(),
                reason: format!("block size {} does not divide 4096", info.block_size),
            });
        }
        let wakeup = Arc::new(Wakeup::default());
        let notify: Arc<dyn Notify> = Arc::clone(&wakeup) as Arc<dyn Notify>;
        // SAFETY: the queue only ever receives `self.buffer`, which this value owns and never
        // touches while an operation is in flight: `submit_and_wait` drains each operation's
        // completion before it returns, and `Drop` leaks the buffer (and the queue) if one is
        // still in flight.
        let queue = unsafe { device.queue_without_ring(notify) };
        Ok(DeviceBlocks {
            device,
            queue,
            wakeup,
            buffer: AlignedBuf::new_zeroed(TRANSFER_SIZE_MAX_BYTES),
            in_flight: false,
            now: Nanos::ZERO,
            next_user_data: 1,
            completions: Vec::new(),
        })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Submits one operation on `self.buffer[..length]` and waits for its completion.
    fn submit_and_wait(
        &mut self,
        kind: Kind,
        offset: u64,
        length: usize,
    ) -> Result<u32, FlashError> {
        assert!(length <= TRANSFER_SIZE_MAX_BYTES);
        assert!(!self.in_flight);
        let user_data = self.next_user_data;
        self.next_user_data += 1;
        let op_kind = match kind {
            Kind::Read => OpKind::Read {
                offset,
                buf: &mut self.buffer.as_mut_slice()[..length],
            },
            Kind::Write { fua } => OpKind::Write {
                offset,
                buf: &self.buffer.as_slice()[..length],
                fua,
            },
            Kind::Flush => OpKind::Flush,
        };
        let op = DeviceOp {
            user_data,
            kind: op_kind,
            buf_index: None,
            queue: 0,
        };
        self.in_flight = true;
        match self.queue.submit(op, self.now) {
            Submit::Done(result) => {
                self.in_flight = false;
                return result;
            }
            Submit::Pending => {}
            // `Submit::Ring` where reflex-flash is built with its ring (the dataplane links the
            // table without it): the entry was never pushed on a ring, so nothing uses the
            // buffer.
            #[allow(unreachable_patterns)]
            _ => {
                self.in_flight = false;
                return Err(FlashError::Unsupported);
            }
        }
        loop {
            self.completions.clear();
            self.queue.poll_completions(self.now, &mut self.completions);
            if let Some(completion) = self.completions.iter().find(|c| c.user_data == user_data) {
                assert_eq!(self.completions.len(), 1, "a completion nobody waited for");
                self.in_flight = false;
                return completion.result.clone();
            }
            assert!(
                self.completions.is_empty(),
                "a completion nobody waited for"
            );
            match self.queue.next_deadline() {
                Some(deadline) if deadline > self.now => self.now = deadline,
                Some(_) => {}
                None => self.wakeup.wait(),
            }
        }
    }

    fn check(&self, block_index: u64, length: usize) {
        assert!(length.is_multiple_of(BLOCK_SIZE_BYTES));
        let end_bytes =
            (block_index + (length / BLOCK_SIZE_BYTES) as u64).checked_mul(BLOCK_SIZE_BYTES as u64);
        assert!(
            end_bytes.is_some_and(|end| end <= self.device.info().size_bytes),
            "block {block_index} out of range"
        );
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Read,
    Write { fua: bool },
    Flush,
}

/// A transfer that moved fewer bytes than asked is an I/O error.
fn whole(result: Result<u32, FlashError>, length: usize) -> Result<(), FlashError> {
    match result {
        Ok(bytes) if bytes as usize == length => Ok(()),
        Ok(_) => Err(FlashError::Io { errno: 5 }),
        Err(error) => Err(error),
    }
}

impl BlockStore for DeviceBlocks {
    fn block_count(&self) -> u64 {
        self.device.info().size_bytes / BLOCK_SIZE_BYTES as u64
    }

    fn read_blocks(&mut self, block_index: u64, buf: &mut [u8]) -> Result<(), FlashError> {
        self.check(block_index, buf.len());
        let offset = block_index * BLOCK_SIZE_BYTES as u64;
        let result = self.submit_and_wait(Kind::Read, offset, buf.len());
        whole(result, buf.len())?;
        buf.copy_from_slice(&self.buffer.as_slice()[..buf.len()]);
        Ok(())
    }

    fn write_blocks(&mut self, block_index: u64, buf: &[u8], fua: bool) -> Result<(), FlashError> {
        self.check(block_index, buf.len());
        let offset = block_index * BLOCK_SIZE_BYTES as u64;
        self.buffer.as_mut_slice()[..buf.len()].copy_from_slice(buf);
        let result = self.submit_and_wait(Kind::Write { fua }, offset, buf.len());
        whole(result, buf.len())
    }

    fn flush(&mut self) -> Result<(), FlashError> {
        self.submit_and_wait(Kind::Flush, 0, 0).map(|_| ())
    }
}

impl Drop for DeviceBlocks {
    fn drop(&mut self) {
        if self.in_flight {
            // A panic unwound out of a wait: the device may still use the buffer, so neither
            // it nor the queue that lent it is freed.
            let buffer =
                std::mem::replace(&mut self.buffer, AlignedBuf::new_zeroed(BLOCK_SIZE_BYTES));
            std::mem::forget(buffer);
            let queue = std::mem::replace(&mut self.queue, Box::new(NoQueue));
            std::mem::forget(queue);
        }
    }
}

/// What `Drop` leaves in place of a queue it must leak.
struct NoQueue;

impl DeviceQueue for NoQueue {
    fn submit(&mut self, _op: DeviceOp<'_>, _now: Nanos) -> Submit {
        Submit::Done(Err(FlashError::Unsupported))
    }
}
