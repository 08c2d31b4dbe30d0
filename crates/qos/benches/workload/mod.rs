//! The benchmark workload, shared by `benches/scheduler.rs` and `examples/scheduler_cost.rs`:
//! a scheduler with `tenants` tenants (one in ten best-effort, each LC tenant reserving twice
//! its share of 100K IOPS) and a deterministic request stream (90 % 4 KiB reads) spread evenly
//! over them, virtual time advancing 10 µs per request.

use std::sync::Arc;

use reflex_qos::{
    CostModel, DeviceRates, DeviceShared, IoKind, Nanos, Policy, QosConfig, RateUpdate, Request,
    SPARE_SHARE_ALL, Scheduler, TenantClass, TenantId, TenantRates, TokenRate, Tokens,
};

pub const IOPS_TOTAL: u64 = 100_000;

pub fn scheduler(tenants: u32) -> Scheduler {
    let config = QosConfig {
        tenants_max: tenants.max(1),
        thread_queued_requests_max: 4 * tenants.max(1024),
        ..QosConfig::default()
    };
    let shared = Arc::new(DeviceShared::new(config.read_only_window()));
    let mut scheduler =
        Scheduler::new(shared, 0, &config, Policy::Tokens, Nanos::ZERO).expect("valid config");
    let costs = CostModel {
        read: Tokens::ONE,
        write: Tokens::from_tokens(10),
        read_read_only: Tokens(500),
    };
    let be_count = tenants / 10;
    let lc_count = tenants - be_count;
    // Each LC tenant reserves twice its share of 100K IOPS at 90 % reads (1.9 tokens each).
    let lc_rate = if lc_count > 0 {
        TokenRate(2 * IOPS_TOTAL * 1_900 / u64::from(lc_count))
    } else {
        TokenRate::ZERO
    };
    let device_rate = TokenRate::from_tokens_per_sec(570_000);
    let lc_reserved = TokenRate(lc_rate.0 * u64::from(lc_count));
    let be_each = TokenRate(
        device_rate
            .0
            .saturating_sub(lc_reserved.0)
            .checked_div(u64::from(be_count))
            .unwrap_or(0),
    );
    scheduler.apply(
        RateUpdate::Device(DeviceRates {
            costs,
            device_tokens_per_sec: [device_rate; 2],
            lc_reserved_tokens_per_sec: [lc_reserved; 2],
            be_tokens_per_sec_each: [be_each; 2],
            lc_boost_tokens_per_sec_each: [TokenRate::ZERO; 2],
            unbound_tokens_per_sec: [TokenRate::ZERO; 2],
            bucket_max: Tokens::from_tokens(285),
            loan_max: Tokens::from_tokens(50),
            spare_share_ppm: SPARE_SHARE_ALL,
            be_floor_ppm: 0,
        }),
        Nanos::ZERO,
    );
    for id in 0..tenants {
        let (class, reserved) = if id % 10 == 9 {
            (TenantClass::BestEffort, TokenRate::ZERO)
        } else {
            (TenantClass::LatencyCritical, lc_rate)
        };
        scheduler.apply(
            RateUpdate::Tenant(TenantRates {
                tenant: TenantId(id),
                class,
                reserved_tokens_per_sec: [reserved; 2],
                connections_here: 1,
                connections_total: 1,
                deficit_limit: Tokens::from_tokens(50),
            }),
            Nanos::ZERO,
        );
    }
    scheduler
}

/// A deterministic request stream over the tenants.
pub struct Stream {
    pub state: u64,
    pub tenants: u32,
    pub now: Nanos,
    pub token: u64,
}

impl Stream {
    pub fn next_request(&mut self) -> (TenantId, Request) {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        self.token += 1;
        self.now += Nanos(1_000_000_000 / IOPS_TOTAL);
        let kind = if r % 100 < 10 {
            IoKind::Write
        } else {
            IoKind::Read
        };
        let tenant = TenantId(((r >> 32) % u64::from(self.tenants)) as u32);
        (
            tenant,
            Request {
                token: self.token,
                size_bytes: 4096,
                kind,
            },
        )
    }
}
