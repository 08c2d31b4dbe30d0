//! Publishing what this thread measured to the control plane, where online self-calibration
//! (`docs/QOS.md` §11) closes its windows: every half window while something was measured,
//! each namespace's LC read latencies and tokens spent since the last time.
//!
//! Why half a window: the control plane closes a window at the first publication after its
//! end, so each window holds about one window's worth from every thread; a thread that
//! measured nothing publishes nothing and an idle server never wakes for it.

use reflex_qos::Nanos;

use super::Dataplane;

/// The shortest publication interval, whatever the window (a lock per thread per interval).
const PUBLISH_INTERVAL_MIN: Nanos = Nanos(1_000_000);

/// The thread's CPU counters at a publication: the next one's busy share is measured from it.
#[derive(Debug, Clone, Copy)]
pub(super) struct CpuMark {
    at: Nanos,
    idle_ns: u64,
    run_delay_ns: u64,
}

impl CpuMark {
    pub(super) fn new(now: Nanos) -> CpuMark {
        CpuMark {
            at: now,
            idle_ns: 0,
            run_delay_ns: 0,
        }
    }

    /// The share of the time since this mark the thread was working or waiting for a CPU
    /// (an upper estimate: a wait for a CPU while working counts twice; at most 1), and the
    /// mark for the next interval.
    fn busy_since(self, now: Nanos, idle_ns: u64, run_delay_ns: u64) -> (f64, CpuMark) {
        let elapsed = now.saturating_since(self.at).0;
        let idle = idle_ns.saturating_sub(self.idle_ns).min(elapsed);
        let delayed = run_delay_ns.saturating_sub(self.run_delay_ns);
        let busy = if elapsed == 0 {
            0.0
        } else {
            ((elapsed - idle).saturating_add(delayed) as f64 / elapsed as f64).min(1.0)
        };
        let next = CpuMark {
            at: now,
            idle_ns,
            run_delay_ns,
        };
        (busy, next)
    }
}

/// How often a thread publishes for windows of `window` (`None`: calibration off).
pub(super) fn publish_interval(enabled: bool, window: Nanos) -> Option<Nanos> {
    enabled.then(|| Nanos(window.0 / 2).max(PUBLISH_INTERVAL_MIN))
}

impl Dataplane {
    /// When the next publication is due, if anything waits to be published.
    pub(super) fn telemetry_deadline(&self) -> Option<Nanos> {
        self.telemetry_interval?;
        self.telemetry
            .iter()
            .any(|namespace| !namespace.window.is_empty())
            .then_some(self.telemetry_publish_at)
    }

    /// Hands each namespace's window to the control plane once the interval has passed.
    pub(super) fn publish_telemetry(&mut self, now: Nanos) {
        let Some(interval) = self.telemetry_interval else {
            return;
        };
        if now < self.telemetry_publish_at {
            return;
        }
        self.telemetry_publish_at = now + interval;
        let (busy, mark) =
            self.telemetry_cpu_mark
                .busy_since(now, self.live.idle_ns, self.live.run_delay_ns);
        self.telemetry_cpu_mark = mark;
        let server_busy = if self.live.cpu_measured { busy } else { 0.0 };
        for index in 0..self.telemetry.len() {
            if self.telemetry[index].window.is_empty() {
                continue;
            }
            let mut window = std::mem::take(&mut self.telemetry[index].window);
            window.server_busy = server_busy;
            window.lc_queued_requests = Some(self.qos.get(index).map_or(0, |namespace| {
                namespace
                    .scheduler
                    .queued_in_class(reflex_qos::TenantClass::LatencyCritical)
            }));
            self.with_control(now, |control, thread, own| {
                control.publish_window(thread, index as u16, &window, now, own);
            });
            // Keep the histograms' memory for the next window.
            window.clear();
            self.telemetry[index].window = window;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_share_counts_work_and_waits_for_a_cpu() {
        let mark = CpuMark::new(Nanos::from_millis(100));
        // 50 ms: 40 idle, so 10 working, and 5 waiting for a CPU.
        let (busy, mark) = mark.busy_since(Nanos::from_millis(150), 40_000_000, 5_000_000);
        assert!((busy - 0.3).abs() < 1e-9, "{busy}");
        // The next interval counts from the mark: 50 ms, all idle.
        let (busy, mark) = mark.busy_since(Nanos::from_millis(200), 90_000_000, 5_000_000);
        assert_eq!(busy, 0.0);
        // Never above 1, even when the waits overlap the work; nothing at all for no time.
        let (busy, mark) = mark.busy_since(Nanos::from_millis(250), 90_000_000, 60_000_000);
        assert_eq!(busy, 1.0);
        assert_eq!(mark.busy_since(Nanos::from_millis(250), 0, 0).0, 0.0);
    }
}
