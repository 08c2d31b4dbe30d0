//! Scheduling cost per round and per request with 1, 100, 1,000 and 10,000 tenants on one
//! thread (issue 4). Target: ≤ 3 % of a core at 1,000 tenants and 100K IOPS, i.e. ≤ 300 ns of
//! scheduler time per request when every request gets a round of its own.
//!
//! The workload: 100K IOPS of 4 KiB requests (90 % reads) spread evenly over the tenants (one
//! in ten best-effort), virtual time advancing 10 µs per request, a device that takes
//! everything. Each LC tenant reserves twice its share so queues stay short, as in a
//! provisioned system. Three shapes:
//! * `round_1`: one request, then one round (the dataplane at low batching);
//! * `round_16`: sixteen requests, then one round (adaptive batching under load);
//! * `all_active`: every tenant has one request queued, then one round (worst case per round).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use reflex_qos::{IoKind, Nanos, Request, TenantId};

mod workload;
use workload::{Stream, scheduler};

const TENANT_COUNTS: [u32; 4] = [1, 100, 1_000, 10_000];

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler");
    for tenants in TENANT_COUNTS {
        for batch in [1u32, 16] {
            let mut scheduler = scheduler(tenants);
            let mut stream = Stream {
                state: 0x9E37_79B9_7F4A_7C15,
                tenants,
                now: Nanos::ZERO,
                token: 0,
            };
            let mut refused = 0u64;
            group.throughput(Throughput::Elements(u64::from(batch)));
            group.bench_function(BenchmarkId::new(format!("round_{batch}"), tenants), |b| {
                b.iter(|| {
                    for _ in 0..batch {
                        let (tenant, request) = stream.next_request();
                        if scheduler.enqueue(tenant, request, stream.now).is_err() {
                            refused += 1;
                        }
                    }
                    let summary = scheduler.schedule(stream.now, &mut |admitted| {
                        black_box(admitted);
                        true
                    });
                    black_box(summary)
                })
            });
            // The stream never outruns the reservations, so nothing is ever refused.
            assert_eq!(refused, 0, "{tenants} tenants, batch {batch}");
        }
        let mut scheduler = scheduler(tenants);
        let mut now = Nanos::ZERO;
        let mut token = 0;
        group.throughput(Throughput::Elements(u64::from(tenants)));
        group.bench_function(BenchmarkId::new("all_active", tenants), |b| {
            b.iter(|| {
                for id in 0..tenants {
                    token += 1;
                    let request = Request {
                        token,
                        size_bytes: 4096,
                        kind: IoKind::Read,
                    };
                    let _ = scheduler.enqueue(TenantId(id), request, now);
                }
                // Long enough for every tenant to afford its request.
                now += Nanos::from_micros(50 * u64::from(tenants).max(1));
                let summary = scheduler.schedule(now, &mut |admitted| {
                    black_box(admitted);
                    true
                });
                black_box(summary)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
