//! The `--verify` data pattern: every 8-byte word of the device gets a value that depends only
//! on its byte offset and the seed.
//!
//! Why a pure function of (offset, seed): writes during the run store exactly what the fill
//! stored, so a read is correct whatever writes to the same block ran concurrently, on any
//! connection, in any order — no bookkeeping of versions is needed, and any I/O size or
//! alignment (multiples of 8 bytes) can be checked. A server that drops writes, returns
//! zeroes, returns the wrong block or corrupts bytes fails the check; the offset of the
//! first differing byte is reported.

/// The pattern word at byte offset `offset_bytes` (a multiple of 8).
#[inline]
pub fn pattern_word(seed: u64, offset_bytes: u64) -> u64 {
    debug_assert!(offset_bytes.is_multiple_of(8));
    let mixed = (offset_bytes ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    mixed ^ (mixed >> 29) ^ seed
}

/// Fills `buf` with the pattern of the bytes at `offset_bytes`.
pub fn fill(seed: u64, offset_bytes: u64, buf: &mut [u8]) {
    assert!(offset_bytes.is_multiple_of(8));
    assert!(buf.len().is_multiple_of(8));
    for (index, word) in buf.chunks_exact_mut(8).enumerate() {
        let value = pattern_word(seed, offset_bytes + 8 * index as u64);
        word.copy_from_slice(&value.to_le_bytes());
    }
}

/// A byte that differs from the pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// Absolute byte offset of the first differing byte.
    pub offset_bytes: u64,
    pub expected: u8,
    pub found: u8,
}

/// Checks `buf` (read from `offset_bytes`) against the pattern; the first difference.
pub fn check(seed: u64, offset_bytes: u64, buf: &[u8]) -> Option<Mismatch> {
    assert!(offset_bytes.is_multiple_of(8));
    for (index, word) in buf.chunks(8).enumerate() {
        let word_offset = offset_bytes + 8 * index as u64;
        let expected = pattern_word(seed, word_offset).to_le_bytes();
        if word != &expected[..word.len()] {
            let position = word
                .iter()
                .zip(expected.iter())
                .position(|(found, expected)| found != expected)
                .unwrap_or(0);
            return Some(Mismatch {
                offset_bytes: word_offset + position as u64,
                expected: expected[position],
                found: word[position],
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_buffers_check_clean_and_damage_is_located() {
        let mut buf = vec![0u8; 4096];
        fill(7, 8192, &mut buf);
        assert_eq!(check(7, 8192, &buf), None);
        // The pattern of a sub-range is the sub-range of the pattern.
        assert_eq!(check(7, 8192 + 512, &buf[512..1024]), None);
        // Another seed or another offset does not match.
        assert!(check(8, 8192, &buf).is_some());
        assert!(check(7, 8192 + 4096, &buf).is_some());
        buf[1234] ^= 1;
        let mismatch = check(7, 8192, &buf).expect("damaged");
        assert_eq!(mismatch.offset_bytes, 8192 + 1234);
        assert_eq!(mismatch.found ^ mismatch.expected, 1);
        // All zeroes (a server that dropped the writes) never passes.
        assert!(check(7, 0, &[0u8; 512]).is_some());
    }
}
