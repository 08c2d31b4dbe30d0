//! Size strings (`64K`, `1GiB`): one parser for every configuration field and flag, outside
//! the `uring` feature so the sans-IO crates can use it.

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
