//! The pre-shared key file both ends read: the format `psktool` (GnuTLS) writes and nbdkit,
//! qemu and libnbd read, one `identity:hexkey` per line. Here because the server and the
//! client library must agree on it byte for byte.

use std::collections::HashMap;

/// Why a key file does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PskFileError {
    #[error("line {line}: {reason}")]
    Line { line: usize, reason: &'static str },
    #[error("no key in the file")]
    Empty,
}

/// Longest identity (TLS 1.3 allows 2^16 − 1 bytes; psktool and OpenSSL's callbacks far less).
pub const IDENTITY_BYTES_MAX: usize = 255;
/// Longest key (OpenSSL's `PSK_MAX_PSK_LEN`).
pub const KEY_BYTES_MAX: usize = 256;

/// Parses a key file's text: `identity:hexkey` lines; blank lines are ignored.
pub fn parse(text: &str) -> Result<HashMap<String, Vec<u8>>, PskFileError> {
    let mut keys = HashMap::new();
    for (number, line) in text.lines().enumerate() {
        let line_error = |reason| PskFileError::Line {
            line: number + 1,
            reason,
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((identity, hex)) = line.split_once(':') else {
            return Err(line_error("expected identity:hexkey"));
        };
        if identity.is_empty() || identity.len() > IDENTITY_BYTES_MAX {
            return Err(line_error("the identity must be 1 to 255 bytes"));
        }
        let key = decode_hex(hex).ok_or(line_error("the key is not hexadecimal"))?;
        if key.is_empty() || key.len() > KEY_BYTES_MAX {
            return Err(line_error("the key must be 1 to 256 bytes"));
        }
        if keys.insert(identity.to_string(), key).is_some() {
            return Err(line_error("the identity appears twice"));
        }
    }
    if keys.is_empty() {
        return Err(PskFileError::Empty);
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_psktool_lines() {
        let keys = parse("A:0a0B\n\nB:ff\n").unwrap();
        assert_eq!(keys["A"], vec![0x0a, 0x0b]);
        assert_eq!(keys["B"], vec![0xff]);
    }

    #[test]
    fn refuses_what_psktool_would_not_write() {
        let line = |line, reason| Err(PskFileError::Line { line, reason });
        assert_eq!(parse(""), Err(PskFileError::Empty));
        assert_eq!(parse("A0a0b"), line(1, "expected identity:hexkey"));
        assert_eq!(parse(":0a"), line(1, "the identity must be 1 to 255 bytes"));
        assert_eq!(parse("A:0g"), line(1, "the key is not hexadecimal"));
        assert_eq!(parse("A:0a0"), line(1, "the key is not hexadecimal"));
        assert_eq!(parse("A:é1"), line(1, "the key is not hexadecimal"));
        assert_eq!(parse("A:"), line(1, "the key must be 1 to 256 bytes"));
        assert_eq!(parse("A:01\nA:02"), line(2, "the identity appears twice"));
    }
}
