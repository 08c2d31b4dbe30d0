//! Online self-calibration of one device, on the control plane's side (`docs/QOS.md` §11):
//! the threads' telemetry windows are merged here, and when the calibrator's window has ended
//! the merged window becomes its observation and the decision a new device rate scale.
//!
//! The signal: latency-critical reads from their submission to the device to their answer
//! leaving (what the device and the server's own timing add; the time a tenant's requests
//! waited for its own tokens is its own doing and no device rate changes it). The target:
//! the strictest LC SLO minus the configured client share.

use reflex_qos::{
    Calibrator, CalibratorConfig, CalibratorConfigError, CalibratorStats, Decision, DeviceProfile,
    LoadMode, Nanos, ObservationError, Plan, WindowObservation,
};

use crate::core::TelemetryWindow;

/// A device's calibrator and the window it is collecting.
#[derive(Debug)]
pub struct DeviceCalibration {
    calibrator: Calibrator,
    window: TelemetryWindow,
    /// The last observation, for operators.
    last: Option<WindowObservation>,
    /// The learned network share (µs), smoothed over windows; `None` before the first sample.
    network_share_us: Option<f64>,
    /// The share outside the server learned from clients' REPORTs (µs), smoothed over
    /// windows; `None` before the first window with a report.
    reported_share_us: Option<f64>,
    /// The last backlog clients reported, and how many windows ago.
    client_backlog: Option<(u64, u32)>,
}

/// Windows a reported client backlog stands for when no report arrives (clients report every
/// 25 ms by default, windows are 50–100 ms; one report may miss a window): after that the
/// client is taken to have none.
const CLIENT_BACKLOG_WINDOWS: u32 = 2;

/// What an operator sees of a device's calibration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CalibrationInfo {
    pub stats: CalibratorStats,
    pub last: Option<WindowObservation>,
}

impl DeviceCalibration {
    pub fn new(config: CalibratorConfig, now: Nanos) -> Result<Self, CalibratorConfigError> {
        Ok(DeviceCalibration {
            calibrator: Calibrator::new(config, now)?,
            window: TelemetryWindow::default(),
            last: None,
            network_share_us: None,
            reported_share_us: None,
            client_backlog: None,
        })
    }

    /// Adds what a thread measured; true when the calibrator's window has ended.
    pub fn add(&mut self, window: &TelemetryWindow, now: Nanos) -> bool {
        self.window.merge(window);
        now >= self.calibrator.next_deadline()
    }

    /// Closes the window: the merged measurements against `plan` (the device rate in use and
    /// the strictest SLO) give the calibrator's decision.
    /// The device's `profile` says what p95 the load it was driven at should give.
    pub fn close(
        &mut self,
        now: Nanos,
        plan: &Plan,
        profile: &DeviceProfile,
    ) -> Result<Decision, ObservationError> {
        let window_start = self.calibrator.window_start();
        let config = self.calibrator.config();
        let mode = plan.admission_mode();
        let m = mode.index();
        let device = plan.device_tokens_per_sec[m].as_tokens_per_sec_f64();
        let reserved = plan.lc_reserved_tokens_per_sec[m].as_tokens_per_sec_f64();
        // The profile's rate is the device rate without the scale; below it, LC reservations
        // may take all but the best-effort floor.
        let lc_share = 1.0 - config.best_effort_floor;
        let lc_fit_scale = (plan.lc_tenants > 0 && device > 0.0 && plan.rate_scale > 0.0)
            .then(|| reserved / (lc_share * device / plan.rate_scale));
        let weight = config.network_share_weight;
        // Either share counts for at most this; a sample is capped before it is smoothed.
        let cap = plan
            .latency_us_p95
            .map_or(0.0, |slo| slo as f64 * config.network_share_max);
        // The network's share of what LC tenants see: a quantile of the sampled round trips,
        // smoothed over windows (a window without samples keeps the estimate: its reads had
        // no answer to sample yet).
        let rtt = &self.window.network_rtt;
        if config.learn_network_rtt && rtt.count() > 0 {
            let sample = rtt.quantile_us(config.network_share_quantile) as f64;
            smooth_capped(&mut self.network_share_us, sample, weight, cap);
        }
        // What clients report supersedes the round trips: it holds the network too, and what
        // no socket shows (the client's wake-ups, its CPU's other work). A window's sample is
        // the share that would have put the worst-off tenant's p95 exactly at its SLO: the
        // strictest SLO less the server's p95 of the window plus the largest reported excess
        // (for one SLO: the client's p95 less the server's).
        let service_reads = self.window.lc_reads_service.count();
        let service_p95_us = self.window.lc_reads_service.quantile_us(0.95);
        if let (true, Some(excess_us), Some(slo_us), true) = (
            config.learn_client_reports,
            self.window.client_excess_us,
            plan.latency_us_p95,
            service_reads > 0,
        ) {
            let sample = slo_us as f64 - service_p95_us as f64 + excess_us as f64;
            smooth_capped(&mut self.reported_share_us, sample, weight, cap);
        }
        let learned = match (self.reported_share_us, self.network_share_us) {
            (Some(reported), _) if config.learn_client_reports => reported,
            (_, Some(network)) if config.learn_network_rtt => network,
            _ => 0.0,
        };
        let learned_outside_us = learned.min(cap).round() as u64;
        let tokens_spent = self.window.tokens_spent.as_tokens_f64().max(0.0);
        let seconds = now.saturating_since(window_start).as_secs_f64();
        let profile_p95_at_load_us = (seconds > 0.0).then(|| {
            profile.latency_at(tokens_spent / seconds, matches!(mode, LoadMode::ReadOnly))
        });
        let observation = WindowObservation {
            lc_reads: service_reads,
            lc_read_latency_us_p95: service_p95_us,
            slo_latency_us_p95: plan.latency_us_p95,
            client_share_us: config.client_share_us + learned_outside_us,
            tokens_per_sec_in_use: device,
            tokens_spent,
            lc_fit_scale,
            server_busy: self.window.server_busy,
            profile_p95_at_load_us,
            lc_queued_requests: self
                .window
                .lc_queued_requests
                .map(|queued| queued + self.client_backlog()),
        };
        self.window.clear();
        self.last = Some(observation);
        self.calibrator.handle_window(now, &observation)
    }

    /// The backlog clients reported (the window's, else the last for
    /// [`CLIENT_BACKLOG_WINDOWS`] windows): LC requests waiting to be sent, which the server
    /// cannot see. Called once per window.
    fn client_backlog(&mut self) -> u64 {
        self.client_backlog = match (self.window.client_backlog, self.client_backlog) {
            (Some(backlog), _) => Some((backlog, 0)),
            (None, Some((backlog, age))) if age < CLIENT_BACKLOG_WINDOWS => {
                Some((backlog, age + 1))
            }
            (None, _) => None,
        };
        self.client_backlog.map_or(0, |(backlog, _)| backlog)
    }

    /// The target the last window was held to (µs; the calibrator's, `target_ratio`
    /// included).
    pub fn last_target_us(&self) -> Option<u64> {
        self.last
            .as_ref()
            .and_then(|observation| self.calibrator.target_us(observation))
    }

    pub fn info(&self) -> CalibrationInfo {
        CalibrationInfo {
            stats: self.calibrator.stats(),
            last: self.last,
        }
    }
}

/// Moves a smoothed estimate towards `sample`, first brought into `0..=cap`, by `weight` (the
/// first sample sets it). Capping first matters after a backlog: while a slowed device's
/// queue drains, clients report p95s of tens of milliseconds, and smoothed as they are such
/// samples held the estimate above the cap (the target at its strictest) for a second or more
/// after the queue was gone.
fn smooth_capped(estimate: &mut Option<f64>, sample: f64, weight: f64, cap: f64) {
    let sample = sample.clamp(0.0, cap);
    *estimate = Some(estimate.map_or(sample, |e| e + weight * (sample - e)));
}

#[cfg(test)]
mod tests {
    use super::smooth_capped;

    /// One window of a drained backlog (a client p95 of 50 ms) leaves the learned share at
    /// the cap, not 200 times above it: ten ordinary windows later it is back near what the
    /// clients see.
    #[test]
    fn a_backlog_window_does_not_hold_the_learned_share_above_its_cap() {
        let mut share = None;
        smooth_capped(&mut share, 75.0, 0.2, 250.0);
        smooth_capped(&mut share, 50_000.0, 0.2, 250.0);
        assert_eq!(share, Some(75.0 + 0.2 * 175.0));
        for _ in 0..10 {
            smooth_capped(&mut share, 75.0, 0.2, 250.0);
        }
        let share = share.unwrap();
        assert!((75.0..100.0).contains(&share), "{share}");
        // Negative samples (a client under its SLO by more than the server's p95) count as 0.
        let mut negative = None;
        smooth_capped(&mut negative, -30.0, 0.2, 250.0);
        assert_eq!(negative, Some(0.0));
    }
}
