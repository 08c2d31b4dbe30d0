//! `reflex-sim`: a deterministic, virtual-time simulator of a ReFlex server that runs the real
//! QoS structures (`reflex_qos::{TenantRegistry, Scheduler, DeviceShared}`) against the
//! emulated Flash device (`reflex_flash::emu`) with open- and closed-loop tenants, so QoS
//! behaviour is tested exactly and quickly instead of with timing on a noisy machine.
//!
//! API:
//! - [`scenario::load`] reads a scenario TOML file (format in [`scenario`]) and its profile;
//! - [`run_scenario`] runs it (every point of a sweep) and returns a [`ScenarioReport`];
//! - [`engine::run`] runs one [`SimConfig`] against any [`SimDevice`];
//! - the `reflex-sim` binary prints the tables (`reflex-sim scenarios/fig5-scenario1.toml`).
//!
//! Architecture invariant: nothing here reads a clock, opens a socket or starts a thread; the
//! same seed gives the same report.
#![forbid(unsafe_code)]

pub mod device;
pub mod engine;
pub mod network;
pub mod report;
pub mod scenario;
pub mod server;

use reflex_qos::{Nanos, Policy, TenantSpec};

pub use device::{EmuSimDevice, FixedDevice, ModelFlash, SimDevice, SimDone, SimIo};
pub use engine::{ClientModel, Load, SimConfig, SimError, SimTenant};
pub use network::NetworkModel;
pub use report::{PointReport, ScenarioReport, TenantReport};
pub use scenario::{LoadedScenario, Scenario, ScenarioError};
pub use server::{
    CpuModel, NvmeTcpListener, SocketId, TlsServer, VirtualExport, VirtualListener, VirtualServer,
    VirtualServerError, VirtualServerSetup,
};

use scenario::{ClassToml, TenantSpecToml};

/// Overrides for a run (command-line flags, tests).
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub seed: Option<u64>,
    pub duration_ms: Option<u64>,
    pub warmup_ms: Option<u64>,
    /// Force QoS on or off.
    pub qos: Option<bool>,
    /// Run only these sweep values.
    pub sweep_values: Option<Vec<u16>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error(transparent)]
    Sim(#[from] SimError),
    #[error("emulated device: {0}")]
    Device(String),
}

/// Runs every point of a loaded scenario.
pub fn run_scenario(
    loaded: &LoadedScenario,
    options: &RunOptions,
) -> Result<ScenarioReport, RunError> {
    let scenario = &loaded.scenario;
    let mut points = Vec::new();
    match &scenario.sweep {
        None => {
            let config = sim_config(loaded, options, scenario.threads, None);
            points.push((String::new(), run_point(loaded, &config)?));
        }
        Some(sweep) => {
            let values = options
                .sweep_values
                .clone()
                .unwrap_or_else(|| sweep.per_thread_tenants.clone());
            for value in values {
                let threads = value.max(sweep.threads_min).max(1);
                let config = sim_config(loaded, options, threads, Some(value));
                let label = format!("{value} per-thread tenants, {threads} threads");
                points.push((label, run_point(loaded, &config)?));
            }
        }
    }
    Ok(ScenarioReport {
        name: scenario.name.clone(),
        description: scenario.description.clone(),
        points,
    })
}

/// The concrete run of a scenario with `threads` threads and (for sweeps) `per_thread` copies
/// of each per-thread tenant (`None`: one per thread).
pub fn sim_config(
    loaded: &LoadedScenario,
    options: &RunOptions,
    threads: u16,
    per_thread: Option<u16>,
) -> SimConfig {
    let scenario = &loaded.scenario;
    let mut tenants = Vec::new();
    for tenant in &scenario.tenants {
        if tenant.per_thread {
            let copies = per_thread.unwrap_or(threads).min(threads);
            for thread in 0..copies {
                tenants.push(sim_tenant(
                    tenant,
                    format!("{}-{thread}", tenant.name),
                    vec![thread],
                ));
            }
        } else {
            let connections = tenant.threads.iter().map(|&t| t % threads).collect();
            tenants.push(sim_tenant(tenant, tenant.name.clone(), connections));
        }
    }
    let qos = options.qos.unwrap_or(scenario.qos);
    SimConfig {
        seed: options.seed.unwrap_or(scenario.seed),
        threads,
        policy: if qos { Policy::Tokens } else { Policy::Fifo },
        profile: loaded.profile.clone(),
        extra_profiles: loaded.extra_profiles.clone(),
        qos: scenario.qos_config.clone().unwrap_or_default(),
        warmup: Nanos::from_millis(options.warmup_ms.unwrap_or(scenario.warmup_ms)),
        duration: Nanos::from_millis(options.duration_ms.unwrap_or(scenario.duration_ms)),
        tenants,
        network: scenario.network.model(),
        client: scenario.client.model(),
        cpu: scenario.cpu.map(|cpu| cpu.model()),
        timeline: scenario.timeline_ms.map(Nanos::from_millis),
    }
}

fn sim_tenant(tenant: &TenantSpecToml, name: String, connections: Vec<u16>) -> SimTenant {
    let spec = match tenant.class {
        ClassToml::Lc => TenantSpec::LatencyCritical {
            latency_us_p95: tenant.latency_us_p95.unwrap_or(0),
            iops: tenant.iops.unwrap_or(0),
            read_percent: tenant.read_percent,
        },
        ClassToml::Be => TenantSpec::BestEffort,
    };
    let load = match (tenant.load.open_iops, tenant.load.closed_depth) {
        (Some(iops), _) => Load::Open {
            iops,
            window: tenant.load.window,
            follow_notices: tenant.load.follow_notices,
        },
        (None, depth) => Load::Closed {
            depth: depth.unwrap_or(1),
        },
    };
    SimTenant {
        name,
        spec,
        size_bytes: tenant.size_bytes,
        read_percent: tenant.load.read_percent.unwrap_or(tenant.read_percent),
        connections,
        load,
        namespace: tenant.namespace,
        start: Nanos::from_millis(tenant.start_ms),
        rt_alone_us: tenant
            .rt_alone_us
            .map(|us| us.round().clamp(1.0, f64::from(u32::MAX)) as u32),
    }
}

/// Runs one configuration on the scenario's devices.
pub fn run_point(loaded: &LoadedScenario, config: &SimConfig) -> Result<PointReport, RunError> {
    let scenario = &loaded.scenario;
    let devices = std::iter::once(&scenario.device)
        .chain(&scenario.extra_devices)
        .enumerate()
        // Each device its own random stream: two devices of one model must not move in step.
        .map(|(index, spec)| make_device(loaded, spec, config.seed.wrapping_add(index as u64)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(engine::run_on(config, devices)?)
}

fn make_device(
    loaded: &LoadedScenario,
    spec: &scenario::DeviceSpec,
    seed: u64,
) -> Result<std::sync::Arc<dyn reflex_flash::Device>, RunError> {
    let capacity_bytes = spec.capacity_gib << 30;
    if let Some(fixed) = spec.fixed {
        let mut device = FixedDevice::new(
            fixed.servers,
            fixed.read_us * 1_000,
            fixed.write_us * 1_000,
            fixed.queue_depth_max,
        );
        device.set_capacity_bytes(capacity_bytes);
        return Ok(std::sync::Arc::new(ModelFlash::new(
            Box::new(device),
            "fixed-latency model",
        )));
    }
    // `emu(slow=2x@10s;...):NAME` drifts over the run (`docs/EMULATION.md`, "Drift").
    let (schedule, name) =
        reflex_flash::emu::split_spec(spec.emulated.as_deref().unwrap_or("device-a"))
            .map_err(|e| RunError::Device(e.to_string()))?;
    let resolved = if name.contains('/') || name.ends_with(".toml") {
        loaded.base_dir.join(name).display().to_string()
    } else {
        name.to_string()
    };
    let profile = reflex_flash::emu::EmuProfile::lookup(&resolved)
        .map_err(|e| RunError::Device(e.to_string()))?;
    let mut device = reflex_flash::emu::EmuDevice::new(profile, capacity_bytes, seed)
        .map_err(|e| RunError::Device(e.to_string()))?;
    device
        .set_schedule(schedule)
        .map_err(|e| RunError::Device(e.to_string()))?;
    Ok(std::sync::Arc::new(ModelFlash::new(
        Box::new(EmuSimDevice::new(device)),
        &format!("emulated {name}"),
    )))
}
