//! Plain messages from the control plane ([`crate::TenantRegistry`]) to each dataplane thread's
//! [`crate::Scheduler`]: the device's rates and costs, and each tenant's share of rate on that
//! thread. They are values (`Clone`, no references, no locks) so the dataplane can carry them
//! over any channel and apply them between loop iterations with [`crate::Scheduler::apply`].

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, LoadMode};
use crate::tokens::{TokenRate, Tokens};

/// A tenant handle, unique per registry; small and dense so schedulers index arrays with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TenantId(pub u32);

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tenant {}", self.0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TenantClass {
    /// Reserved IOPS at a p95 read-latency SLO; may run into a bounded deficit.
    LatencyCritical,
    /// A fair share of what LC tenants do not reserve or use; never in deficit.
    BestEffort,
}

/// A rate per [`LoadMode`] (index with `mode.index()`).
pub type RatePerMode = [TokenRate; 2];

pub(crate) fn rate_in(rates: &RatePerMode, mode: LoadMode) -> TokenRate {
    rates[mode.index()]
}

/// Device-wide values every thread's scheduler needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRates {
    pub costs: CostModel,
    /// The device's token rate at the strictest LC SLO, per mode (for reporting).
    pub device_tokens_per_sec: RatePerMode,
    /// Tokens this thread donates to the global bucket on behalf of reservations that no
    /// thread serves (LC tenants with no connection yet).
    pub unbound_tokens_per_sec: RatePerMode,
    /// Cap on the global bucket's positive balance.
    pub bucket_max: Tokens,
    /// How far the global bucket may lend to LC tenants at their deficit limit.
    pub loan_max: Tokens,
}

/// One tenant's rate on one thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantRates {
    pub tenant: TenantId,
    pub class: TenantClass,
    /// This thread's share of the tenant's rate, per mode. For LC tenants it is the
    /// reservation (plus spare capacity when there are no BE tenants); for BE tenants it is
    /// (device rate − Σ LC reservations) / N_BE.
    pub tokens_per_sec: RatePerMode,
    /// This thread's share of the deficit limit (a positive amount; the balance may fall to
    /// its negative).
    pub deficit_limit: Tokens,
}

/// A control message for one thread's scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateUpdate {
    Device(DeviceRates),
    /// Adds the tenant to the thread or changes its rates.
    Tenant(TenantRates),
    /// The tenant has no connection on this thread any more (or was unregistered). Requests
    /// still queued are served at the last rate before it goes.
    Remove(TenantId),
}
