//! Scenario files: TOML descriptions of a simulated ReFlex server and its tenants.
//!
//! ```toml
//! name = "fig5-scenario1"
//! seed = 1
//! threads = 1
//! qos = true                       # false: the scheduler passes requests through (QoS off)
//! duration_ms = 300                # measured time, after the warm-up
//! warmup_ms = 50
//! timeline_ms = 500                # optional: IOPS and read p95 per interval, per tenant
//!
//! [device]
//! emulated = "device-a"            # emu profile: shipped name or a path (relative to this file)
//! profile = "../profiles/device-a.toml"   # the calibrated QoS profile the scheduler uses
//! capacity_gib = 64
//!
//! [[extra_device]]                 # optional, repeatable: namespace 2, 3, ... on its own device
//! emulated = "device-a-small"      # with its own profile, token bucket, schedulers, admission
//! profile = "../profiles/device-a-small.toml"
//!
//! [network]                        # optional: every connection, both directions
//! latency_us = 10                  # one-way delay (default 0)
//! gbit_per_sec = 10                # bandwidth per direction (default 0: unlimited)
//!
//! [client]                         # optional: the clients' side
//! wakeup_us = 0                    # added to every answer a client measures (its wake-up;
//!                                  # no TCP round trip shows it)
//! report_interval_ms = 0           # LC tenants REPORT their read p95 and backlog this often
//!                                  # (0: never)
//!
//! [cpu]                            # optional: the dataplane threads' work takes time
//! per_answer_ns = 2000             # per answered request, on its connection's thread
//! per_device_completion_ns = 1000  # per device completion, on the thread that served it
//!
//! [qos_config]                     # optional QosConfig overrides (docs/QOS.md)
//! loan_max_tokens = 50.0
//!
//! [[tenant]]
//! name = "A"
//! class = "lc"                     # or "be"
//! latency_us_p95 = 500             # LC only: the SLO
//! iops = 120000                    # LC only: the reservation, 4 KiB I/Os
//! read_percent = 100               # LC: the reservation's mix; also the load's mix by default
//! size_bytes = 4096
//! namespace = 1                    # 1: [device]; 2: the first [[extra_device]], ...
//! start_ms = 0                     # starts sending this long after the run's start (warm-up)
//! threads = [0]                    # one connection per entry, on that thread (mod threads)
//! per_thread = false               # true: one copy of this tenant per thread ("A-0", "A-1", ..)
//! load = { open_iops = 120000, read_percent = 100 }   # Poisson; or { closed_depth = 32 }
//!                                  # open loop: follow_notices = true lowers the rate to what
//!                                  # a RENEGOTIATE notice grants while the device is slower
//!
//! [sweep]                          # optional: run once per value (Figure 6a)
//! per_thread_tenants = [0, 1, 2, 4, 8, 12]   # how many per-thread tenants exist
//! threads_min = 2                  # threads = max(value, threads_min)
//! ```

use std::path::{Path, PathBuf};

use reflex_qos::{DeviceProfile, QosConfig};
use serde::{Deserialize, Serialize};

/// The virtual network between the simulated clients and server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// One-way delay of every send, in microseconds.
    #[serde(default)]
    pub latency_us: u64,
    /// Bandwidth of each direction of each connection; 0: unlimited.
    #[serde(default)]
    pub gbit_per_sec: u64,
}

impl NetworkSpec {
    pub fn model(&self) -> crate::network::NetworkModel {
        crate::network::NetworkModel {
            latency: reflex_qos::Nanos(self.latency_us * 1_000),
            bytes_per_sec: self.gbit_per_sec * 125_000_000,
            ..crate::network::NetworkModel::default()
        }
    }
}

/// `[client]`: what the simulated clients add and tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientSpec {
    /// Added to every answer's latency a client measures (its own wake-up), in µs.
    #[serde(default)]
    pub wakeup_us: u64,
    /// Every this many ms, each latency-critical tenant's client sends a REPORT of its reads'
    /// p95 in the interval and its backlog (arrivals due and not sent); 0: never.
    #[serde(default)]
    pub report_interval_ms: u64,
}

impl ClientSpec {
    pub fn model(&self) -> crate::ClientModel {
        crate::ClientModel {
            wakeup: reflex_qos::Nanos::from_micros(self.wakeup_us),
            report_interval: (self.report_interval_ms > 0)
                .then(|| reflex_qos::Nanos::from_millis(self.report_interval_ms)),
        }
    }
}

/// `[cpu]`: what the dataplane threads' work costs in virtual time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    #[serde(default)]
    pub per_answer_ns: u64,
    #[serde(default)]
    pub per_device_completion_ns: u64,
}

impl CpuSpec {
    pub fn model(&self) -> crate::CpuModel {
        crate::CpuModel {
            per_answer: reflex_qos::Nanos(self.per_answer_ns),
            per_device_completion: reflex_qos::Nanos(self.per_device_completion_ns),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "default_seed")]
    pub seed: u64,
    #[serde(default = "default_threads")]
    pub threads: u16,
    #[serde(default = "default_true")]
    pub qos: bool,
    pub duration_ms: u64,
    #[serde(default)]
    pub warmup_ms: u64,
    /// The device of namespace 1.
    pub device: DeviceSpec,
    /// Further devices, each its own namespace (2, 3, ...) with its own profile, token bucket
    /// and schedulers (`[[extra_device]]`): tenants pick one with `namespace`.
    #[serde(default, rename = "extra_device")]
    pub extra_devices: Vec<DeviceSpec>,
    #[serde(default)]
    pub qos_config: Option<QosConfig>,
    #[serde(default)]
    pub network: NetworkSpec,
    #[serde(default)]
    pub client: ClientSpec,
    /// The threads' CPU ([`crate::CpuModel`]); absent, their work is free.
    #[serde(default)]
    pub cpu: Option<CpuSpec>,
    #[serde(rename = "tenant")]
    pub tenants: Vec<TenantSpecToml>,
    #[serde(default)]
    pub sweep: Option<Sweep>,
    /// Report each tenant's IOPS and read p95 per interval of this many ms.
    #[serde(default)]
    pub timeline_ms: Option<u64>,
}

fn default_seed() -> u64 {
    1
}

fn default_threads() -> u16 {
    1
}

fn default_true() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Emulated-device profile: a shipped name (`device-a`) or a TOML path. Without it the
    /// simulator uses its fixed-latency test device (`fixed`).
    #[serde(default)]
    pub emulated: Option<String>,
    /// Fixed-latency device instead: servers, read and write service time.
    #[serde(default)]
    pub fixed: Option<FixedSpec>,
    /// Calibrated QoS profile (path, relative to the scenario file).
    pub profile: String,
    #[serde(default = "default_capacity_gib")]
    pub capacity_gib: u64,
}

fn default_capacity_gib() -> u64 {
    64
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixedSpec {
    pub servers: usize,
    pub read_us: u64,
    pub write_us: u64,
    #[serde(default = "default_fixed_depth")]
    pub queue_depth_max: usize,
}

fn default_fixed_depth() -> usize {
    4096
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassToml {
    Lc,
    Be,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpecToml {
    pub name: String,
    pub class: ClassToml,
    #[serde(default)]
    pub latency_us_p95: Option<u64>,
    #[serde(default)]
    pub iops: Option<u64>,
    #[serde(default = "default_read_percent")]
    pub read_percent: u8,
    #[serde(default = "default_size")]
    pub size_bytes: u32,
    #[serde(default = "default_connection")]
    pub threads: Vec<u16>,
    #[serde(default)]
    pub per_thread: bool,
    pub load: LoadToml,
    /// The tenant's mean response time alone (µs), from a run with the device to itself: with
    /// it, `reflex bench --scenario` reports the tenant's slowdown and the run's F = min S /
    /// max S (OctoFAS eq. 1, 2). The simulator also sets it on its server, whose fairness
    /// monitors then use it instead of learning it, as reflexd's use a tenant's configured
    /// `rt_alone_us` (`reflex bench` does not send it to reflexd).
    #[serde(default)]
    pub rt_alone_us: Option<f64>,
    /// The namespace (device) the tenant registers on and sends to: 1 is `[device]`, 2 the
    /// first `[[extra_device]]`, and so on.
    #[serde(default = "default_namespace")]
    pub namespace: u32,
    /// When the tenant starts sending, in ms from the start of the run (the warm-up's start):
    /// a calibration phase in the warm-up, e.g. one flow alone before the others join, so
    /// that the server's fairness monitor learns its RT_alone. Simulator only.
    #[serde(default)]
    pub start_ms: u64,
}

fn default_namespace() -> u32 {
    1
}

fn default_read_percent() -> u8 {
    100
}

fn default_size() -> u32 {
    4096
}

fn default_connection() -> Vec<u16> {
    vec![0]
}

/// How a tenant's clients send.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadToml {
    /// Open loop: Poisson arrivals at this rate.
    #[serde(default)]
    pub open_iops: Option<u64>,
    /// Closed loop: keep this many requests outstanding (a saturating client).
    #[serde(default)]
    pub closed_depth: Option<u32>,
    /// Read share of the load; defaults to the tenant's `read_percent`.
    #[serde(default)]
    pub read_percent: Option<u8>,
    /// Open loop: requests a client keeps in flight before it holds further arrivals back
    /// (their latency still counts from when they were due).
    #[serde(default = "default_window")]
    pub window: u32,
    /// Open loop: the client follows RENEGOTIATE notices about the device: when the server
    /// says the reservation no longer fits, it lowers its rate to the share granted, and
    /// goes back to its rate when told the reservation fits again.
    #[serde(default)]
    pub follow_notices: bool,
}

fn default_window() -> u32 {
    1024
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    pub per_thread_tenants: Vec<u16>,
    #[serde(default = "default_threads")]
    pub threads_min: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("scenario {name}: {reason}")]
    Invalid { name: String, reason: String },
}

/// A scenario with its paths resolved.
#[derive(Clone, Debug)]
pub struct LoadedScenario {
    pub scenario: Scenario,
    /// The profile of `[device]` (namespace 1).
    pub profile: DeviceProfile,
    /// The profiles of the `[[extra_device]]`s, in order (namespaces 2, 3, ...).
    pub extra_profiles: Vec<DeviceProfile>,
    /// Directory the scenario's relative paths are resolved against.
    pub base_dir: PathBuf,
}

impl Scenario {
    pub fn from_toml(text: &str, path: &str) -> Result<Scenario, ScenarioError> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        scenario.validate()?;
        Ok(scenario)
    }

    fn invalid(&self, reason: impl Into<String>) -> ScenarioError {
        ScenarioError::Invalid {
            name: self.name.clone(),
            reason: reason.into(),
        }
    }

    pub fn validate(&self) -> Result<(), ScenarioError> {
        if self.threads == 0 || usize::from(self.threads) > reflex_qos::THREADS_MAX {
            return Err(self.invalid("threads must be between 1 and 64"));
        }
        if self.duration_ms == 0 {
            return Err(self.invalid("duration_ms must be above 0"));
        }
        if self.timeline_ms == Some(0) {
            return Err(self.invalid("timeline_ms must be above 0"));
        }
        if self.tenants.is_empty() {
            return Err(self.invalid("no tenants"));
        }
        for device in std::iter::once(&self.device).chain(&self.extra_devices) {
            if device.emulated.is_some() == device.fixed.is_some() {
                return Err(self.invalid("device needs exactly one of `emulated` and `fixed`"));
            }
        }
        let namespaces = 1 + self.extra_devices.len() as u32;
        for tenant in &self.tenants {
            let name = &tenant.name;
            if tenant.class == ClassToml::Lc
                && (tenant.latency_us_p95.is_none() || tenant.iops.is_none())
            {
                return Err(self.invalid(format!("LC tenant {name} needs latency_us_p95 and iops")));
            }
            if tenant
                .rt_alone_us
                .is_some_and(|rt| !(rt.is_finite() && rt > 0.0))
            {
                return Err(self.invalid(format!("tenant {name}: rt_alone_us must be above 0")));
            }
            if tenant.namespace == 0 || tenant.namespace > namespaces {
                return Err(self.invalid(format!(
                    "tenant {name}: namespace {} of 1..={namespaces} (one per device)",
                    tenant.namespace
                )));
            }
            if tenant.load.open_iops.is_some() == tenant.load.closed_depth.is_some() {
                return Err(self.invalid(format!(
                    "tenant {name}: load needs open_iops or closed_depth"
                )));
            }
            if tenant.load.open_iops == Some(0) || tenant.load.closed_depth == Some(0) {
                return Err(self.invalid(format!("tenant {name}: load must be above 0")));
            }
            if tenant.load.window == 0 {
                return Err(self.invalid(format!("tenant {name}: window must be above 0")));
            }
            if tenant.threads.is_empty() && !tenant.per_thread {
                return Err(self.invalid(format!("tenant {name} has no connection")));
            }
            if tenant.size_bytes == 0 || tenant.size_bytes % 512 != 0 || tenant.size_bytes > 1 << 20
            {
                return Err(self.invalid(format!(
                    "tenant {name}: size_bytes must be a multiple of 512 up to 1 MiB"
                )));
            }
            if tenant.read_percent > 100 || tenant.load.read_percent.is_some_and(|r| r > 100) {
                return Err(self.invalid(format!("tenant {name}: read_percent above 100")));
            }
        }
        if let Some(sweep) = &self.sweep {
            if sweep.per_thread_tenants.is_empty() {
                return Err(self.invalid("sweep has no values"));
            }
            if sweep
                .per_thread_tenants
                .iter()
                .any(|&n| usize::from(n.max(sweep.threads_min)) > reflex_qos::THREADS_MAX)
            {
                return Err(self.invalid("sweep needs more than 64 threads"));
            }
        }
        Ok(())
    }
}

/// Reads a scenario file and the device profile it names.
pub fn load(path: &Path) -> Result<LoadedScenario, ScenarioError> {
    let text = std::fs::read_to_string(path).map_err(|e| ScenarioError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let scenario = Scenario::from_toml(&text, &path.display().to_string())?;
    let base_dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let profile = read_profile(&base_dir.join(&scenario.device.profile))?;
    let extra_profiles = scenario
        .extra_devices
        .iter()
        .map(|device| read_profile(&base_dir.join(&device.profile)))
        .collect::<Result<_, _>>()?;
    Ok(LoadedScenario {
        scenario,
        profile,
        extra_profiles,
        base_dir,
    })
}

fn read_profile(path: &Path) -> Result<DeviceProfile, ScenarioError> {
    let text = std::fs::read_to_string(path).map_err(|e| ScenarioError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    DeviceProfile::from_toml(&text).map_err(|e| ScenarioError::Parse {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        name = "t"
        duration_ms = 10
        [device]
        fixed = { servers = 4, read_us = 80, write_us = 800 }
        profile = "p.toml"
        [[tenant]]
        name = "A"
        class = "lc"
        latency_us_p95 = 500
        iops = 1000
        load = { open_iops = 1000 }
    "#;

    fn check_invalid(text: &str, expected: &str) {
        match Scenario::from_toml(text, "t.toml") {
            Err(error) => assert!(
                error.to_string().contains(expected),
                "{error} does not say {expected:?}"
            ),
            Ok(scenario) => panic!("accepted {scenario:?}"),
        }
    }

    #[test]
    fn parses_a_minimal_scenario_with_defaults() {
        let scenario = Scenario::from_toml(GOOD, "t.toml").unwrap();
        assert_eq!(scenario.threads, 1);
        assert!(scenario.qos);
        assert_eq!(scenario.tenants[0].threads, vec![0]);
        assert_eq!(scenario.tenants[0].load.window, 1024);
    }

    #[test]
    fn refuses_what_cannot_run() {
        check_invalid(
            &GOOD.replace("iops = 1000\n", ""),
            "needs latency_us_p95 and iops",
        );
        check_invalid(
            &GOOD.replace("load = { open_iops = 1000 }", "load = { }"),
            "open_iops or closed_depth",
        );
        check_invalid(
            &GOOD.replace("duration_ms = 10", "duration_ms = 0"),
            "duration_ms",
        );
        check_invalid(
            &GOOD.replace("name = \"t\"", "name = \"t\"\nthreads = 65"),
            "threads",
        );
        check_invalid(
            &GOOD.replace("fixed = {", "emulated = \"device-a\"\nfixed = {"),
            "exactly one",
        );
        check_invalid(&GOOD.replace("class = \"lc\"", "class = \"xx\""), "t.toml");
        check_invalid(&format!("{GOOD}\nunknown = 1"), "t.toml");
        check_invalid(
            &GOOD.replace("load = {", "namespace = 2\nload = {"),
            "namespace 2 of 1..=1",
        );
        check_invalid(
            &GOOD.replace(
                "[[tenant]]",
                "[[extra_device]]\nprofile = \"q.toml\"\n[[tenant]]",
            ),
            "exactly one",
        );
    }

    #[test]
    fn a_tenant_names_the_namespace_of_an_extra_device() {
        let text = GOOD.replace(
            "[[tenant]]",
            "[[extra_device]]\nemulated = \"device-a\"\nprofile = \"q.toml\"\n[[tenant]]",
        );
        let text = text.replace("load = {", "namespace = 2\nload = {");
        let scenario = Scenario::from_toml(&text, "t.toml").unwrap();
        assert_eq!(scenario.extra_devices.len(), 1);
        assert_eq!(scenario.tenants[0].namespace, 2);
        assert_eq!(
            Scenario::from_toml(GOOD, "t.toml").unwrap().tenants[0].namespace,
            1
        );
    }
}
