//! Files and block devices, driven through the dataplane thread's io_uring.
//!
//! The device is opened once with `O_DIRECT` so reads and writes bypass the page cache, as
//! with NVMe in the original ReFlex. Where the filesystem refuses `O_DIRECT` (EINVAL, e.g. an
//! older tmpfs) it falls back to buffered I/O with a warning, and says so in its description.
//! A missing file is created sparse at the requested size; a block device's size is found by
//! seeking to its end (the same number `BLKGETSIZE64` gives, without an ioctl).
//!
//! Nothing is executed here: [`DeviceQueue::submit`] returns the io_uring entry for the
//! calling thread's ring ([`Submit::Ring`]), using `ReadFixed`/`WriteFixed` when the buffer is
//! in the thread's registered arena. A thread without a ring gets its queue from
//! [`Device::queue_without_ring`]: the same operations then run on the device's small thread
//! pool (`crate::pool`, started only then). FUA is `RWF_DSYNC` on the write, FLUSH is `fdatasync`,
//! TRIM is `fallocate(PUNCH_HOLE | KEEP_SIZE)` on files and `fallocate(ZERO_RANGE |
//! KEEP_SIZE)` on block devices (a discard that guarantees zeroes, falling back to writing
//! them). The dataplane keeps each buffer alive until its CQE arrives, and treats a short
//! transfer as an I/O error.
//!
//! Allocation ([`Device::block_status`]): a regular file reports its holes with
//! `lseek(SEEK_DATA/SEEK_HOLE)` (holes read as zeroes); a block device, or a filesystem
//! without those seeks, reports everything as data.
//!
//! A read-only namespace opens its file `O_RDONLY`, so not even a bug above this module can
//! write to it: the queue refuses WRITE and TRIM with `EROFS` before they reach the ring, and
//! the kernel would answer `EBADF` if one got through. Such a file must already exist and be
//! at least the configured size (nothing can create or grow it).

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use io_uring::{opcode, types};
use reflex_qos::Nanos;

use crate::aligned::{SeekFor, seek};
use crate::pool::{Pool, PoolQueue};
use crate::{
    Allocation, Device, DeviceInfo, DeviceOp, DeviceQueue, Extent, FlashError, Notify, OpKind,
    Submit, push_extent,
};

/// Logical block size of every file device: offsets and lengths are multiples of it, and so
/// are buffer addresses (O_DIRECT).
pub const FILE_BLOCK_SIZE: u32 = 512;

#[derive(Debug)]
pub struct FileDevice {
    file: Arc<File>,
    info: DeviceInfo,
    direct_io: bool,
    block_device: bool,
    /// The threads that run I/O for ring-less queues, started with the first of them.
    pool: OnceLock<Pool>,
}

impl FileDevice {
    /// Opens (or creates, sparse, when `size_bytes` is given) the file or block device.
    ///
    /// - Missing file: created at `size_bytes` (required), parent directories too.
    /// - Existing regular file: `size_bytes` `None` serves the whole file; a larger size grows
    ///   it sparsely; a smaller size serves only that prefix.
    /// - Block device: serves `size_bytes` or the whole device; larger than the device fails.
    /// - `read_only`: opened `O_RDONLY`; a missing file, or one smaller than `size_bytes`, fails.
    pub fn open(
        path: &Path,
        size_bytes: Option<u64>,
        read_only: bool,
    ) -> Result<FileDevice, FlashError> {
        let spec = format!("file:{}", path.display());
        let fail = |reason: String| FlashError::Open {
            spec: spec.clone(),
            reason,
        };
        if let Some(size) = size_bytes
            && (size == 0 || !size.is_multiple_of(u64::from(FILE_BLOCK_SIZE)))
        {
            return Err(fail(format!(
                "size {size} must be a non-zero multiple of {FILE_BLOCK_SIZE} bytes"
            )));
        }
        let existing = match std::fs::metadata(path) {
            Ok(meta) => Some(meta),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(fail(format!("cannot stat: {e}"))),
        };
        let block_device = existing
            .as_ref()
            .is_some_and(|meta| meta.file_type().is_block_device());
        if let Some(meta) = &existing {
            if !block_device && !meta.file_type().is_file() {
                return Err(fail("not a regular file or block device".into()));
            }
        } else {
            if read_only {
                return Err(fail(
                    "the file does not exist, and a read-only namespace cannot create it".into(),
                ));
            }
            if size_bytes.is_none() {
                return Err(fail(
                    "the file does not exist; give a size to create it".into(),
                ));
            }
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| fail(format!("cannot create {}: {e}", parent.display())))?;
            }
        }

        let (mut file, direct_io, fallback_reason) =
            open_direct_or_buffered(path, read_only, &fail)?;
        let current_size = file
            .seek(SeekFrom::End(0))
            .map_err(|e| fail(format!("cannot find the size: {e}")))?;
        let size = match size_bytes {
            None => current_size,
            Some(size) if size <= current_size => size,
            Some(size) if block_device => {
                return Err(fail(format!(
                    "size {size} is larger than the block device ({current_size} bytes)"
                )));
            }
            Some(size) if read_only => {
                return Err(fail(format!(
                    "size {size} is larger than the file ({current_size} bytes), and a \
                     read-only namespace cannot grow it"
                )));
            }
            Some(size) => {
                file.set_len(size)
                    .map_err(|e| fail(format!("cannot grow the file to {size} bytes: {e}")))?;
                if existing.is_some() {
                    tracing::info!(path = %path.display(), from = current_size, to = size, "grew file sparsely");
                }
                size
            }
        };
        if size == 0 || !size.is_multiple_of(u64::from(FILE_BLOCK_SIZE)) {
            return Err(fail(format!(
                "size {size} must be a non-zero multiple of {FILE_BLOCK_SIZE} bytes"
            )));
        }
        let kind = if block_device { "block device" } else { "file" };
        let mut mode = match &fallback_reason {
            None => "O_DIRECT".to_string(),
            Some(reason) => format!("buffered: O_DIRECT refused: {reason}"),
        };
        if read_only {
            mode.push_str(", O_RDONLY");
        }
        if let Some(reason) = &fallback_reason {
            tracing::warn!(path = %path.display(), %reason, "O_DIRECT refused; using buffered I/O");
        }
        Ok(FileDevice {
            file: Arc::new(file),
            info: DeviceInfo {
                size_bytes: size,
                block_size: FILE_BLOCK_SIZE,
                read_only,
                supports_trim: true,
                description: format!("{kind} {} ({mode}, {size} bytes)", path.display()),
            },
            direct_io,
            block_device,
            pool: OnceLock::new(),
        })
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT` was accepted).
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    pub fn is_block_device(&self) -> bool {
        self.block_device
    }
}

/// Opens with O_DIRECT, or without it when the filesystem refuses (EINVAL); read-write
/// (creating a missing file), or `O_RDONLY` for a read-only namespace.
fn open_direct_or_buffered(
    path: &Path,
    read_only: bool,
    fail: &dyn Fn(String) -> FlashError,
) -> Result<(File, bool, Option<String>), FlashError> {
    let options = |direct: bool| {
        let mut options = OpenOptions::new();
        options.read(true);
        if !read_only {
            options.write(true).create(true).truncate(false);
        }
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        options
    };
    match options(true).open(path) {
        Ok(file) => Ok((file, true, None)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let file = options(false)
                .open(path)
                .map_err(|e| fail(format!("cannot open: {e}")))?;
            Ok((file, false, Some(e.to_string())))
        }
        Err(e) => Err(fail(format!("cannot open: {e}"))),
    }
}

impl FileDevice {
    /// What every queue of this device needs: the descriptor, the size and the mode.
    fn access(&self) -> FileAccess {
        FileAccess {
            file: Arc::clone(&self.file),
            size_bytes: self.info.size_bytes,
            read_only: self.info.read_only,
            direct_io: self.direct_io,
            trim_mode: if self.block_device {
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
            } else {
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
            },
        }
    }
}

impl Device for FileDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        Box::new(FileQueue {
            access: self.access(),
        })
    }

    #[allow(unsafe_code)]
    unsafe fn queue_without_ring(&self, notify: Arc<dyn Notify>) -> Box<dyn DeviceQueue> {
        let access = self.access();
        let pool = self
            .pool
            .get_or_init(|| Pool::start(Arc::clone(&access.file), access.trim_mode));
        // SAFETY: our caller keeps the buffers of submitted operations alive and untouched
        // until their completions are drained (this function's contract, passed on as is).
        Box::new(unsafe { PoolQueue::new(access, pool, notify) })
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
        let data = |length_bytes| Extent {
            length_bytes,
            allocation: Allocation::Data,
        };
        if self.block_device {
            out.push(data(length_bytes));
            return Ok(());
        }
        let mut position = offset;
        while position < end && out.len() - first < extents_max {
            let next_data = match seek(&self.file, position, SeekFor::Data) {
                Ok(next) => next,
                Err(_) if out.len() == first => {
                    // No SEEK_DATA here (or it failed): nothing is known, all is data.
                    out.push(data(length_bytes));
                    return Ok(());
                }
                Err(_) => break,
            };
            // No data at or after `position` (ENXIO): a hole to the end.
            let data_start = next_data.unwrap_or(end).min(end);
            if data_start > position {
                push_extent(
                    out,
                    first,
                    Extent {
                        length_bytes: data_start - position,
                        allocation: Allocation::Hole,
                    },
                );
                position = data_start;
                continue;
            }
            // `position` holds data; it lasts until the next hole (the end of the file is one).
            let hole_start = match seek(&self.file, position, SeekFor::Hole) {
                Ok(Some(hole)) if hole > position => hole.min(end),
                _ => end,
            };
            push_extent(out, first, data(hole_start - position));
            position = hole_start;
        }
        assert!(out.len() > first, "at least one extent");
        Ok(())
    }
}

/// One queue's view of the file, ring or not, and the checks every operation passes.
#[derive(Debug, Clone)]
pub(crate) struct FileAccess {
    /// Keeps the descriptor open for as long as any queue (and its in-flight I/O) lives.
    pub(crate) file: Arc<File>,
    pub(crate) size_bytes: u64,
    /// The descriptor is `O_RDONLY`: writes and trims are refused before they are issued.
    pub(crate) read_only: bool,
    pub(crate) direct_io: bool,
    pub(crate) trim_mode: i32,
}

impl FileAccess {
    /// Whether the operation is refused with `EROFS` on a read-only namespace.
    pub(crate) fn refuses(&self, kind: &OpKind<'_>) -> bool {
        self.read_only && matches!(kind, OpKind::Write { .. } | OpKind::Trim { .. })
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) {
        let block = u64::from(FILE_BLOCK_SIZE);
        assert!(
            offset.is_multiple_of(block),
            "offset {offset} not block aligned"
        );
        assert!(len.is_multiple_of(block), "length {len} not block aligned");
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.size_bytes),
            "range {offset}+{len} beyond {}",
            self.size_bytes
        );
    }

    pub(crate) fn check_buffer(&self, address: usize) {
        if self.direct_io {
            assert!(
                address.is_multiple_of(FILE_BLOCK_SIZE as usize),
                "O_DIRECT buffer {address:#x} not block aligned"
            );
        }
    }
}

/// The outcome of a file system call that returned `result` (bytes, or `-errno`), with or
/// without a ring: `EOPNOTSUPP` (TRIM where the file system cannot discard) is `Unsupported`.
pub(crate) fn outcome(result: i64) -> Result<u32, FlashError> {
    match result {
        result if result >= 0 => Ok(u32::try_from(result).unwrap_or(u32::MAX)),
        result if -result == i64::from(libc::EOPNOTSUPP) => Err(FlashError::Unsupported),
        result => Err(FlashError::Io {
            errno: i32::try_from(-result).unwrap_or(libc::EIO),
        }),
    }
}

struct FileQueue {
    access: FileAccess,
}

impl DeviceQueue for FileQueue {
    fn submit(&mut self, op: DeviceOp<'_>, _now: Nanos) -> Submit {
        let access = &self.access;
        if access.refuses(&op.kind) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        let fd = types::Fd(access.file.as_raw_fd());
        let entry = match op.kind {
            OpKind::Read { offset, buf } => {
                access.check_range(offset, buf.len() as u64);
                access.check_buffer(buf.as_ptr() as usize);
                let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
                match op.buf_index {
                    Some(index) => opcode::ReadFixed::new(fd, buf.as_mut_ptr(), len, index)
                        .offset(offset)
                        .build(),
                    None => opcode::Read::new(fd, buf.as_mut_ptr(), len)
                        .offset(offset)
                        .build(),
                }
            }
            OpKind::Write { offset, buf, fua } => {
                access.check_range(offset, buf.len() as u64);
                access.check_buffer(buf.as_ptr() as usize);
                let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
                let rw_flags = if fua { libc::RWF_DSYNC } else { 0 };
                match op.buf_index {
                    Some(index) => opcode::WriteFixed::new(fd, buf.as_ptr(), len, index)
                        .offset(offset)
                        .rw_flags(rw_flags)
                        .build(),
                    None => opcode::Write::new(fd, buf.as_ptr(), len)
                        .offset(offset)
                        .rw_flags(rw_flags)
                        .build(),
                }
            }
            OpKind::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            OpKind::Trim { offset, len } => {
                access.check_range(offset, len);
                opcode::Fallocate::new(fd, len)
                    .offset(offset)
                    .mode(access.trim_mode)
                    .build()
            }
        };
        Submit::Ring(entry.user_data(op.user_data))
    }

    fn complete_ring(
        &mut self,
        _user_data: u64,
        cqe_result: i32,
        _now: Nanos,
    ) -> Option<Result<u32, FlashError>> {
        Some(outcome(i64::from(cqe_result)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_sparse_file_at_size() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("sub/ns1");
        let device =
            FileDevice::open(&path, Some(1 << 30), false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(device.info().size_bytes, 1 << 30);
        let meta = std::fs::metadata(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(meta.len(), 1 << 30);
        use std::os::unix::fs::MetadataExt;
        assert!(meta.blocks() * 512 < 1 << 20, "file must be sparse");
    }

    #[test]
    fn existing_file_sizes() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("ns");
        assert!(
            FileDevice::open(&path, None, false).is_err(),
            "missing without size"
        );
        drop(FileDevice::open(&path, Some(1 << 20), false));
        let whole = FileDevice::open(&path, None, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(whole.info().size_bytes, 1 << 20);
        let prefix = FileDevice::open(&path, Some(4096), false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(prefix.info().size_bytes, 4096);
        let grown = FileDevice::open(&path, Some(2 << 20), false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(grown.info().size_bytes, 2 << 20);
        assert!(
            FileDevice::open(&path, Some(1000), false).is_err(),
            "not a block multiple"
        );
    }
}

/// `block_status` on a sparse file: the holes `lseek` reports, clamped to the range asked for
/// and bounded by `extents_max`.
#[cfg(test)]
mod block_status_tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn status(device: &FileDevice, offset: u64, length: u64, max: usize) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        device
            .block_status(offset, length, max, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        out.iter()
            .map(|e| (e.length_bytes, e.allocation == Allocation::Hole))
            .collect()
    }

    #[test]
    fn a_sparse_file_reports_its_holes() {
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("sparse");
        let file = File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        file.set_len(8 * MIB).unwrap_or_else(|e| panic!("{e}"));
        // Data at [1 MiB, 1 MiB + 64 KiB) and [5 MiB, 6 MiB); holes elsewhere.
        file.write_all_at(&[0xAB; 64 << 10], MIB)
            .unwrap_or_else(|e| panic!("{e}"));
        file.write_all_at(&vec![0xCD; MIB as usize], 5 * MIB)
            .unwrap_or_else(|e| panic!("{e}"));
        file.sync_all().unwrap_or_else(|e| panic!("{e}"));
        let device = FileDevice::open(&path, None, false).unwrap_or_else(|e| panic!("{e}"));
        let whole = status(&device, 0, 8 * MIB, 16);
        assert_eq!(
            whole,
            vec![
                (MIB, true),
                (64 << 10, false),
                (4 * MIB - (64 << 10), true),
                (MIB, false),
                (2 * MIB, true),
            ]
        );
        // Clamped to an unaligned range inside data and hole.
        assert_eq!(
            status(&device, MIB + 100, 100_000, 16),
            vec![
                ((64 << 10) - 100, false),
                (100_000 - (64 << 10) + 100, true)
            ]
        );
        // Bounded: two extents, the rest is for the next query.
        assert_eq!(
            status(&device, 0, 8 * MIB, 2),
            vec![(MIB, true), (64 << 10, false)]
        );
        // A served prefix ends the answer at its end, not the file's.
        let prefix =
            FileDevice::open(&path, Some(MIB + 4096), false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            status(&prefix, 0, MIB + 4096, 16),
            vec![(MIB, true), (4096, false)]
        );
        // Negative control: the same file filled in has no hole.
        file.write_all_at(&vec![1; 8 * MIB as usize], 0)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(status(&device, 0, 8 * MIB, 16), vec![(8 * MIB, false)]);
    }
}

#[cfg(test)]
mod read_only_tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::aligned::AlignedBuf;
    use crate::aligned::test_ring::{Outcome, TestRing};

    /// Issue 9 item 7: a `ro` namespace's file used to be opened read-write.
    #[test]
    fn a_read_only_file_cannot_be_written_through_the_device() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("ro");
        let original: Vec<u8> = (0..1u32 << 16).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &original).unwrap_or_else(|e| panic!("{e}"));

        let device = FileDevice::open(&path, None, true).unwrap_or_else(|e| panic!("{e}"));
        assert!(device.info().read_only);
        // The descriptor itself refuses writes: the kernel says EBADF.
        let written = device.file.write_at(&[0u8; 512], 0);
        assert_eq!(
            written.map_err(|e| e.raw_os_error()),
            Err(Some(libc::EBADF))
        );

        let mut queue = device.queue();
        let mut ring = TestRing::new();
        let mut buf = AlignedBuf::new_zeroed(4096);
        buf.as_mut_slice().fill(0xEE);
        let write = DeviceOp {
            user_data: 1,
            kind: OpKind::Write {
                offset: 0,
                buf: buf.as_slice(),
                fua: true,
            },
            buf_index: None,
            queue: 0,
        };
        let erofs = Outcome::Done(Err(FlashError::Io { errno: libc::EROFS }));
        assert_eq!(
            ring.submit_and_wait(queue.as_mut(), write, Nanos::ZERO, Nanos::ZERO),
            erofs
        );
        let trim = DeviceOp {
            user_data: 2,
            kind: OpKind::Trim {
                offset: 0,
                len: 4096,
            },
            buf_index: None,
            queue: 0,
        };
        assert_eq!(
            ring.submit_and_wait(queue.as_mut(), trim, Nanos::ZERO, Nanos::ZERO),
            erofs
        );
        // Reads still go through the ring.
        let read = DeviceOp {
            user_data: 3,
            kind: OpKind::Read {
                offset: 4096,
                buf: buf.as_mut_slice(),
            },
            buf_index: None,
            queue: 0,
        };
        assert_eq!(
            ring.submit_and_wait(queue.as_mut(), read, Nanos::ZERO, Nanos::ZERO),
            Outcome::Done(Ok(4096))
        );
        assert_eq!(buf.as_slice(), &original[4096..8192]);
        drop(queue);
        drop(device);
        assert_eq!(
            std::fs::read(&path).unwrap_or_else(|e| panic!("{e}")),
            original,
            "the file is unchanged"
        );
    }
}
