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
}

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
        let mode = if plan.read_only_admission {
            LoadMode::ReadOnly
        } else {
            LoadMode::Mixed
        };
        let m = mode.index();
        let device = plan.device_tokens_per_sec[m].as_tokens_per_sec_f64();
        let reserved = plan.lc_reserved_tokens_per_sec[m].as_tokens_per_sec_f64();
        // The profile's rate is the device rate without the scale; below it, LC reservations
        // may take all but the best-effort floor.
        let lc_share = 1.0 - config.best_effort_floor;
        let lc_fit_scale = (plan.lc_tenants > 0 && device > 0.0 && plan.rate_scale > 0.0)
            .then(|| reserved / (lc_share * device / plan.rate_scale));
        // The network's share of what LC tenants see: a quantile of the sampled round trips,
        // smoothed over windows (a window without samples keeps the estimate: its reads had
        // no answer to sample yet).
        let learned_network_us = if config.learn_network_rtt {
            let rtt = &self.window.network_rtt;
            if rtt.count() > 0 {
                let sample = rtt.quantile_us(config.network_share_quantile) as f64;
                let weight = config.network_share_weight;
                self.network_share_us = Some(match self.network_share_us {
                    Some(estimate) => estimate + weight * (sample - estimate),
                    None => sample,
                });
            }
            let cap = plan
                .latency_us_p95
                .map_or(0.0, |slo| slo as f64 * config.network_share_max);
            self.network_share_us.unwrap_or(0.0).min(cap).round() as u64
        } else {
            0
        };
        let tokens_spent = self.window.tokens_spent.as_tokens_f64().max(0.0);
        let seconds = now.saturating_since(window_start).as_secs_f64();
        let profile_p95_at_load_us = (seconds > 0.0).then(|| {
            profile.latency_at(tokens_spent / seconds, matches!(mode, LoadMode::ReadOnly))
        });
        let observation = WindowObservation {
            lc_reads: self.window.lc_reads_service.count(),
            lc_read_latency_us_p95: self.window.lc_reads_service.quantile_us(0.95),
            slo_latency_us_p95: plan.latency_us_p95,
            client_share_us: config.client_share_us + learned_network_us,
            tokens_per_sec_in_use: device,
            tokens_spent,
            lc_fit_scale,
            server_busy: self.window.server_busy,
            profile_p95_at_load_us,
        };
        self.window.clear();
        self.last = Some(observation);
        self.calibrator.handle_window(now, &observation)
    }

    pub fn info(&self) -> CalibrationInfo {
        CalibrationInfo {
            stats: self.calibrator.stats(),
            last: self.last,
        }
    }
}
