//! Parsing of command-line quantities: sizes with binary suffixes (`4k`, `1MiB`, `2g`),
//! durations (`5`, `5s`, `500ms`, `2m`), and rate lists (`10k,20k` or `10k:100k:10k`).

use std::time::Duration;

/// Largest number of rows a rate list or sweep may produce: bounds the run's length.
pub const RATE_ROWS_MAX: usize = 100;

/// `4096`, `4k`, `4K`, `4KiB`, `1m`, `1MiB`, `2g`, `1t` (binary multiples).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits_end);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 4k, 1MiB)"))?;
    let multiplier: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size suffix {other:?} in {text:?}")),
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `5` (seconds), `5s`, `500ms`, `250us`, `2m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 5s, 500ms)"))?;
    let seconds = match suffix {
        "" | "s" => value,
        "ms" => value / 1e3,
        "us" | "µs" => value / 1e6,
        "m" | "min" => value * 60.0,
        other => return Err(format!("unknown duration unit {other:?} in {text:?}")),
    };
    if !seconds.is_finite() || !(0.0..=86_400.0).contains(&seconds) {
        return Err(format!("{text:?} is out of range (0 .. 24 h)"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A rate: `50000`, `50k`, `1.5m` (decimal multiples: these are operations per second).
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let (number, multiplier) = match text.chars().last() {
        Some('k' | 'K') => (&text[..text.len() - 1], 1e3),
        Some('m' | 'M') => (&text[..text.len() - 1], 1e6),
        _ => (text, 1.0),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a rate (e.g. 50000, 50k)"))?;
    let rate = value * multiplier;
    if !rate.is_finite() || rate <= 0.0 {
        return Err(format!("rate {text:?} must be positive"));
    }
    Ok(rate)
}

/// Target rates of an open-loop run, one row each.
#[derive(Debug, Clone, PartialEq)]
pub struct RateList(pub Vec<f64>);

/// `10k,20k,40k` or `start:stop:step` (inclusive of stop).
pub fn parse_rate_list(text: &str) -> Result<RateList, String> {
    let rates = if text.contains(':') {
        let parts: Vec<&str> = text.split(':').collect();
        let [start, stop, step] = parts[..] else {
            return Err(format!("{text:?}: a sweep is start:stop:step"));
        };
        let (start, stop, step) = (parse_rate(start)?, parse_rate(stop)?, parse_rate(step)?);
        if stop < start {
            return Err(format!("{text:?}: stop is below start"));
        }
        let count = ((stop - start) / step + 1e-9).floor() as usize + 1;
        if count > RATE_ROWS_MAX {
            return Err(format!(
                "{text:?} gives {count} rows, at most {RATE_ROWS_MAX}"
            ));
        }
        (0..count)
            .map(|index| start + step * index as f64)
            .collect()
    } else {
        text.split(',')
            .map(parse_rate)
            .collect::<Result<Vec<_>, _>>()?
    };
    if rates.is_empty() || rates.len() > RATE_ROWS_MAX {
        return Err(format!("between 1 and {RATE_ROWS_MAX} rates"));
    }
    Ok(RateList(rates))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_durations_and_rates() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("4q").is_err());
        assert!(parse_size("k").is_err());
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("3d").is_err());
        assert_eq!(parse_rate("50k"), Ok(50_000.0));
        assert_eq!(
            parse_rate_list("10k,20k"),
            Ok(RateList(vec![10_000.0, 20_000.0]))
        );
        assert_eq!(
            parse_rate_list("10k:30k:10k"),
            Ok(RateList(vec![10_000.0, 20_000.0, 30_000.0]))
        );
        assert!(parse_rate_list("1:1000000:1").is_err());
        assert!(parse_rate_list("0").is_err());
    }
}
