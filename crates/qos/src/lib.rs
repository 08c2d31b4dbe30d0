//! Quality of service for ReFlex: request costs, device profiles, the token scheduler and
//! admission control. Pure: no I/O, no clock; time comes in as [`Nanos`].
#![forbid(unsafe_code)]

pub mod config;
pub mod cost;
pub mod profile;
mod queue;
pub mod rates;
pub mod registry;
pub mod scheduler;
pub mod shared;
pub mod time;
pub mod tokens;
mod wheel;

pub use config::{ConfigError, QosConfig, THREADS_MAX};
pub use cost::{COST_UNIT_BYTES, CostModel, IoKind, LoadMode, REQUEST_BYTES_MAX};
pub use profile::{DeviceProfile, TokenLimit};
pub use rates::{DeviceRates, RatePerMode, RateUpdate, TenantClass, TenantId, TenantRates};
pub use registry::{AdmissionError, Notice, Plan, TenantRegistry, TenantSpec};
pub use scheduler::{
    Admitted, EnqueueError, Ledger, Policy, Request, RoundSummary, Scheduler, SchedulerEvent,
    TenantStats,
};
pub use shared::{BucketStats, DeviceShared};
pub use time::Nanos;
pub use tokens::{TokenRate, Tokens};
