//! `mem:SIZE`: a RAM-backed device shared by all dataplane threads.
//!
//! The memory is a [`LendingRegion`]: bytes are copied with `memcpy` under one of many
//! reader-writer locks (one per 64 KiB chunk, modulo the lock count), so two threads touching
//! the same block concurrently is defined behaviour (each chunk of a request is read or
//! written whole, as a device makes a sector atomic). A read of one whole 4 KiB block may
//! instead be lent ([`DeviceQueue::lend`]): the dataplane then sends the device's own bytes,
//! which stay as they were until the send is done, whatever is written meanwhile (a write to
//! a lent block moves it out of the region). Every operation finishes synchronously
//! ([`Submit::Done`]).
//! A read-only device ([`MemDevice::with_read_only`]) refuses writes and trims with `EROFS`,
//! as the file device does.
//!
//! Allocation: one bit per 4 KiB granule says whether it was ever written; a trim clears the
//! bits of the granules it covers whole. Granules whose bit is clear read as zeroes, so
//! [`Device::block_status`] reports them as holes. A write sets its bits *after* storing its
//! words and a trim clears them *before* zeroing, so whatever the interleaving of a write and
//! a trim on the same granule, a clear bit at rest means the granule reads as zeroes (the
//! answer errs towards "data" only while a write is in flight).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use reflex_qos::Nanos;

use crate::pages::{BLOCK_BYTES, LendingRegion, Lent, RegionHandle};
use crate::{
    Allocation, Device, DeviceInfo, DeviceOp, DeviceQueue, Extent, FlashError, OpKind, Submit,
    push_extent,
};

/// Bytes one allocation bit stands for.
pub const GRANULE_BYTES: u64 = 4096;

/// Largest memory device: its allocation map (one bit per granule, 32 MiB at this size) is
/// allocated at once, and a namespace added at run time must not take the server's memory.
pub const MEM_BYTES_MAX: u64 = 1 << 40;

/// Which granules were written: bit `g % 64` of word `g / 64` for granule `g`.
#[derive(Debug)]
struct AllocationMap {
    words: Box<[AtomicU64]>,
    granules: u64,
}

impl AllocationMap {
    fn new(size_bytes: u64) -> AllocationMap {
        let granules = size_bytes.div_ceil(GRANULE_BYTES);
        let words = (0..granules.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        AllocationMap { words, granules }
    }

    fn is_set(&self, granule: u64) -> bool {
        let word = &self.words[(granule / 64) as usize];
        word.load(Ordering::Acquire) & (1 << (granule % 64)) != 0
    }

    /// Marks every granule `[offset, offset + len)` touches (after the data is stored).
    fn set(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for granule in offset / GRANULE_BYTES..(offset + len).div_ceil(GRANULE_BYTES) {
            self.words[(granule / 64) as usize].fetch_or(1 << (granule % 64), Ordering::Release);
        }
    }

    /// Clears the granules `[offset, offset + len)` covers whole (before they are zeroed).
    fn clear_covered(&self, offset: u64, len: u64, size_bytes: u64) {
        let first = offset.div_ceil(GRANULE_BYTES);
        let end = offset + len;
        // The last, partial granule of the device is covered when the range reaches its end.
        let last = if end == size_bytes {
            self.granules
        } else {
            end / GRANULE_BYTES
        };
        for granule in first..last {
            self.words[(granule / 64) as usize].fetch_and(!(1 << (granule % 64)), Ordering::AcqRel);
        }
    }
}

#[derive(Debug)]
pub struct MemDevice {
    region: Arc<LendingRegion>,
    allocation: Arc<AllocationMap>,
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
        if size_bytes > MEM_BYTES_MAX {
            return Err(FlashError::Open {
                spec,
                reason: format!("size above the {MEM_BYTES_MAX} bytes a memory device may have"),
            });
        }
        let region = usize::try_from(size_bytes)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::ENOMEM))
            .and_then(LendingRegion::new)
            .map_err(|e| FlashError::Open {
                spec,
                reason: format!("cannot map {size_bytes} bytes: {e}"),
            })?;
        Ok(MemDevice {
            region: Arc::new(region),
            allocation: Arc::new(AllocationMap::new(size_bytes)),
            info: DeviceInfo {
                size_bytes,
                block_size: 512,
                read_only: false,
                supports_trim: true,
                description: format!("mem ({size_bytes} bytes of RAM)"),
            },
        })
    }

    /// Loans of its memory to sends not given back yet ([`LendingRegion::loans_outstanding`]).
    pub fn loans_outstanding(&self) -> u64 {
        self.region.loans_outstanding()
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
            region: RegionHandle::new(Arc::clone(&self.region)),
            allocation: Arc::clone(&self.allocation),
            size_bytes: self.info.size_bytes,
            read_only: self.info.read_only,
        })
    }

    fn block_status(
        &self,
        offset: u64,
        length_bytes: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), FlashError> {
        assert!(extents_max >= 1 && length_bytes > 0);
        let end = offset.saturating_add(length_bytes);
        assert!(
            end <= self.info.size_bytes,
            "block status beyond the device"
        );
        let first = out.len();
        let mut position = offset;
        while position < end {
            let granule = position / GRANULE_BYTES;
            let next = ((granule + 1) * GRANULE_BYTES).min(end);
            let allocation = if self.allocation.is_set(granule) {
                Allocation::Data
            } else {
                Allocation::Hole
            };
            let extent = Extent {
                length_bytes: next - position,
                allocation,
            };
            let extends_last =
                out.len() > first && out.last().is_some_and(|last| last.allocation == allocation);
            if !extends_last && out.len() - first == extents_max {
                break;
            }
            push_extent(out, first, extent);
            position = next;
        }
        Ok(())
    }
}

struct MemQueue {
    /// This queue's own handle: loans keep it, and with it the region, alive.
    region: Arc<RegionHandle>,
    allocation: Arc<AllocationMap>,
    size_bytes: u64,
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
                .is_some_and(|end| end <= self.region.region().len()),
            "mem range beyond the device"
        );
        (offset, len)
    }
}

impl DeviceQueue for MemQueue {
    fn lend(&mut self, offset: u64, len: u32) -> Option<Lent> {
        let whole_block = offset.is_multiple_of(BLOCK_BYTES as u64) && len as usize == BLOCK_BYTES;
        if !whole_block {
            return None;
        }
        let (offset, _) = self.range(offset, u64::from(len));
        Some(self.region.lend(offset))
    }

    fn prefetch_lend(&self, offset: u64, len: u32) {
        if len as usize == BLOCK_BYTES
            && let Ok(offset) = usize::try_from(offset)
        {
            self.region.prefetch_lend(offset);
        }
    }

    fn submit(&mut self, op: DeviceOp<'_>, _now: Nanos) -> Submit {
        if self.read_only && matches!(op.kind, OpKind::Write { .. } | OpKind::Trim { .. }) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        match op.kind {
            OpKind::Read { offset, buf } => {
                let (offset, _) = self.range(offset, buf.len() as u64);
                self.region.region().read(offset, buf);
                Submit::Done(Ok(buf.len() as u32))
            }
            OpKind::Write { offset, buf, .. } => {
                let (offset, _) = self.range(offset, buf.len() as u64);
                self.region.region().write(offset, buf);
                self.allocation.set(offset as u64, buf.len() as u64);
                Submit::Done(Ok(buf.len() as u32))
            }
            // Memory is as durable as it gets; nothing to flush.
            OpKind::Flush => Submit::Done(Ok(0)),
            OpKind::Trim { offset, len } => {
                self.allocation.clear_covered(offset, len, self.size_bytes);
                let (offset, len) = self.range(offset, len);
                self.region.region().zero(offset, len);
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

    fn status(device: &MemDevice, offset: u64, length: u64, max: usize) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        device
            .block_status(offset, length, max, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        out.iter()
            .map(|e| (e.length_bytes, e.allocation == Allocation::Hole))
            .collect()
    }

    #[test]
    fn block_status_follows_writes_and_trims() {
        let device = MemDevice::new((1 << 20) + 512).unwrap_or_else(|e| panic!("{e}"));
        let mut queue = device.queue();
        assert_eq!(
            status(&device, 0, (1 << 20) + 512, 8),
            vec![((1 << 20) + 512, true)]
        );
        let data = vec![7u8; 512];
        for offset in [8192 + 512, 1 << 20] {
            let written = submit(
                queue.as_mut(),
                OpKind::Write {
                    offset,
                    buf: &data,
                    fua: false,
                },
            );
            assert_eq!(written, Ok(512));
        }
        // A 512-byte write marks its whole 4 KiB granule; the device's last, partial
        // granule counts too.
        assert_eq!(
            status(&device, 0, (1 << 20) + 512, 8),
            vec![
                (8192, true),
                (4096, false),
                ((1 << 20) - 12288, true),
                (512, false)
            ]
        );
        // Unaligned queries are clamped; at most `extents_max` extents.
        assert_eq!(
            status(&device, 8000, 300, 8),
            vec![(192, true), (108, false)]
        );
        assert_eq!(status(&device, 0, 1 << 20, 1), vec![(8192, true)]);
        // A trim that covers the granule whole makes it a hole again; a partial one does not.
        let trim =
            |queue: &mut dyn DeviceQueue, offset, len| submit(queue, OpKind::Trim { offset, len });
        assert_eq!(trim(queue.as_mut(), 8192, 2048), Ok(0));
        assert_eq!(status(&device, 8192, 4096, 8), vec![(4096, false)]);
        assert_eq!(trim(queue.as_mut(), 4096, 8192), Ok(0));
        assert_eq!(status(&device, 0, 16384, 8), vec![(16384, true)]);
        assert_eq!(trim(queue.as_mut(), 1 << 20, 512), Ok(0));
        assert_eq!(
            status(&device, 0, (1 << 20) + 512, 8),
            vec![((1 << 20) + 512, true)]
        );
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(MemDevice::new(0).is_err());
        assert!(MemDevice::new(1000).is_err());
        assert!(MemDevice::new(MEM_BYTES_MAX + 512).is_err());
    }
}
