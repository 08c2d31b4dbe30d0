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
        for index in 0..self.telemetry.len() {
            if self.telemetry[index].window.is_empty() {
                continue;
            }
            let window = std::mem::take(&mut self.telemetry[index].window);
            self.with_control(now, |control, thread, own| {
                control.publish_window(thread, index as u16, &window, now, own);
            });
            // Keep the histograms' memory for the next window.
            let mut window = window;
            window.clear();
            self.telemetry[index].window = window;
        }
    }
}
