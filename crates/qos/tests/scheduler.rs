//! The scheduler driven through its public API, the way the dataplane drives it: rates from
//! the registry, requests enqueued, rounds at explicit times, a device that accepts or refuses.

use std::sync::Arc;

use reflex_qos::{
    Admitted, DeviceProfile, DeviceShared, EnqueueError, IoKind, LoadMode, Nanos, Policy,
    QosConfig, Request, Scheduler, SchedulerEvent, TenantId, TenantRegistry, TenantSpec,
    TokenLimit, Tokens,
};

fn device_a() -> DeviceProfile {
    DeviceProfile {
        name: "paper-device-a".into(),
        write_cost: 10.0,
        read_only_read_cost: 0.5,
        token_limits: vec![
            TokenLimit {
                latency_us_p95: 500,
                tokens_per_sec: 420_000.0,
                reads_per_sec_read_only: 850_000.0,
            },
            TokenLimit {
                latency_us_p95: 2000,
                tokens_per_sec: 570_000.0,
                reads_per_sec_read_only: 1_000_000.0,
            },
        ],
    }
}

struct Setup {
    registry: TenantRegistry,
    shared: Arc<DeviceShared>,
    threads: Vec<Scheduler>,
}

impl Setup {
    fn new(threads: u16, config: QosConfig, policy: Policy) -> Setup {
        let registry = TenantRegistry::new(device_a(), config.clone(), threads).unwrap();
        let shared = Arc::new(DeviceShared::new(config.read_only_window()));
        let threads = (0..threads)
            .map(|t| Scheduler::new(shared.clone(), t, &config, policy, Nanos::ZERO).unwrap())
            .collect();
        Setup {
            registry,
            shared,
            threads,
        }
    }

    fn add(&mut self, spec: TenantSpec, threads: &[u16], now: Nanos) -> TenantId {
        let id = self.registry.register(spec).unwrap();
        for &t in threads {
            self.registry.connect(id, t).unwrap();
        }
        self.sync(now);
        id
    }

    fn sync(&mut self, now: Nanos) {
        for (thread, update) in self.registry.take_updates() {
            self.threads[usize::from(thread)].apply(update, now);
        }
    }

    /// Runs a round on `thread` with a device that accepts everything; returns what it took.
    fn round(&mut self, thread: usize, now: Nanos) -> Vec<Admitted> {
        let mut taken = Vec::new();
        self.threads[thread].schedule(now, &mut |a| {
            taken.push(a);
            true
        });
        self.threads[thread].check();
        taken
    }

    /// Submits one write through a BE tenant on `thread` at 100 µs so the device is in mixed
    /// mode (reads cost 1 token) for the next 5 ms; returns the time after it.
    fn make_mixed(&mut self, thread: u16) -> Nanos {
        let primer = self.add(TenantSpec::BestEffort, &[thread], Nanos::ZERO);
        self.threads[usize::from(thread)]
            .enqueue(primer, write(u64::MAX), Nanos::ZERO)
            .unwrap();
        let taken = self.round(usize::from(thread), us(100));
        assert_eq!(taken.len(), 1);
        assert_eq!(self.shared.load_mode(us(100)), LoadMode::Mixed);
        us(100)
    }

    fn events(&mut self, thread: usize) -> Vec<SchedulerEvent> {
        std::iter::from_fn(|| self.threads[thread].poll_event()).collect()
    }
}

fn read(token: u64) -> Request {
    Request {
        token,
        size_bytes: 4096,
        kind: IoKind::Read,
    }
}

fn write(token: u64) -> Request {
    Request {
        token,
        size_bytes: 4096,
        kind: IoKind::Write,
    }
}

fn no_lending() -> QosConfig {
    QosConfig {
        loan_max_tokens: 0.0,
        ..QosConfig::default()
    }
}

fn us(micros: u64) -> Nanos {
    Nanos::from_micros(micros)
}

#[test]
fn lc_tenant_bursts_to_its_deficit_limit_then_is_rate_limited_and_reported_once() {
    let mut s = Setup::new(1, no_lending(), Policy::Tokens);
    let start = s.make_mixed(0);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 100_000,
            read_percent: 100,
        },
        &[0],
        start,
    );
    for token in 0..200 {
        s.threads[0].enqueue(a, read(token), start).unwrap();
    }
    // A pays 1 token per read from a zero balance down to the limit of -50: 50 reads.
    let first = s.round(0, start);
    let from_a: Vec<u64> = first
        .iter()
        .filter(|x| x.tenant == a)
        .map(|x| x.token)
        .collect();
    assert_eq!(
        from_a,
        (0..50).collect::<Vec<_>>(),
        "burst down to the limit, in order"
    );
    assert_eq!(
        s.events(0),
        vec![SchedulerEvent::DeficitLimitReached { tenant: a }]
    );
    // It earns 100K tokens/s = 1 token per 10 µs; the next read becomes payable then.
    let deadline = s.threads[0].next_deadline().unwrap();
    assert!(
        deadline > start && deadline <= start + us(10),
        "{deadline:?}"
    );
    let mut submitted = 50;
    let mut now = start;
    while now < start + us(1000) {
        now += us(10);
        submitted += s.round(0, now).iter().filter(|x| x.tenant == a).count();
    }
    // Rate-limited at exactly its rate: 1 read per 10 µs over 1 ms.
    assert_eq!(submitted, 150);
    assert!(
        s.events(0).is_empty(),
        "no second notice within the episode"
    );
    // Let it drain and recover, then burst again: a second episode, a second notice.
    now += us(2000);
    s.round(0, now);
    let later = s.events(0);
    assert!(
        later.contains(&SchedulerEvent::DeficitRecovered { tenant: a }),
        "{later:?}"
    );
    assert_eq!(s.threads[0].queued(a), 0);
    for token in 1000..1200 {
        s.threads[0].enqueue(a, read(token), now).unwrap();
    }
    s.round(0, now);
    assert_eq!(
        s.events(0),
        vec![SchedulerEvent::DeficitLimitReached { tenant: a }]
    );
    assert_eq!(s.threads[0].tenant_stats(a).unwrap().deficit_episodes, 2);
}

/// Burst room of 100 ms of the tenant's reservation (`deficit_limit_us`), here 1,000 reads
/// of a 10K-IOPS tenant, before it is held to its rate and told once.
#[test]
fn lc_tenant_with_burst_room_bursts_100_ms_of_its_reservation() {
    let config = QosConfig {
        deficit_limit_us: 100_000,
        ..no_lending()
    };
    let mut s = Setup::new(1, config, Policy::Tokens);
    let start = s.make_mixed(0);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 10_000,
            read_percent: 100,
        },
        &[0],
        start,
    );
    for token in 0..1_024 {
        s.threads[0].enqueue(a, read(token), start).unwrap();
    }
    let first = s.round(0, start);
    assert_eq!(first.iter().filter(|x| x.tenant == a).count(), 1_000);
    assert_eq!(
        s.events(0),
        vec![SchedulerEvent::DeficitLimitReached { tenant: a }]
    );
    // Then its rate: 10 reads in the next millisecond.
    let next = s.round(0, start + us(1_000));
    assert_eq!(next.iter().filter(|x| x.tenant == a).count(), 10);
}

/// Burst room is time: a tenant that spent 100 ms of a 10K-IOPS reservation and is then cut to
/// 1K IOPS owes 100 ms of the new one, not a second of it (the debt beyond is written off, and
/// the token books still balance).
#[test]
fn a_cut_reservation_keeps_the_burst_room_debt_to_its_new_limit() {
    let config = QosConfig {
        deficit_limit_us: 100_000,
        ..no_lending()
    };
    let mut s = Setup::new(1, config, Policy::Tokens);
    let start = s.make_mixed(0);
    let spec = |iops| TenantSpec::LatencyCritical {
        latency_us_p95: 500,
        iops,
        read_percent: 100,
    };
    let a = s.add(spec(10_000), &[0], start);
    for token in 0..1_024 {
        s.threads[0].enqueue(a, read(token), start).unwrap();
    }
    assert_eq!(s.round(0, start).len(), 1_000);
    let debt = s.threads[0].tenant_stats(a).unwrap().balance;
    assert!(debt <= Tokens::from_tokens(-999), "{debt:?}");
    let written_off_before = s.threads[0].ledger().written_off;

    s.registry.reregister(a, spec(1_000)).unwrap();
    s.sync(start);
    s.threads[0].check();
    let balance = s.threads[0].tenant_stats(a).unwrap().balance;
    assert_eq!(
        balance,
        Tokens::from_tokens(-100),
        "the new limit: 100 ms of 1K IOPS"
    );
    assert_eq!(
        s.threads[0].ledger().written_off - written_off_before,
        debt - balance
    );
    // Served again after 100 ms of its new rate (at 1K IOPS, one read per millisecond), not
    // after the whole old debt (a second).
    let later = s.round(0, start + us(101_000));
    assert!(later.iter().any(|x| x.tenant == a), "{later:?}");

    // Raising the reservation back moves the limit down again and writes nothing off.
    let written_off = s.threads[0].ledger().written_off;
    s.registry.reregister(a, spec(10_000)).unwrap();
    s.sync(start + us(101_000));
    s.threads[0].check();
    assert_eq!(s.threads[0].ledger().written_off, written_off);
}

#[test]
fn lending_lets_an_lc_tenant_past_its_limit_and_best_effort_tenants_repay() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    let start = s.make_mixed(0);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 100_000,
            read_percent: 100,
        },
        &[0],
        start,
    );
    let be = s.add(TenantSpec::BestEffort, &[0], start);
    s.threads[0].enqueue(be, write(999), start).unwrap();
    for token in 0..200 {
        s.threads[0].enqueue(a, read(token), start).unwrap();
    }
    let first = s.round(0, start);
    // 50 from its balance, then 50 more borrowed (loan_max = 50 tokens).
    assert_eq!(first.iter().filter(|x| x.tenant == a).count(), 100);
    assert_eq!(s.shared.stats().balance, Tokens::from_tokens(-50));
    // Two BE tenants now earn 160K tokens/s each; their first 50 tokens repay the loan.
    s.round(0, start + us(100));
    assert!(s.shared.stats().balance < Tokens::ZERO);
    s.round(0, start + us(400));
    assert!(s.shared.stats().balance >= Tokens::ZERO);
    let stats = s.threads[0].tenant_stats(be).unwrap();
    assert!(stats.donated_tokens >= Tokens::from_tokens(25), "{stats:?}");
}

#[test]
fn best_effort_tenants_share_evenly_in_tokens_and_never_go_into_deficit() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    let d = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    let mut token = 0;
    let mut now = Nanos::ZERO;
    for _ in 0..5000 {
        // Keep both queues long: C mostly reads, D mostly writes.
        for (tenant, writes_every) in [(c, 20), (d, 4)] {
            while s.threads[0].queued(tenant) < 32 {
                token += 1;
                let request = if token % writes_every == 0 {
                    write(token)
                } else {
                    read(token)
                };
                s.threads[0].enqueue(tenant, request, now).unwrap();
            }
        }
        s.round(0, now);
        now += us(7);
    }
    let tokens_c = s.threads[0].tenant_stats(c).unwrap().submitted_tokens;
    let tokens_d = s.threads[0].tenant_stats(d).unwrap().submitted_tokens;
    let ratio = tokens_c.as_tokens_f64() / tokens_d.as_tokens_f64();
    assert!((0.95..=1.05).contains(&ratio), "C {tokens_c} D {tokens_d}");
    // Together they used the device rate (no LC tenants: the loosest row, 570K tokens/s) for
    // 35 ms, less what they held back for their next request.
    let total = (tokens_c + tokens_d).as_tokens_f64();
    let expected = 570_000.0 * now.as_secs_f64();
    assert!(total <= expected + 1.0, "{total} > {expected}");
    assert!(total >= expected * 0.98, "{total} < {expected}");
    let requests_c = s.threads[0].tenant_stats(c).unwrap().submitted_requests;
    let requests_d = s.threads[0].tenant_stats(d).unwrap().submitted_requests;
    assert!(
        requests_d < requests_c,
        "writes cost more, so D does fewer requests"
    );
}

/// What an idle LC tenant leaves flows to best-effort tenants (the paper's work conservation)
/// in self-calibration's spare share ([`TenantRegistry::set_spare_share`]; 1 unless it
/// withholds): the rest is withheld, and every token is still accounted for.
#[test]
fn idle_lc_reservation_flows_to_best_effort_tenants_in_the_spare_share() {
    let best_effort_rate = |share: f64| {
        let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
        s.add(
            TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: 200_000,
                read_percent: 100,
            },
            &[0],
            Nanos::ZERO,
        );
        let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
        s.registry.set_spare_share(share).unwrap();
        assert_eq!(s.registry.plan().spare_share, share);
        s.sync(Nanos::ZERO);
        let mut token = 0;
        let mut now = Nanos::ZERO;
        for _ in 0..10_000 {
            while s.threads[0].queued(c) < 64 {
                token += 1;
                s.threads[0].enqueue(c, write(token), now).unwrap();
            }
            s.round(0, now);
            now += us(5);
        }
        let used = s.threads[0].tenant_stats(c).unwrap().submitted_tokens;
        let withheld = s.threads[0].ledger().withheld.as_tokens_f64() / now.as_secs_f64();
        (used.as_tokens_f64() / now.as_secs_f64(), withheld)
    };
    // C's own 220K tokens/s, plus none, half or all of A's 200K.
    let (none, withheld_all) = best_effort_rate(0.0);
    assert!(
        (215_000.0..=220_100.0).contains(&none),
        "C used {none} tokens/s"
    );
    assert!(withheld_all > 190_000.0, "withheld {withheld_all} tokens/s");
    let (half, _) = best_effort_rate(0.5);
    assert!(
        (310_000.0..=320_100.0).contains(&half),
        "C used {half} tokens/s"
    );
    let (all, withheld_none) = best_effort_rate(1.0);
    assert!(
        (400_000.0..=420_100.0).contains(&all),
        "C used {all} tokens/s"
    );
    assert_eq!(withheld_none, 0.0);
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(s.registry.set_spare_share(bad).is_err(), "{bad}");
    }
    assert_eq!(s.registry.spare_share(), 1.0);
}

#[test]
fn full_queues_push_back_and_report_room_later() {
    let config = QosConfig {
        tenant_queue_depth_max: 4,
        ..QosConfig::default()
    };
    let mut s = Setup::new(1, config, Policy::Tokens);
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    for token in 0..4 {
        s.threads[0].enqueue(c, read(token), Nanos::ZERO).unwrap();
    }
    assert_eq!(
        s.threads[0].enqueue(c, read(4), Nanos::ZERO),
        Err(EnqueueError::TenantQueueFull {
            tenant: c,
            depth_max: 4
        })
    );
    assert_eq!(
        s.threads[0].queued(c),
        4,
        "refused, not dropped, not queued"
    );
    s.round(0, us(100));
    assert_eq!(s.events(0), vec![SchedulerEvent::QueueRoom { tenant: c }]);
    s.threads[0].enqueue(c, read(4), us(100)).unwrap();
    assert_eq!(
        s.threads[0].enqueue(TenantId(77), read(5), us(100)),
        Err(EnqueueError::UnknownTenant(TenantId(77)))
    );
}

#[test]
fn a_refusing_device_keeps_requests_in_order_and_their_tokens() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    for token in 0..10 {
        s.threads[0].enqueue(c, read(token), Nanos::ZERO).unwrap();
    }
    let mut room = 3;
    let mut taken = Vec::new();
    let summary = s.threads[0].schedule(us(100), &mut |a| {
        if room == 0 {
            return false;
        }
        room -= 1;
        taken.push(a.token);
        true
    });
    s.threads[0].check();
    assert!(summary.device_full, "{summary:?} {taken:?}");
    assert_eq!(taken, vec![0, 1, 2]);
    assert_eq!(
        s.round(0, us(100))
            .iter()
            .map(|a| a.token)
            .collect::<Vec<_>>(),
        (3..10).collect::<Vec<_>>()
    );
}

#[test]
fn qos_off_passes_everything_through_in_arrival_order() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Fifo);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 1000,
            read_percent: 100,
        },
        &[0],
        Nanos::ZERO,
    );
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    let mut expected = Vec::new();
    for token in 0..300 {
        let tenant = if token % 3 == 0 { a } else { c };
        s.threads[0]
            .enqueue(tenant, write(token), Nanos::ZERO)
            .unwrap();
        expected.push(token);
    }
    let taken: Vec<u64> = s.round(0, Nanos::ZERO).iter().map(|x| x.token).collect();
    assert_eq!(taken, expected, "no rate limit, FIFO over tenants");
    assert_eq!(
        s.threads[0].tenant_stats(a).unwrap().submitted_tokens,
        Tokens::from_tokens(1000)
    );
}

#[test]
fn reads_cost_half_a_token_while_the_device_is_read_only() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    s.threads[0].enqueue(c, read(1), Nanos::ZERO).unwrap();
    let costs: Vec<Tokens> = s.round(0, us(100)).iter().map(|x| x.cost).collect();
    assert_eq!(costs, vec![Tokens(500)]);
    s.threads[0].enqueue(c, write(2), us(100)).unwrap();
    s.threads[0].enqueue(c, read(3), us(100)).unwrap();
    let costs: Vec<Tokens> = s.round(0, us(300)).iter().map(|x| x.cost).collect();
    assert_eq!(costs, vec![Tokens::from_tokens(10), Tokens::ONE]);
    // 5 ms without writes: read-only again.
    s.threads[0].enqueue(c, read(4), us(6000)).unwrap();
    let costs: Vec<Tokens> = s.round(0, us(6000)).iter().map(|x| x.cost).collect();
    assert_eq!(costs, vec![Tokens(500)]);
}

#[test]
fn threads_share_the_bucket_and_it_resets_once_all_finished_a_round() {
    let mut s = Setup::new(2, QosConfig::default(), Policy::Tokens);
    // An idle LC tenant on thread 0 donates; a BE tenant on thread 1 claims.
    let _a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 200_000,
            read_percent: 100,
        },
        &[0],
        Nanos::ZERO,
    );
    let c = s.add(TenantSpec::BestEffort, &[1], Nanos::ZERO);
    let mut token = 0;
    let mut now = Nanos::ZERO;
    for _ in 0..4000 {
        while s.threads[1].queued(c) < 64 {
            token += 1;
            s.threads[1].enqueue(c, write(token), now).unwrap();
        }
        s.round(0, now);
        s.round(1, now);
        now += us(5);
    }
    let rate = s.threads[1]
        .tenant_stats(c)
        .unwrap()
        .submitted_tokens
        .as_tokens_f64()
        / now.as_secs_f64();
    assert!(rate > 400_000.0, "C used {rate} tokens/s");
    let stats = s.shared.stats();
    assert!(stats.resets >= 3999, "{stats:?}");
    let (to, from) = s
        .threads
        .iter()
        .fold((Tokens::ZERO, Tokens::ZERO), |(to, from), t| {
            (to + t.ledger().to_bucket, from + t.ledger().from_bucket)
        });
    assert_eq!(to - from - stats.discarded, stats.balance, "{stats:?}");
}

#[test]
fn a_tenant_on_two_threads_earns_its_reservation_once() {
    let mut s = Setup::new(2, no_lending(), Policy::Tokens);
    let start = s.make_mixed(0);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 100_000,
            read_percent: 100,
        },
        &[0, 1],
        start,
    );
    let mut token = 1;
    let mut now = start;
    let mut a_submitted = 0;
    // 4 ms: the device stays mixed for 5 ms after the primer's write.
    for _ in 0..400 {
        for t in 0..2 {
            while s.threads[t].queued(a) < 64 {
                token += 1;
                s.threads[t].enqueue(a, read(token), now).unwrap();
            }
        }
        for t in 0..2 {
            a_submitted += s.round(t, now).iter().filter(|x| x.tenant == a).count();
        }
        now += us(10);
    }
    // 100K IOPS for 4 ms plus the two threads' deficit limits (25 tokens each).
    let expected = 100_000.0 * (now - start).as_secs_f64() + 50.0;
    assert!(
        (a_submitted as f64) <= expected + 2.0,
        "{a_submitted} vs {expected}"
    );
    assert!(
        (a_submitted as f64) >= expected - 12.0,
        "{a_submitted} vs {expected}"
    );
}

#[test]
fn a_removed_tenant_is_served_until_its_queue_is_empty_and_a_class_change_moves_it() {
    let mut s = Setup::new(1, QosConfig::default(), Policy::Tokens);
    let c = s.add(TenantSpec::BestEffort, &[0], Nanos::ZERO);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 10_000,
            read_percent: 100,
        },
        &[0],
        Nanos::ZERO,
    );
    for token in 0..5 {
        s.threads[0].enqueue(c, read(token), Nanos::ZERO).unwrap();
    }
    // C's last connection closes with five requests queued: they are still served.
    s.registry.disconnect(c, 0).unwrap();
    s.sync(us(1));
    assert_eq!(
        s.threads[0].enqueue(c, read(99), us(1)),
        Err(EnqueueError::UnknownTenant(c))
    );
    let served: Vec<u64> = s.round(0, us(100)).iter().map(|x| x.token).collect();
    assert_eq!(served, vec![0, 1, 2, 3, 4]);
    assert_eq!(s.threads[0].tenant_stats(c), None, "gone once drained");
    // A becomes best effort: it keeps being served, now from the BE subround.
    s.registry.reregister(a, TenantSpec::BestEffort).unwrap();
    s.sync(us(200));
    for token in 10..13 {
        s.threads[0].enqueue(a, read(token), us(200)).unwrap();
    }
    let mut served = Vec::new();
    let mut now = us(200);
    while served.len() < 3 && now < us(10_000) {
        now += us(50);
        served.extend(s.round(0, now).iter().map(|x| x.token));
    }
    assert_eq!(served, vec![10, 11, 12]);
    let stats = s.threads[0].tenant_stats(a).unwrap();
    assert!(
        stats.balance >= Tokens::ZERO,
        "a BE tenant is never in deficit: {stats:?}"
    );
}

#[test]
fn cancelled_requests_leave_without_tokens_and_the_scheduler_stays_consistent() {
    for policy in [Policy::Tokens, Policy::Fifo] {
        let config = QosConfig {
            tenant_queue_depth_max: 4,
            ..no_lending()
        };
        let mut s = Setup::new(1, config, policy);
        let start = s.make_mixed(0);
        let a = s.add(
            TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: 1_000,
                read_percent: 100,
            },
            &[0],
            start,
        );
        let c = s.add(TenantSpec::BestEffort, &[0], start);
        for token in 0..4 {
            s.threads[0].enqueue(a, write(token), start).unwrap();
            s.threads[0].enqueue(c, write(10 + token), start).unwrap();
        }
        assert!(s.threads[0].enqueue(c, write(99), start).is_err());
        let spent_before = s.threads[0].ledger().spent;
        let mut cancelled = Vec::new();
        s.threads[0].cancel_queued(&mut |tenant, token| cancelled.push((tenant, token)));
        s.threads[0].check();
        cancelled.sort_unstable_by_key(|&(_, token)| token);
        let expected: Vec<(TenantId, u64)> = (0..4)
            .map(|token| (a, token))
            .chain((10..14).map(|token| (c, token)))
            .collect();
        assert_eq!(cancelled, expected, "{policy:?}");
        assert_eq!(s.threads[0].queued(a), 0);
        assert_eq!(s.threads[0].queued(c), 0);
        assert_eq!(s.threads[0].ledger().spent, spent_before, "{policy:?}");
        assert_eq!(s.threads[0].next_deadline(), None, "{policy:?}");
        assert_eq!(
            s.events(0),
            vec![SchedulerEvent::QueueRoom { tenant: c }],
            "{policy:?}"
        );
        // Nothing comes out later, and the tenants are served again afterwards.
        assert!(s.round(0, start + us(10_000)).is_empty(), "{policy:?}");
        s.threads[0]
            .enqueue(c, read(20), start + us(10_000))
            .unwrap();
        let mut served = Vec::new();
        let mut now = start + us(10_000);
        while served.is_empty() && now < start + us(100_000) {
            served.extend(s.round(0, now).iter().map(|x| x.token));
            now += us(100);
        }
        assert_eq!(served, vec![20], "{policy:?}");
    }
}

/// Fuzz finding 7: an LC tenant in deficit renegotiated to best effort (a REGISTER naming its
/// handle) panicked the dataplane thread ("BE tenant in deficit" in `serve_be`).
#[test]
fn an_lc_tenant_in_deficit_that_becomes_best_effort_is_not_a_best_effort_tenant_in_deficit() {
    let mut s = Setup::new(1, no_lending(), Policy::Tokens);
    let start = s.make_mixed(0);
    let a = s.add(
        TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 1_000,
            read_percent: 100,
        },
        &[0],
        start,
    );
    for token in 0..100 {
        s.threads[0].enqueue(a, write(token), start).unwrap();
    }
    s.round(0, start);
    let balance = s.threads[0].tenant_stats(a).unwrap().balance;
    assert!(balance < Tokens::ZERO, "{balance:?}");
    s.registry.reregister(a, TenantSpec::BestEffort).unwrap();
    s.sync(start + us(1));
    s.threads[0].check();
    let stats = s.threads[0].tenant_stats(a).unwrap();
    assert_eq!(
        stats.balance,
        Tokens::ZERO,
        "the debt is written off: {stats:?}"
    );
    assert!(s.threads[0].ledger().written_off < Tokens::ZERO);
    // Served as best effort from now on (`round` checks the invariants every time), never
    // in deficit.
    let mut now = start + us(1);
    let mut served = 0;
    for _ in 0..1000 {
        served += s.round(0, now).iter().filter(|x| x.tenant == a).count();
        let balance = s.threads[0].tenant_stats(a).unwrap().balance;
        assert!(balance >= Tokens::ZERO, "{balance:?}");
        now += us(100);
    }
    assert!(served > 0);
}
