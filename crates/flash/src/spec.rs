//! Backend specifications: the strings operators write to name a namespace's storage.
//!
//! | spec | device |
//! |---|---|
//! | `file:PATH` or a bare `PATH` without `:` | file or block device ([`crate::file`]) |
//! | `mem:SIZE` | RAM ([`crate::mem`]) |
//! | `null` or `null:SIZE` | discards writes, reads zeroes ([`crate::null`]) |
//! | `emu:NAME` | the emulated Flash device with profile `NAME` ([`crate::emu`]) |
//! | `emu(KEY=VALUE;...):NAME` | the same, drifting by a schedule: `emu(slow=2x@10s;stall=40s-41s):device-a-small` ([`crate::emu::drift`]) |
//! | `fault:SPEC` or `fault(KEY=VALUE;...):SPEC` | any of these with injected faults ([`crate::fault`]) |
//!
//! The text before the first `:` must be one of those kinds ([`BACKEND_KINDS`]): a typo such
//! as `foo:bar` is refused rather than taken as a file name, so a path that really contains
//! `:` is written `file:foo:bar`.
//!
//! Sizes ([`parse_size`]) are bytes with an optional binary suffix: `4096`, `64K`, `512M`,
//! `1G`, `2T` (also `1GiB`, `1gb`: always powers of 1024). [`OpenOptions::size_bytes`] is the
//! namespace size from the configuration; a size inside the spec (`mem:1G`) is the same thing
//! written inline, and the two must agree when both are given. A `mem` device larger than the
//! machine's available memory (`MemAvailable` in `/proc/meminfo`) is refused: it would be
//! accepted lazily and then fail, or summon the OOM killer, long after startup.
//!
//! [`OpenOptions::read_only`] opens the device so that it cannot write: a file `O_RDONLY`,
//! and every device refuses writes and trims and reports `read_only` in its [`DeviceInfo`].
//!
//! [`DeviceInfo`]: crate::DeviceInfo

use std::path::Path;
use std::sync::Arc;

use crate::emu::{EMU_SIZE_DEFAULT_BYTES, EmuFlash};
use crate::fault::FaultDevice;
use crate::file::FileDevice;
use crate::mem::MemDevice;
use crate::null::{NULL_SIZE_DEFAULT_BYTES, NullDevice};
pub use crate::size::{SizeError, parse_size};
use crate::{Device, FlashError};

/// The kinds a spec may start with (`KIND:...`).
pub const BACKEND_KINDS: [&str; 5] = ["file", "mem", "null", "emu", "fault"];

/// How to open a namespace's device, besides its spec.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// The configured namespace size. Required for `mem` without an inline size and for
    /// files that do not exist yet.
    pub size_bytes: Option<u64>,
    /// A read-only namespace: the device must not be able to write.
    pub read_only: bool,
}

/// Opens the device a spec names.
pub fn open(spec: &str, options: OpenOptions) -> Result<Arc<dyn Device>, FlashError> {
    let fail = |reason: String| FlashError::Open {
        spec: spec.to_string(),
        reason,
    };
    let size_bytes = options.size_bytes;
    let spec_trimmed = spec.trim();
    if spec_trimmed.is_empty() {
        return Err(fail("empty backend spec".into()));
    }
    if spec_trimmed.starts_with("fault:")
        || spec_trimmed.starts_with("fault(")
        || spec_trimmed == "fault"
    {
        let (plan, inner_spec) =
            crate::fault::split_spec(spec_trimmed).map_err(|e| fail(e.to_string()))?;
        let inner = open(inner_spec, options)?;
        let device = FaultDevice::new(inner, plan).map_err(|e| fail(e.to_string()))?;
        return Ok(Arc::new(device));
    }
    if spec_trimmed.starts_with("emu(") {
        let size = size_bytes.unwrap_or(EMU_SIZE_DEFAULT_BYTES);
        let device = EmuFlash::open(spec_trimmed, size)?;
        return Ok(Arc::new(device.with_read_only(options.read_only)));
    }
    let (kind, rest) = match spec_trimmed.split_once(':') {
        Some((kind, rest)) if BACKEND_KINDS.contains(&kind) => (kind, Some(rest)),
        Some((kind, _)) => {
            return Err(fail(format!(
                "unknown backend kind {kind:?}; known kinds: {} (a path containing ':' is \
                 written file:PATH)",
                BACKEND_KINDS.join(", ")
            )));
        }
        None if spec_trimmed == "null" || spec_trimmed == "mem" => (spec_trimmed, None),
        None => ("file", Some(spec_trimmed)),
    };
    let inline_size = |rest: Option<&str>| -> Result<Option<u64>, FlashError> {
        match rest {
            None => Ok(size_bytes),
            Some(text) => {
                let inline = parse_size(text).map_err(|e| fail(e.to_string()))?;
                match size_bytes {
                    Some(given) if given != inline => Err(fail(format!(
                        "size {inline} in the spec disagrees with the configured size {given}"
                    ))),
                    _ => Ok(Some(inline)),
                }
            }
        }
    };
    match kind {
        "file" => {
            let path = rest.unwrap_or_default();
            if path.is_empty() {
                return Err(fail("file: needs a path".into()));
            }
            Ok(Arc::new(FileDevice::open(
                Path::new(path),
                size_bytes,
                options.read_only,
            )?))
        }
        "mem" => {
            let Some(size) = inline_size(rest)? else {
                return Err(fail("mem needs a size, e.g. mem:1G".into()));
            };
            check_mem_size(size, mem_available_bytes()).map_err(fail)?;
            let device = MemDevice::new(size).map_err(|e| match e {
                FlashError::Open { reason, .. } => fail(reason),
                other => other,
            })?;
            Ok(Arc::new(device.with_read_only(options.read_only)))
        }
        "null" => {
            let size = inline_size(rest)?.unwrap_or(NULL_SIZE_DEFAULT_BYTES);
            if size == 0 || !size.is_multiple_of(512) {
                return Err(fail(format!(
                    "size {size} must be a non-zero multiple of 512 bytes"
                )));
            }
            Ok(Arc::new(
                NullDevice::new(size).with_read_only(options.read_only),
            ))
        }
        "emu" => {
            let name = rest.unwrap_or_default();
            if name.is_empty() {
                return Err(fail("emu: needs a profile name, e.g. emu:NAME".into()));
            }
            let size = size_bytes.unwrap_or(EMU_SIZE_DEFAULT_BYTES);
            let device = EmuFlash::open(name, size)?;
            Ok(Arc::new(device.with_read_only(options.read_only)))
        }
        _ => unreachable!("kind {kind:?} is in BACKEND_KINDS but not opened"),
    }
}

/// Refuses a `mem` device larger than the available memory; an unknown amount refuses
/// nothing.
fn check_mem_size(size_bytes: u64, available_bytes: Option<u64>) -> Result<(), String> {
    match available_bytes {
        Some(available) if size_bytes > available => Err(format!(
            "mem size {size_bytes} bytes ({:.1} GiB) is more than the machine's available \
             memory, {available} bytes ({:.1} GiB, MemAvailable in /proc/meminfo)",
            size_bytes as f64 / f64::from(1u32 << 30),
            available as f64 / f64::from(1u32 << 30),
        )),
        _ => Ok(()),
    }
}

/// `MemAvailable` from `/proc/meminfo`, in bytes; `None` when it cannot be read.
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

/// The `MemAvailable:  N kB` line of a `/proc/meminfo` text, in bytes.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))?;
    let kibibytes = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kibibytes.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("G"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("1Q"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse_size("99999999999T"),
            Err(SizeError::Overflow(_))
        ));
    }

    fn sized(size_bytes: Option<u64>) -> OpenOptions {
        OpenOptions {
            size_bytes,
            read_only: false,
        }
    }

    fn open_error(spec: &str, options: OpenOptions) -> String {
        match open(spec, options) {
            Ok(device) => panic!("{spec} opened as {}", device.info().description),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn specs() {
        let mem = open("mem:1M", sized(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mem.info().size_bytes, 1 << 20);
        let mem = open("mem", sized(Some(2 << 20))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mem.info().size_bytes, 2 << 20);
        assert!(open("mem", sized(None)).is_err());
        assert!(open("mem:1M", sized(Some(2 << 20))).is_err());
        let null = open("null", sized(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(null.info().size_bytes, NULL_SIZE_DEFAULT_BYTES);
        let null = open("null:1G", sized(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(null.info().size_bytes, 1 << 30);
        assert!(open("", sized(None)).is_err());
        assert!(open("file:", sized(None)).is_err());
        assert!(open("emu:", sized(None)).is_err());

        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("bare");
        let path_text = path.to_str().unwrap_or_else(|| panic!("utf-8 temp path"));
        let bare = open(path_text, sized(Some(1 << 20))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(bare.info().size_bytes, 1 << 20);
        let prefixed =
            open(&format!("file:{path_text}"), sized(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(prefixed.info().size_bytes, 1 << 20);
    }

    /// Issue 9 item 7: `foo:bar` used to create a file named `foo:bar`.
    #[test]
    fn unknown_kind_is_refused_and_file_prefix_allows_colons() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let before = std::env::current_dir().unwrap_or_else(|e| panic!("{e}"));
        let error = open("foo:bar", sized(Some(1 << 20)));
        let error = match error {
            Ok(_) => panic!("foo:bar was opened"),
            Err(error) => error.to_string(),
        };
        assert!(error.contains("unknown backend kind \"foo\""), "{error}");
        for kind in BACKEND_KINDS {
            assert!(error.contains(kind), "{error} must name {kind}");
        }
        assert!(error.contains("file:PATH"), "{error}");
        assert!(!before.join("foo:bar").exists(), "no file may be created");
        assert!(open("/data/a:b", sized(Some(1 << 20))).is_err());

        let colon = dir.path().join("foo:bar");
        let colon_text = colon.to_str().unwrap_or_else(|| panic!("utf-8 temp path"));
        let device = open(&format!("file:{colon_text}"), sized(Some(1 << 20)))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(device.info().size_bytes, 1 << 20);
        assert!(colon.exists());
    }

    #[test]
    fn mem_above_available_memory_is_refused() {
        let meminfo = "MemTotal:       24684096 kB\nMemFree:        23239984 kB\n\
                       MemAvailable:   24341508 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(24_341_508 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots\n"), None);

        let available = 24_341_508 * 1024;
        assert_eq!(check_mem_size(1 << 30, Some(available)), Ok(()));
        assert_eq!(
            check_mem_size(1 << 40, None),
            Ok(()),
            "unknown: not refused"
        );
        let error = check_mem_size(1 << 40, Some(available)).unwrap_err();
        assert!(error.contains(&(1u64 << 40).to_string()), "{error}");
        assert!(error.contains(&available.to_string()), "{error}");

        // And through the spec, against this machine. Twice what is available now: the
        // amount moves while other tests run, so "one sector above" raced it.
        if let Some(available) = mem_available_bytes() {
            let above = (available * 2 / 512 + 1) * 512;
            let error = open_error(&format!("mem:{above}"), sized(None));
            assert!(error.contains(&above.to_string()), "{error}");
            assert!(error.contains("MemAvailable"), "{error}");
            let error = open_error("mem", sized(Some(above)));
            assert!(error.contains("available memory"), "{error}");
        }
    }

    #[test]
    fn read_only_reaches_every_device() {
        let read_only = |size_bytes| OpenOptions {
            size_bytes,
            read_only: true,
        };
        for spec in ["mem:1M", "null:1M", "emu:device-a-small", "fault:mem:1M"] {
            let device = open(spec, read_only(None)).unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert!(device.info().read_only, "{spec}");
            let data = [1u8; 512];
            let write = crate::DeviceOp {
                user_data: 1,
                kind: crate::OpKind::Write {
                    offset: 0,
                    buf: &data,
                    fua: false,
                },
                buf_index: None,
                queue: 0,
            };
            let refused = device.queue().submit(write, reflex_qos::Nanos::ZERO);
            assert!(
                matches!(
                    refused,
                    crate::Submit::Done(Err(FlashError::Io { errno: libc::EROFS }))
                ),
                "{spec}: {refused:?}"
            );
            let writable = open(spec, sized(None)).unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert!(!writable.info().read_only, "{spec}");
        }
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("ro");
        let spec = format!("file:{}", path.display());
        let error = open_error(&spec, read_only(Some(1 << 20)));
        assert!(error.contains("cannot create"), "{error}");
        assert!(!path.exists(), "a read-only namespace creates no file");
        drop(open(&spec, sized(Some(1 << 20))).unwrap_or_else(|e| panic!("{e}")));
        let error = open_error(&spec, read_only(Some(2 << 20)));
        assert!(error.contains("cannot grow"), "{error}");
        let device = open(&spec, read_only(None)).unwrap_or_else(|e| panic!("{e}"));
        assert!(device.info().read_only);
        assert!(device.info().description.contains("O_RDONLY"));
    }

    /// Issue 11 item 4: an emulated device that drifts by a schedule in its spec, with its
    /// run-time handle reachable from `Arc<dyn Device>`, through a `fault:` wrapper too.
    #[test]
    fn emu_specs_with_a_drift_schedule() {
        let device = open("emu(slow=2x@0s):device-a-small", sized(Some(64 << 20)))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            device
                .info()
                .description
                .contains("drift schedule slow=2x@0s"),
            "{}",
            device.info().description
        );
        let controls = device
            .emu_controls()
            .unwrap_or_else(|| panic!("an emulated device has drift controls"));
        // The schedule counts from the first `now`: a lone read-only read takes 2 × (40 µs of
        // die time + 10 µs of controller).
        let mut queue = device.queue();
        let mut page = [0u8; 4096];
        let read = crate::DeviceOp {
            user_data: 1,
            kind: crate::OpKind::Read {
                offset: 0,
                buf: &mut page,
            },
            buf_index: None,
            queue: 0,
        };
        let start = reflex_qos::Nanos::from_millis(5);
        assert!(matches!(queue.submit(read, start), crate::Submit::Pending));
        assert_eq!(
            queue.next_deadline(),
            Some(start + reflex_qos::Nanos::from_micros(100))
        );
        assert_eq!(controls.state().slowdown_permille, 2000);

        let wrapped = open(
            "fault(delay=5ms;delay_every=100):emu(stall=1s-2s):device-a-small",
            sized(None),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(wrapped.fault_controls().is_some());
        assert!(
            wrapped.emu_controls().is_some(),
            "fault forwards the handle"
        );
        assert!(open("mem:1M", sized(None)).is_ok_and(|d| d.emu_controls().is_none()));
        let read_only = OpenOptions {
            size_bytes: None,
            read_only: true,
        };
        let device =
            open("emu(slow=3x@1s):device-a-small", read_only).unwrap_or_else(|e| panic!("{e}"));
        assert!(device.info().read_only);

        for (spec, expected) in [
            (
                "emu(slow=2x):device-a-small",
                "expected FACTOR@TIME such as 2x@10s",
            ),
            ("emu(slow=2x@10):device-a-small", "time with a unit"),
            (
                "emu(fast=2x@1s):device-a-small",
                "unknown emu parameter \"fast\"",
            ),
            ("emu(slow=1000x@1s):device-a-small", "outside 0.1x to 100x"),
            ("emu(stall=2s-1s):device-a-small", "FROM before TO"),
            ("emu(stall=1s-3s;stall=2s-4s):device-a-small", "overlap"),
            ("emu(slow=2x@1s", "no closing"),
            ("emu(slow=2x@1s)device-a-small", "followed by ':'"),
            ("emu(slow=2x@1s):", "needs a profile name"),
            ("emu(slow=2x@1s):nope", "no shipped emulated-device profile"),
        ] {
            let error = open_error(spec, sized(None));
            assert!(error.contains(expected), "{spec}: {error}");
        }
    }

    #[test]
    fn fault_specs() {
        let device = open("fault:mem:1M", sized(None)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(device.info().size_bytes, 1 << 20);
        let controls = device
            .fault_controls()
            .unwrap_or_else(|| panic!("a fault device has controls"));
        assert!(controls.plan().is_empty());
        let device = open(
            "fault(read_error_rate=1%;delay=5ms;delay_every=10):fault(stall):null",
            sized(Some(1 << 20)),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(device.info().size_bytes, 1 << 20);
        let plan = device.fault_controls().map(|c| c.plan());
        assert_eq!(plan.map(|p| p.read.error_rate), Some(0.01));
        assert!(open("mem:1M", sized(None)).is_ok_and(|device| device.fault_controls().is_none()));

        for (spec, expected) in [
            ("fault", "needs an inner backend"),
            ("fault:", "needs an inner backend"),
            ("fault():", "needs an inner backend"),
            ("fault(stall", "no closing"),
            ("fault(stall)mem:1M", "followed by ':'"),
            ("fault(bogus=1):mem:1M", "unknown fault parameter \"bogus\""),
            ("fault(read_error_rate=2):mem:1M", "rate between 0 and 1"),
            ("fault(delay=5):mem:1M", "duration"),
            ("fault(delay_every=3):mem:1M", "needs delay"),
            (
                "fault(flush_error_lba=1-2):mem:1M",
                "flush has no block range",
            ),
            ("fault(errno=EWHAT):mem:1M", "EIO"),
            ("fault(seed=1,seed=2):mem:1M", "given twice"),
            ("fault(read_error_rate=1%):foo:bar", "unknown backend kind"),
            ("fault:mem", "mem needs a size"),
        ] {
            let error = open_error(spec, sized(None));
            assert!(error.contains(expected), "{spec}: {error}");
        }
    }
}
