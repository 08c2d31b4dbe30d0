//! Scheduler CPU cost per request, measured over a fixed workload so it can run under
//! `perf stat -e task-clock` (CPU time, unaffected by other processes taking the core) or
//! `valgrind --tool=callgrind` (instruction counts). Usage:
//! `scheduler_cost TENANTS BATCH ROUNDS`.

use std::hint::black_box;
use std::sync::Arc;

use reflex_qos::{
    CostModel, DeviceRates, DeviceShared, IoKind, Nanos, Policy, QosConfig, RateUpdate, Request,
    Scheduler, TenantClass, TenantId, TenantRates, TokenRate, Tokens,
};

const TENANT_COUNTS: [u32; 4] = [1, 100, 1_000, 10_000];
const IOPS_TOTAL: u64 = 100_000;

fn scheduler(tenants: u32) -> Scheduler {
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
    scheduler.apply(
        RateUpdate::Device(DeviceRates {
            costs,
            device_tokens_per_sec: [TokenRate::from_tokens_per_sec(570_000); 2],
            unbound_tokens_per_sec: [TokenRate::ZERO; 2],
            bucket_max: Tokens::from_tokens(285),
            loan_max: Tokens::from_tokens(50),
        }),
        Nanos::ZERO,
    );
    let be_count = (tenants / 10).max(u32::from(tenants > 1));
    let lc_count = tenants - be_count;
    // Each LC tenant reserves twice its share of 100K IOPS at 90 % reads (1.9 tokens each).
    let lc_rate = if lc_count > 0 {
        TokenRate(2 * IOPS_TOTAL * 1_900 / u64::from(lc_count))
    } else {
        TokenRate::ZERO
    };
    let be_rate = if be_count > 0 {
        TokenRate((570_000_000u64).saturating_sub(lc_rate.0 * u64::from(lc_count)) / u64::from(be_count))
    } else {
        TokenRate::ZERO
    };
    for id in 0..tenants {
        let best_effort = id % 10 == 9 || (tenants > 1 && lc_count == tenants && id == 0);
        let (class, rate) = if best_effort {
            (TenantClass::BestEffort, be_rate)
        } else {
            (TenantClass::LatencyCritical, lc_rate)
        };
        scheduler.apply(
            RateUpdate::Tenant(TenantRates {
                tenant: TenantId(id),
                class,
                tokens_per_sec: [rate; 2],
                deficit_limit: Tokens::from_tokens(50),
            }),
            Nanos::ZERO,
        );
    }
    scheduler
}

/// A deterministic request stream over the tenants.
struct Stream {
    state: u64,
    tenants: u32,
    now: Nanos,
    token: u64,
}

impl Stream {
    fn next(&mut self) -> (TenantId, Request) {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        self.token += 1;
        self.now = self.now + Nanos(1_000_000_000 / IOPS_TOTAL);
        let kind = if r % 10 == 0 { IoKind::Write } else { IoKind::Read };
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

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or(0))
        .collect();
    let (tenants, batch, rounds) = match args[..] {
        [t, b, r] => (t as u32, b as u32, r),
        _ => (1000, 1, 1_000_000),
    };
    let _ = TENANT_COUNTS;
    let mut scheduler = scheduler(tenants);
    let mut stream = Stream {
        state: 0x9E37_79B9_7F4A_7C15,
        tenants,
        now: Nanos::ZERO,
        token: 0,
    };
    let started = std::time::Instant::now();
    let mut submitted = 0u64;
    for _ in 0..rounds {
        for _ in 0..batch {
            let (tenant, request) = stream.next();
            let _ = scheduler.enqueue(tenant, request, stream.now);
        }
        let summary = scheduler.schedule(stream.now, &mut |admitted| {
            black_box(admitted);
            true
        });
        submitted += u64::from(summary.submitted);
    }
    let elapsed = started.elapsed();
    println!(
        "tenants {tenants} batch {batch}: {rounds} rounds, {submitted} requests, wall {:.1} ns/request",
        elapsed.as_nanos() as f64 / (rounds * u64::from(batch)) as f64
    );
}
