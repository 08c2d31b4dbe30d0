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

/// Device-wide values every thread's scheduler needs. A tenant's effective rate on a thread is
/// derived from these and its [`TenantRates`] by [`effective_rates`], so a change that affects
/// every tenant (a new BE tenant changes every BE tenant's share) is one message per thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRates {
    pub costs: CostModel,
    /// The device's token rate at the strictest LC SLO, per mode.
    pub device_tokens_per_sec: RatePerMode,
    /// Σ LC reservations, per mode. Where it exceeds the device rate (only possible in mixed
    /// mode under read-only admission, if a write arrives anyway) reservations are scaled down
    /// to fit.
    pub lc_reserved_tokens_per_sec: RatePerMode,
    /// What each BE tenant earns, over all its threads: (device − Σ LC) / N_BE.
    pub be_tokens_per_sec_each: RatePerMode,
    /// Spare capacity each LC tenant earns on top of its reservation when no BE tenant has a
    /// connection: (device − Σ LC) / N_LC.
    pub lc_boost_tokens_per_sec_each: RatePerMode,
    /// Tokens this thread donates to the global bucket on behalf of reservations that no
    /// thread serves (LC tenants with no connection yet).
    pub unbound_tokens_per_sec: RatePerMode,
    /// Cap on the global bucket's positive balance.
    pub bucket_max: Tokens,
    /// How far the global bucket may lend to LC tenants at their deficit limit.
    pub loan_max: Tokens,
    /// The share of this thread's donations that reaches the global bucket, in parts per
    /// million ([`SPARE_SHARE_ALL`]: all of it, as in the paper). Self-calibration lowers it
    /// when LC tenants miss their target where their reservations just fit: what they leave
    /// unused is then not spare, and best-effort tenants must not spend it
    /// ([`crate::calibrator`]). What repays the bucket's loans always goes in.
    pub spare_share_ppm: u32,
    /// The part of each best-effort tenant's fresh tokens that never repays loans to LC
    /// tenants, in parts per million: the best-effort floor's part of their rate while
    /// self-calibration has cut LC reservations, else 0 (as in the paper). LC tenants
    /// backlogged beyond what they are granted borrow every time the bucket allows; without
    /// this, the repayments take the floor from best-effort tenants and a cut that squeezes LC
    /// tenants starves them.
    pub be_floor_ppm: u32,
}

/// [`DeviceRates::spare_share_ppm`] when every donated token is spare.
pub const SPARE_SHARE_ALL: u32 = 1_000_000;

/// One tenant on one thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantRates {
    pub tenant: TenantId,
    pub class: TenantClass,
    /// LC: this thread's part of the reservation, per mode (parts over threads sum exactly to
    /// the reservation). Zero for BE tenants.
    pub reserved_tokens_per_sec: RatePerMode,
    /// The tenant's connections on this thread and in all; its share of per-tenant
    /// device-level rates (BE share, LC boost) is `connections_here / connections_total`.
    pub connections_here: u32,
    pub connections_total: u32,
    /// This thread's part of the deficit limit (a positive amount; the balance may fall to
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

/// A tenant's token rate on a thread, per mode. (The scheduler skips recomputing its tenants
/// when none of the `DeviceRates` fields read here changed: `scheduler::same_tenant_terms`
/// must list every one of them.)
pub fn effective_rates(device: &DeviceRates, tenant: &TenantRates) -> RatePerMode {
    let mut rates = [TokenRate::ZERO; 2];
    let total = u64::from(tenant.connections_total.max(1));
    let here = u64::from(tenant.connections_here.min(tenant.connections_total));
    for mode in LoadMode::ALL {
        let m = mode.index();
        rates[m] = match tenant.class {
            TenantClass::LatencyCritical => {
                let reserved = tenant.reserved_tokens_per_sec[m];
                let sum = device.lc_reserved_tokens_per_sec[m];
                let available = device.device_tokens_per_sec[m];
                let scaled = if sum > available && sum.0 > 0 {
                    reserved.share(available.0.min(sum.0), sum.0)
                } else {
                    reserved
                };
                scaled + device.lc_boost_tokens_per_sec_each[m].share(here, total)
            }
            TenantClass::BestEffort => device.be_tokens_per_sec_each[m].share(here, total),
        };
    }
    rates
}
