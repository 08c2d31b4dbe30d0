//! `null`: a device that stores nothing, for measuring the server's own cost.
//!
//! Reads return zeroes (the buffer is cleared, so a reused dataplane buffer never leaks its
//! old contents), so block status reports one hole; writes, flushes and trims succeed at
//! once. Everything finishes synchronously with [`Submit::Done`]; the default size is 1 TiB
//! so any benchmark range fits. A read-only device ([`NullDevice::with_read_only`]) refuses
//! writes and trims with `EROFS`.

use reflex_qos::Nanos;

use crate::{
    Allocation, Device, DeviceInfo, DeviceOp, DeviceQueue, Extent, FlashError, OpKind, Submit,
};

/// Size of `null` when none is given.
pub const NULL_SIZE_DEFAULT_BYTES: u64 = 1 << 40;

#[derive(Debug)]
pub struct NullDevice {
    info: DeviceInfo,
}

impl NullDevice {
    pub fn new(size_bytes: u64) -> NullDevice {
        assert!(size_bytes > 0);
        assert!(size_bytes.is_multiple_of(512));
        NullDevice {
            info: DeviceInfo {
                size_bytes,
                block_size: 512,
                read_only: false,
                supports_trim: true,
                description: format!("null ({size_bytes} bytes, data discarded)"),
            },
        }
    }

    /// Marks the device read-only (in its [`DeviceInfo`]); its queues then refuse writes and
    /// trims.
    pub fn with_read_only(mut self, read_only: bool) -> NullDevice {
        self.info.read_only = read_only;
        self
    }
}

impl Device for NullDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        Box::new(NullQueue {
            size_bytes: self.info.size_bytes,
            read_only: self.info.read_only,
        })
    }

    /// Nothing is stored and everything reads as zeroes: one hole.
    fn block_status(
        &self,
        offset: u64,
        length_bytes: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), FlashError> {
        assert!(extents_max >= 1 && length_bytes > 0);
        assert!(offset.saturating_add(length_bytes) <= self.info.size_bytes);
        out.push(Extent {
            length_bytes,
            allocation: Allocation::Hole,
        });
        Ok(())
    }
}

struct NullQueue {
    size_bytes: u64,
    read_only: bool,
}

impl DeviceQueue for NullQueue {
    fn submit(&mut self, op: DeviceOp<'_>, _now: Nanos) -> Submit {
        if self.read_only && matches!(op.kind, OpKind::Write { .. } | OpKind::Trim { .. }) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        match op.kind {
            OpKind::Read { offset, buf } => {
                assert!(offset + buf.len() as u64 <= self.size_bytes);
                buf.fill(0);
                Submit::Done(Ok(buf.len() as u32))
            }
            OpKind::Write { offset, buf, .. } => {
                assert!(offset + buf.len() as u64 <= self.size_bytes);
                Submit::Done(Ok(buf.len() as u32))
            }
            OpKind::Flush => Submit::Done(Ok(0)),
            OpKind::Trim { offset, len } => {
                assert!(offset + len <= self.size_bytes);
                Submit::Done(Ok(0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_clear_the_buffer() {
        let device = NullDevice::new(1 << 20);
        let mut queue = device.queue();
        let mut buf = vec![0xAAu8; 4096];
        let op = DeviceOp {
            user_data: 1,
            kind: OpKind::Read {
                offset: 4096,
                buf: &mut buf,
            },
            buf_index: None,
            queue: 0,
        };
        assert!(matches!(
            queue.submit(op, Nanos::ZERO),
            Submit::Done(Ok(4096))
        ));
        assert!(buf.iter().all(|&b| b == 0));
    }
}
