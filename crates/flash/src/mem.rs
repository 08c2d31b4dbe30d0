//! `mem:SIZE`: a RAM-backed device shared by all dataplane threads.
//!
//! The memory is a [`StripedRegion`]: bytes are copied with `memcpy` under one of many
//! reader-writer locks (one per 64 KiB chunk, modulo the lock count), so two threads touching
//! the same block concurrently is defined behaviour (each chunk of a request is read or
//! written whole, as a device makes a sector atomic) rather than a Rust data race, and a 4 KiB
//! read costs one uncontended lock and one vectorised copy instead of 512 atomic loads. Every operation finishes synchronously ([`Submit::Done`]).
//! A read-only device ([`MemDevice::with_read_only`]) refuses writes and trims with `EROFS`,
//! as the file device does.

use std::sync::Arc;

use reflex_qos::Nanos;

use crate::aligned::StripedRegion;
use crate::{Device, DeviceInfo, DeviceOp, DeviceQueue, FlashError, OpKind, Submit};

#[derive(Debug)]
pub struct MemDevice {
    region: Arc<StripedRegion>,
    info: DeviceInfo,
}

impl MemDevice {
    /// A zeroed memory device of `size_bytes` (a non-zero multiple of 512).
    pub fn new(size_bytes: u64) -> Result<MemDevice, FlashError> {
        let spec = format!("mem:{size_bytes}");
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            return Err(FlashError::Open {
                spec,
                reason: "size must be a non-zero multiple of 512 bytes".into(),
            });
        }
        let region = StripedRegion::new(size_bytes).map_err(|e| FlashError::Open {
            spec,
            reason: format!("cannot map {size_bytes} bytes: {e}"),
        })?;
        Ok(MemDevice {
            region: Arc::new(region),
            info: DeviceInfo {
                size_bytes,
                block_size: 512,
                read_only: false,
                supports_trim: true,
                description: format!("mem ({size_bytes} bytes of RAM)"),
            },
        })
    }

    /// Marks the device read-only (in its [`DeviceInfo`]); its queues then refuse writes and
    /// trims.
    pub fn with_read_only(mut self, read_only: bool) -> MemDevice {
        self.info.read_only = read_only;
        self
    }
}

impl Device for MemDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        Box::new(MemQueue {
            region: Arc::clone(&self.region),
            read_only: self.info.read_only,
        })
    }
}

struct MemQueue {
    region: Arc<StripedRegion>,
    read_only: bool,
}

impl MemQueue {
    /// `[offset, offset + len)` as region indexes; the range was validated by the caller.
    fn range(&self, offset: u64, len: u64) -> (usize, usize) {
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            panic!("mem range {offset}+{len} beyond the address space");
        };
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.region.len()),
            "mem range beyond the device"
        );
        (offset, len)
    }
}

impl DeviceQueue for MemQueue {
    fn submit(&mut self, op: DeviceOp<'_>, _now: Nanos) -> Submit {
        if self.read_only && matches!(op.kind, OpKind::Write { .. } | OpKind::Trim { .. }) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        match op.kind {
            OpKind::Read { offset, buf } => {
                let (offset, _) = self.range(offset, buf.len() as u64);
                self.region.read(offset, buf);
                Submit::Done(Ok(buf.len() as u32))
            }
            OpKind::Write { offset, buf, .. } => {
                let (offset, _) = self.range(offset, buf.len() as u64);
                self.region.write(offset, buf);
                Submit::Done(Ok(buf.len() as u32))
            }
            // Memory is as durable as it gets; nothing to flush.
            OpKind::Flush => Submit::Done(Ok(0)),
            OpKind::Trim { offset, len } => {
                let (offset, len) = self.range(offset, len);
                self.region.zero(offset, len);
                Submit::Done(Ok(0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn submit(queue: &mut dyn DeviceQueue, kind: OpKind<'_>) -> Result<u32, FlashError> {
        let op = DeviceOp {
            user_data: 0,
            kind,
            buf_index: None,
            queue: 0,
        };
        match queue.submit(op, Nanos::ZERO) {
            Submit::Done(result) => result,
            other => panic!("mem must finish synchronously, got {other:?}"),
        }
    }

    #[test]
    fn write_read_trim() {
        let device = MemDevice::new(1 << 20).unwrap_or_else(|e| panic!("{e}"));
        let mut queue = device.queue();
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let written = submit(
            queue.as_mut(),
            OpKind::Write {
                offset: 8192,
                buf: &data,
                fua: false,
            },
        );
        assert_eq!(written, Ok(4096));
        let mut back = vec![0u8; 4096];
        let read = submit(
            queue.as_mut(),
            OpKind::Read {
                offset: 8192,
                buf: &mut back,
            },
        );
        assert_eq!(read, Ok(4096));
        assert_eq!(back, data);
        let trimmed = submit(
            queue.as_mut(),
            OpKind::Trim {
                offset: 8192,
                len: 512,
            },
        );
        assert_eq!(trimmed, Ok(0));
        submit(
            queue.as_mut(),
            OpKind::Read {
                offset: 8192,
                buf: &mut back,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(back[..512].iter().all(|&b| b == 0));
        assert_eq!(back[512..], data[512..]);
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(MemDevice::new(0).is_err());
        assert!(MemDevice::new(1000).is_err());
    }
}
