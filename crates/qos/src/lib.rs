//! Quality of service for ReFlex: the request cost model, device profiles, the token scheduler
//! (paper §3.2.2, Algorithm 1) and admission control. Pure: no I/O, no clock, no threads; time
//! comes in as [`Nanos`], and the only state threads share is [`DeviceShared`] (atomics), so
//! the simulator runs exactly this code in virtual time. The model, the algorithm as
//! implemented, where it departs from the original code and the knobs are in `docs/QOS.md`.
//!
//! # API
//!
//! **Control plane** (one [`TenantRegistry`] per device; not on the data path):
//! - [`TenantRegistry::new`]`(profile, config, threads)`;
//! - [`TenantRegistry::register`]`(TenantSpec) -> Result<TenantId, AdmissionError>`, also
//!   [`reregister`](TenantRegistry::reregister) (new SLO, admitted again) and
//!   [`unregister`](TenantRegistry::unregister). A refusal's `Display` gives the numbers
//!   ("needs 196K tokens/s, 104K left at 500 µs") and leaves no state behind;
//! - [`connect`](TenantRegistry::connect) / [`disconnect`](TenantRegistry::disconnect) /
//!   [`move_connection`](TenantRegistry::move_connection)`(tenant, thread)`: where a tenant's
//!   connections are; its reservation counts once and each thread gets a share;
//! - [`take_updates`](TenantRegistry::take_updates)` -> Vec<(thread, RateUpdate)>`: plain
//!   messages to deliver to each thread's scheduler;
//! - [`handle_event`](TenantRegistry::handle_event)`(thread, SchedulerEvent) -> Option<Notice>`:
//!   one [`Notice::Renegotiate`] per deficit episode of a tenant, over all its threads;
//! - [`plan`](TenantRegistry::plan): the device rate, Σ LC reservations, BE share;
//! - [`set_rate_scale`](TenantRegistry::set_rate_scale)`(scale) -> Vec<TenantId>`: the device
//!   rate becomes the profile's × `scale` (rate updates queued as for any change); the LC
//!   tenants that no longer fit are returned, to be asked to renegotiate
//!   ([`lc_tenants_over`](TenantRegistry::lc_tenants_over) lists them all).
//!
//! **Online calibration** (one [`Calibrator`] per device, control plane): every window
//! ([`Calibrator::next_deadline`]) the integrator passes a [`WindowObservation`] (LC reads and
//! their p95 device latency, the SLO in force, the rate in use and the tokens spent) to
//! [`Calibrator::handle_window`]`(now, ..) -> Decision`; the decision's `scale` (in
//! `[scale_floor, scale_ceiling]`) is what the profile's rate is multiplied by.
//!
//! **Fairness** (OctoFAS monitor, control plane): every window the integrator passes each
//! flow's completed requests and latency sum and each core's busy time
//! ([`FairnessWindow`]) to [`FairnessMonitor::handle_window`]; the [`FairnessReport`] gives
//! slowdowns, fairness F, load balance LB, dense and sparse flows, backwardings and the
//! policy (none, inter-core, intra-core, hybrid).
//!
//! **Fairness stage** (dataplane, one [`FairQueue`] per thread per device, off by default):
//! admitted best-effort requests wait in it while the device holds `be_device_depth_max` of
//! them, and leave in the order its mode picks (FIFO, OctoFAS backwarding, fewest in flight);
//! latency-critical requests never enter it.
//!
//! **Migration** (dataplane, one [`Migrator`] per thread per device, off by default): every
//! monitor window each thread publishes its load on the device's [`MigrationBoard`];
//! [`migration::plan`] (OctoFAS Algorithm 2) turns every thread's load into quotas of
//! requests an overloaded thread may have served by an underloaded one.
//!
//! **Dataplane** (one [`Scheduler`] per thread per device, all sharing one `Arc<DeviceShared>`):
//! - [`Scheduler::new`]`(shared, thread_index, &config, Policy::Tokens | Policy::Fifo, now)`;
//!   everything it needs is allocated here, nothing per round;
//! - [`apply`](Scheduler::apply)`(RateUpdate, now)` between loop iterations;
//! - [`enqueue`](Scheduler::enqueue)`(tenant, Request { token, size_bytes, kind }, now)`:
//!   `Err(TenantQueueFull)` means stop reading that connection (backpressure, never a drop);
//! - [`schedule`](Scheduler::schedule)`(now, &mut |Admitted| -> bool)` once per loop
//!   iteration: the closure submits to the device and returns `false` when the device is full;
//! - [`poll_event`](Scheduler::poll_event): deficit-limit episodes (for the control plane) and
//!   "queue has room" (resume reading);
//! - [`next_deadline`](Scheduler::next_deadline): when a blocked tenant can pay; a blocking
//!   loop sleeps no longer;
//! - [`set_participating`](Scheduler::set_participating)`(false)` before sleeping long, so the
//!   global bucket keeps being reset by the other threads.
//!
//! ```
//! use std::sync::Arc;
//! use reflex_qos::*;
//!
//! let profile = DeviceProfile::from_toml(r#"
//!     name = "example"
//!     write_cost = 10.0
//!     read_only_read_cost = 0.5
//!     [[token_limits]]
//!     latency_us_p95 = 500
//!     tokens_per_sec = 420000.0
//!     reads_per_sec_read_only = 850000.0
//! "#).unwrap();
//! let config = QosConfig::default();
//! let mut registry = TenantRegistry::new(profile, config.clone(), 1).unwrap();
//! let shared = Arc::new(DeviceShared::new(config.read_only_window()));
//! let mut thread0 = Scheduler::new(shared, 0, &config, Policy::Tokens, Nanos::ZERO).unwrap();
//!
//! let lc = registry
//!     .register(TenantSpec::LatencyCritical { latency_us_p95: 500, iops: 70_000, read_percent: 80 })
//!     .unwrap();
//! let refused = registry
//!     .register(TenantSpec::LatencyCritical { latency_us_p95: 500, iops: 90_000, read_percent: 80 })
//!     .unwrap_err();
//! assert_eq!(refused.to_string(), "needs 252K tokens/s, 224K left at 500 µs");
//! registry.connect(lc, 0).unwrap();
//! for (_thread, update) in registry.take_updates() {
//!     thread0.apply(update, Nanos::ZERO);
//! }
//!
//! let now = Nanos::from_micros(10);
//! let read = Request { token: 7, size_bytes: 4096, kind: IoKind::Read };
//! thread0.enqueue(lc, read, now).unwrap();
//! let mut submitted = Vec::new();
//! thread0.schedule(now, &mut |admitted: Admitted| {
//!     submitted.push(admitted.token);
//!     true // the device took it
//! });
//! assert_eq!(submitted, vec![7]);
//! ```
#![forbid(unsafe_code)]

pub mod calibrator;
pub mod config;
pub mod cost;
pub mod fair_queue;
pub mod fairness;
pub mod migration;
pub mod profile;
mod queue;
pub mod rates;
pub mod rebalance;
pub mod registry;
pub mod scaling;
pub mod scheduler;
pub mod shared;
pub mod time;
pub mod tokens;
mod wheel;

pub use calibrator::{
    Action, Calibrator, CalibratorConfig, CalibratorConfigError, CalibratorStats, Decision, Hold,
    ObservationError, WindowObservation, WindowRecord,
};
pub use config::{ConfigError, QosConfig, THREADS_MAX};
pub use cost::{COST_UNIT_BYTES, CostModel, IoKind, LoadMode, REQUEST_BYTES_MAX};
pub use fair_queue::{
    AdaptiveDepth, AdaptiveDepthConfig, DepthStep, FairMode, FairQueue, FairQueueConfig,
    FairQueueFull, FairQueueStats,
};
pub use fairness::{
    CoreSample, Density, FairnessConfig, FairnessMonitor, FairnessPolicy, FairnessReport,
    FairnessWindow, FlowId, FlowReport, FlowSample,
};
pub use migration::{
    MigrationBoard, MigrationConfig, MigrationFlows, MigrationPlan, Migrator, MigratorStats,
    ThreadLoad,
};
pub use profile::{DeviceProfile, TokenLimit};
pub use rates::{
    DeviceRates, RatePerMode, RateUpdate, SPARE_SHARE_ALL, TenantClass, TenantId, TenantRates,
};
pub use rebalance::{
    REBALANCE_STEP_MAX, RebalanceMove, ThreadConnections, plan_rebalance, spread_target,
};
pub use registry::{AdmissionError, Notice, Plan, TenantRegistry, TenantSpec};
pub use scaling::{
    ScalingConfig, ScalingConfigError, ScalingDecision, ScalingPolicy, ScalingReason, ThreadBusy,
};
pub use scheduler::{
    Admitted, EnqueueError, Ledger, Policy, Request, RoundSummary, Scheduler, SchedulerEvent,
    TenantStats,
};
pub use shared::{BucketStats, DeviceShared};
pub use time::Nanos;
pub use tokens::{TokenRate, Tokens};
