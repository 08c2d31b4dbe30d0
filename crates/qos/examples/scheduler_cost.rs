//! Scheduler CPU cost per request, measured over a fixed workload so it can run under
//! `perf stat -e task-clock` (CPU time, unaffected by waiting for a core) or
//! `valgrind --tool=callgrind` (instruction counts, repeatable). Usage:
//! `scheduler_cost TENANTS BATCH ROUNDS` (the benchmark's `round_BATCH` shape) or
//! `scheduler_cost TENANTS all ROUNDS` (its `all_active` shape).

use std::hint::black_box;

use reflex_qos::{IoKind, Nanos, Request, TenantId};

#[path = "../benches/workload/mod.rs"]
mod workload;
use workload::{Stream, scheduler};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |index: usize, default: u64| {
        args.get(index)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let tenants = number(0, 1000) as u32;
    let all_active = args.get(1).is_some_and(|a| a == "all");
    let batch = if all_active {
        tenants
    } else {
        number(1, 1) as u32
    };
    let rounds = number(2, 1_000_000);
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
        if all_active {
            for id in 0..tenants {
                stream.token += 1;
                let request = Request {
                    token: stream.token,
                    size_bytes: 4096,
                    kind: IoKind::Read,
                };
                let _ = scheduler.enqueue(TenantId(id), request, stream.now);
            }
            stream.now += Nanos::from_micros(50 * u64::from(tenants).max(1));
        } else {
            for _ in 0..batch {
                let (tenant, request) = stream.next_request();
                let _ = scheduler.enqueue(tenant, request, stream.now);
            }
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
