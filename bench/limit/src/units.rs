//! Command-line quantities: sizes (`4096`, `4k`, `1G`, `1GiB`; binary multiples) and
//! durations (`5s`, `500ms`, `100us`, `2m`; a bare number is seconds).

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("`{0}` is not a size (examples: 4096, 4k, 1G)")]
    Size(String),
    #[error("`{0}` is not a duration (examples: 5s, 500ms, 2m)")]
    Duration(String),
}

/// Splits `text` into its leading decimal number and the rest.
fn split_number(text: &str) -> (&str, &str) {
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    text.split_at(end)
}

pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let error = || UnitError::Size(text.to_string());
    let (number, suffix) = split_number(text.trim());
    let value: u64 = number.parse().map_err(|_| error())?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(error()),
    };
    value.checked_mul(1 << shift).ok_or_else(error)
}

pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let error = || UnitError::Duration(text.to_string());
    let (number, suffix) = split_number(text.trim());
    let value: f64 = number.parse().map_err(|_| error())?;
    let seconds_per_unit = match suffix {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        "m" | "min" => 60.0,
        _ => return Err(error()),
    };
    Duration::try_from_secs_f64(value * seconds_per_unit).map_err(|_| error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0.5s"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
