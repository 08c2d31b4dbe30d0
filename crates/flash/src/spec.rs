//! Backend specifications: the strings operators write to name a namespace's storage.
//!
//! | spec | device |
//! |---|---|
//! | `file:PATH` or a bare `PATH` | file or block device ([`crate::file`]) |
//! | `mem:SIZE` | RAM ([`crate::mem`]) |
//! | `null` or `null:SIZE` | discards writes, reads zeroes ([`crate::null`]) |
//! | `emu:NAME` | the emulated Flash device with profile `NAME` ([`crate::emu`]) |
//!
//! Sizes ([`parse_size`]) are bytes with an optional binary suffix: `4096`, `64K`, `512M`,
//! `1G`, `2T` (also `1GiB`, `1gb`: always powers of 1024). The `size` argument of [`open`]
//! is the namespace size from the configuration; a size inside the spec (`mem:1G`) is the
//! same thing written inline, and the two must agree when both are given.

use std::path::Path;
use std::sync::Arc;

use crate::file::FileDevice;
use crate::mem::MemDevice;
use crate::null::{NULL_SIZE_DEFAULT_BYTES, NullDevice};
use crate::{Device, FlashError};

/// Opens the device a spec names. `size_bytes` is required for `mem` without an inline size
/// and for files that do not exist yet.
pub fn open(spec: &str, size_bytes: Option<u64>) -> Result<Arc<dyn Device>, FlashError> {
    let fail = |reason: String| FlashError::Open {
        spec: spec.to_string(),
        reason,
    };
    let spec_trimmed = spec.trim();
    if spec_trimmed.is_empty() {
        return Err(fail("empty backend spec".into()));
    }
    let (kind, rest) = match spec_trimmed.split_once(':') {
        Some((kind, rest)) if ["file", "mem", "null", "emu"].contains(&kind) => (kind, Some(rest)),
        _ if spec_trimmed == "null" || spec_trimmed == "mem" => (spec_trimmed, None),
        _ => ("file", Some(spec_trimmed)),
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
            Ok(Arc::new(FileDevice::open(Path::new(path), size_bytes)?))
        }
        "mem" => {
            let Some(size) = inline_size(rest)? else {
                return Err(fail("mem needs a size, e.g. mem:1G".into()));
            };
            let device = MemDevice::new(size).map_err(|e| match e {
                FlashError::Open { reason, .. } => fail(reason),
                other => other,
            })?;
            Ok(Arc::new(device))
        }
        "null" => {
            let size = inline_size(rest)?.unwrap_or(NULL_SIZE_DEFAULT_BYTES);
            if size == 0 || !size.is_multiple_of(512) {
                return Err(fail(format!(
                    "size {size} must be a non-zero multiple of 512 bytes"
                )));
            }
            Ok(Arc::new(NullDevice::new(size)))
        }
        "emu" => {
            let name = rest.unwrap_or_default();
            if name.is_empty() {
                return Err(fail("emu: needs a profile name, e.g. emu:NAME".into()));
            }
            open_emulated(spec_trimmed, name, size_bytes)
        }
        _ => Err(fail(format!("unknown backend kind {kind:?}"))),
    }
}

/// The emulated device ([`crate::emu`]) with profile `name`, at the configured size or the
/// emulator's default.
fn open_emulated(
    spec: &str,
    name: &str,
    size_bytes: Option<u64>,
) -> Result<Arc<dyn Device>, FlashError> {
    let _ = spec;
    let size = size_bytes.unwrap_or(crate::emu::EMU_SIZE_DEFAULT_BYTES);
    crate::emu::open(name, size)
}

/// Why a size string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error("size {0:?} is not a number with an optional K/M/G/T suffix")]
    Malformed(String),
    #[error("size {0:?} does not fit in 64 bits")]
    Overflow(String),
}

/// Parses `4096`, `64K`, `512M`, `1G`, `2T`, `1GiB`, `1gb` (binary multiples, case-insensitive).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(SizeError::Empty);
    }
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(SizeError::Malformed(text.to_string()));
    }
    let number: u64 = digits
        .parse()
        .map_err(|_| SizeError::Overflow(text.to_string()))?;
    let suffix = suffix.trim().to_ascii_lowercase();
    let shift = match suffix.as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(SizeError::Malformed(text.to_string())),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(text.to_string()))
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

    #[test]
    fn specs() {
        let mem = open("mem:1M", None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mem.info().size_bytes, 1 << 20);
        let mem = open("mem", Some(2 << 20)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mem.info().size_bytes, 2 << 20);
        assert!(open("mem", None).is_err());
        assert!(open("mem:1M", Some(2 << 20)).is_err());
        let null = open("null", None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(null.info().size_bytes, NULL_SIZE_DEFAULT_BYTES);
        let null = open("null:1G", None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(null.info().size_bytes, 1 << 30);
        assert!(open("", None).is_err());
        assert!(open("file:", None).is_err());
        assert!(open("emu:", None).is_err());

        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("bare");
        let path_text = path.to_str().unwrap_or_else(|| panic!("utf-8 temp path"));
        let bare = open(path_text, Some(1 << 20)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(bare.info().size_bytes, 1 << 20);
        let prefixed = open(&format!("file:{path_text}"), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(prefixed.info().size_bytes, 1 << 20);
    }
}
