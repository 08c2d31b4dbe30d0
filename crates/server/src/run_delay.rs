//! How long a dataplane thread waited for a CPU, from the kernel's per-thread schedstat
//! (`/proc/thread-self/schedstat`: run time, run-queue wait, timeslices, in nanoseconds).
//!
//! Why: online self-calibration must tell a slow device from a starved server. The busy share
//! the driver measures counts only the time it worked; a thread that is ready but waits
//! behind other processes looks idle or slow without being either. The two together say when
//! the server itself was the limit (`reflex_qos::CalibratorConfig::server_busy_max`).

use std::fs::File;
use std::os::unix::fs::FileExt;

use reflex_qos::Nanos;

/// How often the file is read (a `pread` of about 40 bytes).
const SAMPLE_INTERVAL: Nanos = Nanos(10_000_000);

/// The calling thread's run-queue wait, sampled at most every [`SAMPLE_INTERVAL`].
#[derive(Debug)]
pub struct RunDelay {
    /// `None` where the kernel has no schedstat (the figures then stay 0).
    file: Option<File>,
    last_ns: u64,
    next_sample: Nanos,
}

impl RunDelay {
    /// Opens the calling thread's schedstat: call it on the thread it is to measure.
    pub fn for_this_thread(now: Nanos) -> RunDelay {
        let file = File::open("/proc/thread-self/schedstat").ok();
        let mut run_delay = RunDelay {
            file,
            last_ns: 0,
            next_sample: now,
        };
        run_delay.last_ns = run_delay.read().unwrap_or(0);
        run_delay
    }

    /// The wait since the last sample, when a sample is due and the file answers.
    pub fn sample(&mut self, now: Nanos) -> Option<u64> {
        if now < self.next_sample {
            return None;
        }
        self.next_sample = now + SAMPLE_INTERVAL;
        let total = self.read()?;
        let delta = total.saturating_sub(self.last_ns);
        self.last_ns = total;
        Some(delta)
    }

    fn read(&self) -> Option<u64> {
        let file = self.file.as_ref()?;
        let mut buffer = [0u8; 96];
        let length = file.read_at(&mut buffer, 0).ok()?;
        parse_run_delay(std::str::from_utf8(&buffer[..length]).ok()?)
    }
}

/// The second field of a schedstat line.
fn parse_run_delay(text: &str) -> Option<u64> {
    text.split_ascii_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_field_is_the_run_queue_wait() {
        assert_eq!(parse_run_delay("2815934 57314 41\n"), Some(57_314));
        assert_eq!(parse_run_delay("2815934\n"), None);
        assert_eq!(parse_run_delay("a b c"), None);
    }

    #[test]
    fn this_thread_is_sampled_at_most_every_interval() {
        let mut run_delay = RunDelay::for_this_thread(Nanos::ZERO);
        // Without schedstat (a kernel without it) nothing is ever reported.
        let present = run_delay.file.is_some();
        assert_eq!(run_delay.sample(Nanos::ZERO).is_some(), present);
        assert_eq!(run_delay.sample(Nanos::from_millis(5)), None);
        assert_eq!(run_delay.sample(Nanos::from_millis(10)).is_some(), present);
    }
}
