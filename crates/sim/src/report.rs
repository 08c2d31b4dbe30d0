//! What a simulation reports, and the tables the `reflex-sim` binary prints.

use std::fmt::Write as _;

use reflex_qos::TenantClass;
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TenantReport {
    pub name: String,
    /// The namespace (device) it used.
    pub namespace: u32,
    #[serde(serialize_with = "class_name")]
    pub class: TenantClass,
    /// Refused by admission control (then it sent nothing).
    pub admitted: bool,
    pub latency_us_p95: Option<u64>,
    pub reserved_iops: Option<u64>,
    /// Open-loop rate; `None` for a closed-loop (saturating) client.
    pub offered_iops: Option<f64>,
    /// Open loop: arrivals per second actually generated in the measured window.
    pub arrived_iops: Option<f64>,
    /// Completions per second in the measured window.
    pub iops: f64,
    /// Reads measured for the latency percentiles.
    pub reads: u64,
    pub read_p95_us: f64,
    pub read_p99_us: f64,
    /// Mean time its device operations waited in the dataplane's QoS scheduler (from the
    /// server's own per-tenant figures), to tell scheduling delay from device latency.
    pub scheduler_wait_us_mean: f64,
    /// Tokens its requests cost, per second.
    pub tokens_per_sec: f64,
    /// LC tenants: p95 within the SLO and (open loop) at least 99 % of the IOPS that arrived.
    pub slo_met: Option<bool>,
    /// Renegotiation notices (deficit-limit episodes) the control plane raised.
    pub notices: u64,
    /// Renegotiation notices because the device's calibrated rate no longer fits the
    /// reservation (or fits again).
    pub device_notices: u64,
    /// Requests answered with an error status.
    pub errors: u64,
    /// Arrivals dropped because the client's backlog was full.
    pub shed: u64,
    /// Arrivals still held by the client at the end.
    pub backlog: u64,
    /// The server's fairness monitor on this tenant in its last window, when the fairness
    /// stage is on (RT, RT_alone and whether it was learned, slowdown, backwardings).
    pub fairness_window: Option<reflex_qos::FlowReport>,
}

fn class_name<S: serde::Serializer>(class: &TenantClass, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match class {
        TenantClass::LatencyCritical => "LC",
        TenantClass::BestEffort => "BE",
    })
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PointReport {
    pub threads: u16,
    pub qos: bool,
    pub seed: u64,
    pub duration_ms: u64,
    /// The strictest LC SLO, which set the device rate.
    pub latency_us_p95: Option<u64>,
    /// Namespace 1's device token rate (mixed load) at that SLO.
    pub device_tokens_per_sec: f64,
    /// Every namespace's device token rate (mixed load) at its strictest SLO, by namespace id
    /// - 1 (0 for a namespace without a plan).
    pub namespace_tokens_per_sec: Vec<f64>,
    /// Tokens all tenants' requests cost, per second.
    pub tokens_used_per_sec: f64,
    pub tenants: Vec<TenantReport>,
    /// Admission refusals (tenant and reason).
    pub refusals: Vec<String>,
    /// The device rate's share of the profile's at the end (online self-calibration).
    pub rate_scale: f64,
    /// Per interval, when the scenario asks for a timeline.
    pub timeline: Vec<TimelinePoint>,
    /// Inter-core migration on namespace 1, per thread: requests it sent to other threads
    /// and requests of others it served (whole run, warm-up included).
    pub migrated: Vec<reflex_qos::MigratorStats>,
}

/// One timeline interval.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimelinePoint {
    /// The interval's end, in ms after the warm-up.
    pub end_ms: u64,
    /// The device rate's share of the profile's at the interval's end.
    pub rate_scale: f64,
    /// The share of donated tokens best-effort tenants may spend at the interval's end.
    pub spare_share: f64,
    /// In the report's tenant order.
    pub tenants: Vec<TimelineTenant>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TimelineTenant {
    /// Completions per second in the interval.
    pub iops: f64,
    /// p95 of the reads that completed in the interval (0 without reads).
    pub read_p95_us: f64,
}

impl PointReport {
    pub fn tenant(&self, name: &str) -> Option<&TenantReport> {
        self.tenants.iter().find(|t| t.name == name)
    }

    /// A Markdown table, one row per tenant.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "threads {}, QoS {}, seed {}, {} ms measured; device rate {:.0}K tokens/s{}{}; used {:.0}K tokens/s",
            self.threads,
            if self.qos { "on" } else { "off" },
            self.seed,
            self.duration_ms,
            self.device_tokens_per_sec / 1e3,
            self.latency_us_p95
                .map(|l| format!(" at {l} µs"))
                .unwrap_or_default(),
            if self.rate_scale == 1.0 {
                String::new()
            } else {
                format!(" (calibrated: {:.2} of the profile's)", self.rate_scale)
            },
            self.tokens_used_per_sec / 1e3,
        );
        if self.namespace_tokens_per_sec.len() > 1 {
            let rates: Vec<String> = self
                .namespace_tokens_per_sec
                .iter()
                .enumerate()
                .map(|(index, rate)| format!("ns {}: {:.0}K", index + 1, rate / 1e3))
                .collect();
            let _ = writeln!(out, "device rates (tokens/s) {}", rates.join(", "));
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "| tenant | class | SLO | sent IOPS | IOPS | read p95 µs | read p99 µs | sched wait µs | tokens/s | SLO met | notices |"
        );
        let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|");
        let several_namespaces = self.tenants.iter().any(|t| t.namespace != 1);
        for t in &self.tenants {
            let name = if several_namespaces {
                format!("{} (ns {})", t.name, t.namespace)
            } else {
                t.name.clone()
            };
            let class = match t.class {
                TenantClass::LatencyCritical => "LC",
                TenantClass::BestEffort => "BE",
            };
            let slo = match (t.reserved_iops, t.latency_us_p95) {
                (Some(iops), Some(latency)) => format!("{}K @ {latency} µs", iops / 1000),
                _ => "-".to_string(),
            };
            let offered = t
                .arrived_iops
                .map(|o| format!("{:.1}K", o / 1e3))
                .unwrap_or_else(|| "max".to_string());
            let met = match (t.admitted, t.slo_met) {
                (false, _) => "refused",
                (true, Some(true)) => "yes",
                (true, Some(false)) => "**no**",
                (true, None) => "-",
            };
            let _ = writeln!(
                out,
                "| {name} | {class} | {slo} | {offered} | {:.1}K | {:.0} | {:.0} | {:.0} | {:.1}K | {met} | {} |",
                t.iops / 1e3,
                t.read_p95_us,
                t.read_p99_us,
                t.scheduler_wait_us_mean,
                t.tokens_per_sec / 1e3,
                t.notices,
            );
        }
        for refusal in &self.refusals {
            let _ = writeln!(out, "\nrefused: {refusal}");
        }
        for t in &self.tenants {
            if let Some(w) = &t.fairness_window {
                let _ = writeln!(
                    out,
                    "\nfairness monitor, last window: {} RT {:.0} µs, RT_alone {:.0} µs ({}), S {:.2}, {:?}, B {}",
                    t.name,
                    w.rt_us,
                    w.rt_alone_us,
                    if w.alone_learned {
                        "learned"
                    } else {
                        "lowest seen"
                    },
                    w.slowdown,
                    w.density,
                    w.backwardings
                );
            }
        }
        if !self.timeline.is_empty() {
            out.push_str(&self.timeline_table());
        }
        out
    }

    /// The timeline: one row per interval, each tenant's IOPS and read p95.
    pub fn timeline_table(&self) -> String {
        let mut out = String::from("\n| t ms | scale | spare |");
        let mut rule = String::from("|---:|---:|---:|");
        for t in &self.tenants {
            let _ = write!(out, " {} IOPS | {} p95 µs |", t.name, t.name);
            rule.push_str("---:|---:|");
        }
        let _ = writeln!(out, "\n{rule}");
        for point in &self.timeline {
            let _ = write!(
                out,
                "| {} | {:.2} | {:.2} |",
                point.end_ms, point.rate_scale, point.spare_share
            );
            for t in &point.tenants {
                let _ = write!(out, " {:.1}K | {:.0} |", t.iops / 1e3, t.read_p95_us);
            }
            out.push('\n');
        }
        out
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScenarioReport {
    pub name: String,
    pub description: String,
    /// One point per run (several for a sweep).
    pub points: Vec<(String, PointReport)>,
}

impl ScenarioReport {
    pub fn text(&self) -> String {
        let mut out = format!("## {}\n\n", self.name);
        if !self.description.is_empty() {
            let _ = writeln!(out, "{}\n", self.description);
        }
        for (label, point) in &self.points {
            if !label.is_empty() {
                let _ = writeln!(out, "### {label}\n");
            }
            out.push_str(&point.table());
            out.push('\n');
        }
        out
    }
}
