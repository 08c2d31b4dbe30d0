//! Prometheus metrics (`GET /metrics` on the admin listener), encoded by `prometheus-client`
//! from the live statistics at scrape time: a collector reads the sampler's latest sums
//! (counters since the server started) and its last window (gauges), so scraping costs the
//! dataplane nothing. Latencies are histograms in seconds with fixed bucket bounds
//! ([`LATENCY_BOUNDS_US`]), so PromQL's `histogram_quantile` gives any tenant's p95 over any
//! range; labels are `tenant`, `namespace`, `thread` and `device`.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use reflex_dataplane::live::{BATCH_BUCKETS, batch_bucket_floor};
use reflex_dataplane::telemetry::LatencyHistogram;
use reflex_qos::TenantSpec;

use crate::admin::stats::Sampler;

/// Upper bounds of the latency histograms' buckets, in µs (then +Inf).
pub const LATENCY_BOUNDS_US: [u64; 24] = [
    25, 50, 75, 100, 150, 200, 250, 300, 400, 500, 600, 750, 1_000, 1_500, 2_000, 3_000, 5_000,
    10_000, 20_000, 50_000, 100_000, 250_000, 1_000_000, 10_000_000,
];

/// The text exposition of every metric.
pub fn encode(sampler: &Arc<Mutex<Sampler>>) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::with_prefix("reflex");
    registry.register_collector(Box::new(SamplerCollector {
        sampler: Arc::clone(sampler),
    }));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    Ok(text)
}

struct SamplerCollector {
    sampler: Arc<Mutex<Sampler>>,
}

impl std::fmt::Debug for SamplerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SamplerCollector")
    }
}

type Labels = Vec<(&'static str, String)>;

/// Encodes a latency histogram as Prometheus wants it: counts at each bound, in seconds. A
/// bucket of the source histogram counts at the first bound at or above its upper edge, so
/// the counts never understate a latency; the sum uses the buckets' upper edges too.
fn encode_latency(
    metric: &mut prometheus_client::encoding::MetricEncoder,
    histogram: &LatencyHistogram,
) -> Result<(), std::fmt::Error> {
    let mut counts = [0u64; LATENCY_BOUNDS_US.len() + 1];
    let mut sum_us = 0u64;
    let mut total = 0u64;
    for (upper_us, count) in histogram.buckets() {
        total += count;
        sum_us = sum_us.saturating_add(upper_us.saturating_mul(count));
        let position = LATENCY_BOUNDS_US
            .iter()
            .position(|&bound| upper_us <= bound)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        counts[position] += count;
    }
    let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
        .iter()
        .zip(counts)
        .map(|(bound, count)| (*bound as f64 / 1e6, count))
        .collect();
    buckets.push((f64::MAX, counts[LATENCY_BOUNDS_US.len()]));
    metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        sum_us as f64 / 1e6,
        total,
        &buckets,
        None,
    )
}

/// Writes one metric family: a descriptor, then one sample per label set.
fn family<T>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: &[(Labels, T)],
    write: impl Fn(&mut prometheus_client::encoding::MetricEncoder, &T) -> Result<(), std::fmt::Error>,
) -> Result<(), std::fmt::Error> {
    if samples.is_empty() {
        return Ok(());
    }
    let mut descriptor = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in samples {
        let mut metric = descriptor.encode_family(labels)?;
        write(&mut metric, value)?;
    }
    Ok(())
}

fn counters(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Counter,
        samples,
        |metric, value| {
            metric.encode_counter::<prometheus_client::encoding::NoLabelSet, _, f64>(value, None)
        },
    )
}

fn gauges(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        name,
        help,
        MetricType::Gauge,
        samples,
        |metric, value| metric.encode_gauge(value),
    )
}

/// The Prometheus text format (0.0.4) of an OpenMetrics text: what clients that do not ask
/// for OpenMetrics get (`promtool check metrics`, curl). The samples are the same; a counter's
/// `# HELP` and `# TYPE` name its `_total` series, and `# UNIT` and `# EOF` go.
pub fn prometheus_text(open_metrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = open_metrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len() + 64 * counters.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|prefix| line.strip_prefix(prefix).map(|rest| (prefix, rest)));
        match descriptor {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// A label value without the characters the text format would need to escape.
fn clean(value: &str) -> String {
    value
        .chars()
        .map(|c| match c {
            '"' | '\\' | '\n' => '_',
            c => c,
        })
        .collect()
}

impl Collector for SamplerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sampler = self
            .sampler
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let control = sampler.control();
        let namespaces = sampler.namespaces();
        let latest = sampler.latest();
        let infos = control.tenants();
        let device_of = |namespace_id: u32| {
            namespaces
                .index_of(namespace_id)
                .map_or_else(String::new, |index| {
                    clean(&sampler.device(usize::from(index)))
                })
        };
        let tenant_labels = |name: &str, namespace_id: u32| -> Labels {
            vec![
                ("tenant", clean(name)),
                ("namespace", namespace_id.to_string()),
            ]
        };

        // Per tenant.
        let mut arrivals = Vec::new();
        let mut operations = Vec::new();
        let mut bytes = Vec::new();
        let mut tokens = Vec::new();
        let mut deficit_seconds = Vec::new();
        let mut notices = Vec::new();
        let mut queued = Vec::new();
        let mut connections = Vec::new();
        let mut slo = Vec::new();
        let mut reserved = Vec::new();
        let mut window_p95 = Vec::new();
        let mut window_iops = Vec::new();
        let mut slo_windows = Vec::new();
        let mut attainment = Vec::new();
        let mut latencies = Vec::new();
        let mut refusals = Vec::new();
        for info in &infos {
            let labels = tenant_labels(&info.name, info.namespace_id);
            let with = |key: &'static str, value: &str| {
                let mut labels = labels.clone();
                labels.push((key, value.to_string()));
                labels
            };
            notices.push((labels.clone(), info.deficit_episodes as f64));
            connections.push((
                labels.clone(),
                f64::from(info.connections_per_thread.iter().sum::<u32>()),
            ));
            if let TenantSpec::LatencyCritical {
                latency_us_p95,
                iops,
                ..
            } = info.spec
            {
                slo.push((labels.clone(), latency_us_p95 as f64 / 1e6));
                reserved.push((labels.clone(), iops as f64));
                let judged = sampler.attainment(info.handle);
                slo_windows.push((with("result", "met"), judged.windows_met as f64));
                slo_windows.push((
                    with("result", "missed"),
                    (judged.windows_judged - judged.windows_met) as f64,
                ));
                if let Some(share) = judged.attainment {
                    attainment.push((labels.clone(), share));
                }
            }
            if let Some(window) = sampler.tenant_window(info.handle) {
                if window.reads > 0 {
                    window_p95.push((labels.clone(), window.read_latency_us.p95 as f64 / 1e6));
                }
                window_iops.push((with("kind", "read"), window.read_iops));
                window_iops.push((with("kind", "write"), window.write_iops));
            }
            let Some(totals) = latest.tenants.get(&info.handle) else {
                continue;
            };
            arrivals.push((labels.clone(), totals.arrivals as f64));
            operations.push((with("kind", "read"), totals.reads as f64));
            operations.push((with("kind", "write"), totals.writes as f64));
            bytes.push((with("kind", "read"), totals.read_bytes as f64));
            bytes.push((with("kind", "write"), totals.write_bytes as f64));
            for (flow, millitokens) in [
                ("spent", totals.millitokens_spent),
                ("earned", totals.millitokens_earned),
                ("claimed", totals.millitokens_from_bucket),
                ("donated", totals.millitokens_donated),
            ] {
                tokens.push((with("flow", flow), millitokens.max(0) as f64 / 1000.0));
            }
            deficit_seconds.push((labels.clone(), totals.deficit_ns as f64 / 1e9));
            for refusal in reflex_dataplane::access::Refusal::ALL {
                let count = totals.refusals[refusal.index()];
                if count > 0 {
                    refusals.push((with("reason", refusal.label()), count as f64));
                }
            }
            queued.push((labels.clone(), totals.queued as f64));
            latencies.push((labels, &totals.read_latency));
        }
        counters(
            &mut encoder,
            "tenant_arrivals",
            "Requests received for the tenant.",
            &arrivals,
        )?;
        counters(
            &mut encoder,
            "refusals",
            "Requests of the tenant refused by access control (its grant, its namespace), by reason; nothing of them reached the device.",
            &refusals,
        )?;
        counters(
            &mut encoder,
            "tenant_operations",
            "Device operations admitted for the tenant, by kind.",
            &operations,
        )?;
        counters(
            &mut encoder,
            "tenant_bytes",
            "Bytes of the tenant's admitted device operations, by kind.",
            &bytes,
        )?;
        counters(
            &mut encoder,
            "tenant_tokens",
            "Tokens the tenant spent, earned from its rate, claimed from the global bucket, and donated to it.",
            &tokens,
        )?;
        counters(
            &mut encoder,
            "tenant_deficit_seconds",
            "Time the tenant spent in deficit episodes, summed over threads.",
            &deficit_seconds,
        )?;
        counters(
            &mut encoder,
            "tenant_renegotiation_notices",
            "Deficit episodes of the tenant, each of which sent a RENEGOTIATE notice.",
            &notices,
        )?;
        counters(
            &mut encoder,
            "tenant_slo_windows",
            "Statistics windows in which a latency-critical tenant's read p95 met or missed its SLO.",
            &slo_windows,
        )?;
        gauges(
            &mut encoder,
            "tenant_queued_requests",
            "Requests of the tenant waiting in the schedulers.",
            &queued,
        )?;
        gauges(
            &mut encoder,
            "tenant_connections",
            "Connections charged to the tenant.",
            &connections,
        )?;
        gauges(
            &mut encoder,
            "tenant_slo_latency_seconds",
            "A latency-critical tenant's p95 read latency objective.",
            &slo,
        )?;
        gauges(
            &mut encoder,
            "tenant_reserved_iops",
            "A latency-critical tenant's reserved IOPS.",
            &reserved,
        )?;
        gauges(
            &mut encoder,
            "tenant_window_read_latency_p95_seconds",
            "The tenant's read p95 in the last statistics window.",
            &window_p95,
        )?;
        gauges(
            &mut encoder,
            "tenant_window_iops",
            "The tenant's device operations per second in the last statistics window, by kind.",
            &window_iops,
        )?;
        gauges(
            &mut encoder,
            "tenant_slo_attainment_ratio",
            "Share of judged windows in which the tenant's read p95 met its SLO.",
            &attainment,
        )?;
        family(
            &mut encoder,
            "tenant_read_latency_seconds",
            "Read latency of the tenant, from arrival off the socket to the answer leaving.",
            MetricType::Histogram,
            &latencies,
            |metric, histogram| encode_latency(metric, histogram),
        )?;

        // Per listener: connections refused at accept, summed over threads, and the admin
        // API's refused requests.
        let mut refused: std::collections::BTreeMap<(String, &'static str), u64> =
            std::collections::BTreeMap::new();
        for thread in &latest.threads {
            for listener in &thread.listeners {
                for reason in reflex_dataplane::AcceptRefused::ALL {
                    let count = listener.refused[reason.index()];
                    if count > 0 {
                        *refused
                            .entry((clean(&listener.name), reason.label()))
                            .or_insert(0) += count;
                    }
                }
            }
        }
        for reason in crate::admin::stats::AdminRefusal::ALL {
            let count = sampler.admin_refused.get(reason);
            if count > 0 {
                refused.insert(("admin".to_string(), reason.label()), count);
            }
        }
        let refused: Vec<(Labels, f64)> = refused
            .into_iter()
            .map(|((listener, reason), count)| {
                (
                    vec![("listener", listener), ("reason", reason.to_string())],
                    count as f64,
                )
            })
            .collect();
        counters(
            &mut encoder,
            "connections_refused",
            "Connections a listener refused at accept (allow-list, limits, shutdown), and requests the admin API refused, by reason.",
            &refused,
        )?;

        // Thread scaling.
        if let Some(scaling) = &sampler.scaling {
            gauges(
                &mut encoder,
                "threads_active",
                "Dataplane threads taking new connections (thread scaling).",
                &[(Vec::new(), f64::from(scaling.active()))],
            )?;
            counters(
                &mut encoder,
                "scaling_events",
                "Thread scaling's parks and wakes.",
                &[
                    (vec![("kind", "park".to_string())], scaling.parks() as f64),
                    (vec![("kind", "wake".to_string())], scaling.wakes() as f64),
                ],
            )?;
            counters(
                &mut encoder,
                "scaling_connections_moved",
                "Connections handed from one thread to another: by a parked thread (park), to a woken one (rebalance), or after a BIND to spread a tenant's connections over the threads (spread).",
                &[
                    (
                        vec![("cause", "park".to_string())],
                        scaling
                            .connections_moved()
                            .saturating_sub(scaling.connections_rebalanced())
                            .saturating_sub(scaling.connections_spread())
                            as f64,
                    ),
                    (
                        vec![("cause", "rebalance".to_string())],
                        scaling.connections_rebalanced() as f64,
                    ),
                    (
                        vec![("cause", "spread".to_string())],
                        scaling.connections_spread() as f64,
                    ),
                ],
            )?;
        }

        // Per thread.
        let mut busy = Vec::new();
        let mut idle = Vec::new();
        let mut iterations = Vec::new();
        let mut answered = Vec::new();
        let mut tls_sessions = Vec::new();
        let mut tls_failures = Vec::new();
        let mut thread_connections = Vec::new();
        let mut batches = Vec::new();
        for thread in &latest.threads {
            let labels: Labels = vec![("thread", thread.thread_index.to_string())];
            busy.push((labels.clone(), thread.busy_ns as f64 / 1e9));
            idle.push((labels.clone(), thread.idle_ns as f64 / 1e9));
            iterations.push((labels.clone(), thread.iterations as f64));
            answered.push((labels.clone(), thread.requests_answered as f64));
            tls_sessions.push((labels.clone(), thread.tls_sessions as f64));
            tls_failures.push((labels.clone(), thread.tls_failures as f64));
            thread_connections.push((labels.clone(), f64::from(thread.connections_open)));
            batches.push((labels, (thread.batch_sizes, thread.completions)));
        }
        counters(
            &mut encoder,
            "thread_busy_seconds",
            "Time the dataplane thread worked.",
            &busy,
        )?;
        counters(
            &mut encoder,
            "thread_idle_seconds",
            "Time the dataplane thread slept or found nothing to do.",
            &idle,
        )?;
        counters(
            &mut encoder,
            "thread_iterations",
            "Loop iterations of the dataplane thread.",
            &iterations,
        )?;
        counters(
            &mut encoder,
            "thread_requests_answered",
            "Requests the dataplane thread answered.",
            &answered,
        )?;
        counters(
            &mut encoder,
            "tls_sessions",
            "TLS sessions the dataplane thread started (native TLS port, NBD STARTTLS).",
            &tls_sessions,
        )?;
        counters(
            &mut encoder,
            "tls_failures",
            "TLS sessions refused or broken: bad certificates, cut handshakes, bad records.",
            &tls_failures,
        )?;
        gauges(
            &mut encoder,
            "thread_connections",
            "Open connections of the dataplane thread.",
            &thread_connections,
        )?;
        family(
            &mut encoder,
            "thread_batch_completions",
            "Completions handled per loop iteration (the adaptive batch).",
            MetricType::Histogram,
            &batches,
            |metric, (sizes, completions)| {
                let mut buckets = Vec::with_capacity(BATCH_BUCKETS);
                for (bucket, count) in sizes.iter().enumerate() {
                    let upper = if bucket + 1 < BATCH_BUCKETS {
                        (batch_bucket_floor(bucket + 1) - 1) as f64
                    } else {
                        f64::MAX
                    };
                    buckets.push((upper, *count));
                }
                metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    *completions as f64,
                    sizes.iter().sum(),
                    &buckets,
                    None,
                )
            },
        )?;

        // Per namespace and device.
        let mut depth = Vec::new();
        let mut device_operations = Vec::new();
        let mut device_seconds = Vec::new();
        let mut rates = Vec::new();
        let mut reserved_rates = Vec::new();
        let mut scales = Vec::new();
        let mut spare_shares = Vec::new();
        let mut client_shares = Vec::new();
        let mut server_busy = Vec::new();
        let calibrations = control.calibration();
        let mut spent = Vec::new();
        let mut namespace_latencies = Vec::new();
        for namespace_index in namespaces.live_indices() {
            let id = namespaces.id(namespace_index);
            let labels: Labels = vec![("namespace", id.to_string()), ("device", device_of(id))];
            if let Some(totals) = latest.namespaces.get(&id) {
                depth.push((labels.clone(), totals.device_in_flight as f64));
                device_operations.push((labels.clone(), totals.device_operations as f64));
                device_seconds.push((labels.clone(), totals.device_ns as f64 / 1e9));
                spent.push((labels.clone(), totals.ledger.spent.0.max(0) as f64 / 1000.0));
                namespace_latencies.push((labels.clone(), &totals.read_latency));
            }
            if let Some(plan) = control.plan(namespace_index) {
                rates.push((
                    labels.clone(),
                    plan.device_tokens_per_sec[0].as_tokens_per_sec_f64(),
                ));
                reserved_rates.push((
                    labels.clone(),
                    plan.lc_reserved_tokens_per_sec[0].as_tokens_per_sec_f64(),
                ));
                scales.push((labels.clone(), plan.rate_scale));
                spare_shares.push((labels.clone(), plan.spare_share));
            }
            let observed = calibrations
                .iter()
                .find(|(namespace_id, _)| *namespace_id == id)
                .and_then(|(_, info)| info.last);
            if let Some(observation) = observed {
                client_shares.push((labels.clone(), observation.client_share_us as f64 / 1e6));
                server_busy.push((labels, observation.server_busy));
            }
        }
        gauges(
            &mut encoder,
            "device_queue_depth",
            "Device operations outstanding on the namespace's device.",
            &depth,
        )?;
        counters(
            &mut encoder,
            "device_operations",
            "Device operations completed on the namespace's device.",
            &device_operations,
        )?;
        counters(
            &mut encoder,
            "device_busy_seconds",
            "Device time (submission to completion) of the namespace's operations, summed: divided by device_operations, the mean device latency.",
            &device_seconds,
        )?;
        counters(
            &mut encoder,
            "device_tokens_spent",
            "Tokens the schedulers charged on the namespace's device.",
            &spent,
        )?;
        gauges(
            &mut encoder,
            "device_tokens_per_second",
            "Token rate in use on the device (the profile's at the strictest SLO times the rate scale), under mixed load.",
            &rates,
        )?;
        gauges(
            &mut encoder,
            "device_lc_reserved_tokens_per_second",
            "Sum of the latency-critical reservations on the device, under mixed load.",
            &reserved_rates,
        )?;
        gauges(
            &mut encoder,
            "device_rate_scale",
            "The device rate's share of its profile's rate (online calibration).",
            &scales,
        )?;
        gauges(
            &mut encoder,
            "device_spare_share",
            "The share of what latency-critical tenants leave unused that best-effort tenants may spend (online calibration withholds the rest while LC tenants miss their target where their reservations just fit).",
            &spare_shares,
        )?;
        gauges(
            &mut encoder,
            "device_client_share_seconds",
            "Online calibration's last window: the part of the strictest LC SLO left to the network and clients (configured client_share_us plus the learned share: from LC clients' REPORTs where they come, else from the TCP round trips of LC connections).",
            &client_shares,
        )?;
        gauges(
            &mut encoder,
            "device_server_busy_ratio",
            "Online calibration's last window: the largest share of it a dataplane thread spent working or waiting for a CPU (at server_busy_max or above, no cut goes into LC reservations).",
            &server_busy,
        )?;
        family(
            &mut encoder,
            "namespace_read_latency_seconds",
            "Read latency on the namespace, every tenant, from arrival to the answer leaving.",
            MetricType::Histogram,
            &namespace_latencies,
            |metric, histogram| encode_latency(metric, histogram),
        )?;
        encode_fairness(&mut encoder, &sampler.fairness_view())
    }
}

/// The fairness stages (`GET /v1/fairness`), for namespaces where the stage is on: per thread
/// what it holds, its counters and its monitor's last window; per flow (tenant, bounded by the
/// tenants) the monitor's slowdown and density.
fn encode_fairness(
    encoder: &mut DescriptorEncoder,
    view: &crate::admin::stats::FairnessView,
) -> Result<(), std::fmt::Error> {
    let mut held = Vec::new();
    let mut in_flight = Vec::new();
    let mut held_total = Vec::new();
    let mut released = Vec::new();
    let mut backwarded = Vec::new();
    let mut windows = Vec::new();
    let mut fairness = Vec::new();
    let mut utilisation = Vec::new();
    let mut load_balance = Vec::new();
    let mut flow_held = Vec::new();
    let mut slowdown = Vec::new();
    let mut response = Vec::new();
    let mut response_alone = Vec::new();
    let mut intensity = Vec::new();
    let mut dense = Vec::new();
    let mut backwardings = Vec::new();
    let mut depth = Vec::new();
    for namespace in &view.namespaces {
        if namespace.mode == reflex_qos::FairMode::Off {
            continue;
        }
        let namespace_id = namespace.namespace_id.to_string();
        if let Some(balance) = namespace.load_balance {
            load_balance.push((vec![("namespace", namespace_id.clone())], balance));
        }
        for thread in &namespace.threads {
            let labels: Labels = vec![
                ("namespace", namespace_id.clone()),
                ("thread", thread.thread.to_string()),
            ];
            held.push((labels.clone(), f64::from(thread.held)));
            in_flight.push((labels.clone(), f64::from(thread.device_in_flight)));
            held_total.push((labels.clone(), thread.held_total as f64));
            released.push((labels.clone(), thread.released_total as f64));
            backwarded.push((labels.clone(), thread.backwarded_total as f64));
            windows.push((labels.clone(), thread.windows as f64));
            depth.push((labels.clone(), f64::from(thread.device_depth)));
            if let Some(f) = thread.fairness {
                fairness.push((labels.clone(), f));
            }
            if let Some(u) = thread.utilisation {
                utilisation.push((labels.clone(), u));
            }
            for flow in &thread.flows {
                let mut labels = labels.clone();
                labels.push(("tenant", clean(flow.tenant.as_deref().unwrap_or(""))));
                flow_held.push((labels.clone(), f64::from(flow.held)));
                let (Some(s), Some(rt), Some(alone), Some(rate), Some(density), Some(b)) = (
                    flow.slowdown,
                    flow.rt_us,
                    flow.rt_alone_us,
                    flow.intensity_per_sec,
                    flow.density,
                    flow.backwardings,
                ) else {
                    continue;
                };
                slowdown.push((labels.clone(), s));
                response.push((labels.clone(), rt / 1e6));
                response_alone.push((labels.clone(), alone / 1e6));
                intensity.push((labels.clone(), rate));
                dense.push((labels.clone(), if density == "dense" { 1.0 } else { 0.0 }));
                backwardings.push((labels, f64::from(b)));
            }
        }
    }
    gauges(
        encoder,
        "fairness_held_requests",
        "Best-effort requests the fairness stage holds in front of the device.",
        &held,
    )?;
    gauges(
        encoder,
        "fairness_device_in_flight",
        "Requests the fairness stage released that are at the device now.",
        &in_flight,
    )?;
    gauges(
        encoder,
        "fairness_device_depth",
        "Places at the device the fairness stage uses now (be_device_depth_max, or fewer when the adaptive depth took some away).",
        &depth,
    )?;
    counters(
        encoder,
        "fairness_held",
        "Requests that entered the fairness stage.",
        &held_total,
    )?;
    counters(
        encoder,
        "fairness_released",
        "Requests the fairness stage sent to the device.",
        &released,
    )?;
    counters(
        encoder,
        "fairness_backwarded",
        "Times a dense flow's head request was moved back behind a sparse flow's (backwarding).",
        &backwarded,
    )?;
    counters(
        encoder,
        "fairness_windows",
        "Windows the fairness monitor closed.",
        &windows,
    )?;
    gauges(
        encoder,
        "fairness_index",
        "F = min slowdown / max slowdown over the flows of the monitor's last window (1 is fair).",
        &fairness,
    )?;
    gauges(
        encoder,
        "fairness_device_utilisation_ratio",
        "Share of the monitor's last window the device had the stage's requests.",
        &utilisation,
    )?;
    gauges(
        encoder,
        "fairness_load_balance_ratio",
        "LB = min / max device utilisation over the namespace's threads (1 is balanced).",
        &load_balance,
    )?;
    gauges(
        encoder,
        "fairness_flow_held_requests",
        "Requests of the tenant held by the fairness stage.",
        &flow_held,
    )?;
    gauges(
        encoder,
        "fairness_flow_slowdown",
        "The tenant's slowdown RT / RT_alone in the monitor's last window.",
        &slowdown,
    )?;
    gauges(
        encoder,
        "fairness_flow_response_time_seconds",
        "The tenant's mean response time (network round trip plus server latency) in the monitor's last window.",
        &response,
    )?;
    gauges(
        encoder,
        "fairness_flow_alone_response_time_seconds",
        "The tenant's RT_alone in force (learned, calibrated, or the lowest RT seen).",
        &response_alone,
    )?;
    gauges(
        encoder,
        "fairness_flow_intensity_requests_per_second",
        "The tenant's completed requests per second in the monitor's last window.",
        &intensity,
    )?;
    gauges(
        encoder,
        "fairness_flow_dense",
        "1 when the monitor classed the tenant's flow dense in its last window, 0 sparse.",
        &dense,
    )?;
    gauges(
        encoder,
        "fairness_flow_backwardings",
        "B for a dense flow's head requests (0 for sparse flows or without unfairness).",
        &backwardings,
    )?;
    let mut migrated = Vec::new();
    for thread in &view.migration {
        for (outcome, count) in [
            ("sent", thread.sent),
            ("served", thread.served),
            ("refused", thread.refused),
        ] {
            migrated.push((
                vec![
                    ("thread", thread.thread.to_string()),
                    ("outcome", outcome.to_string()),
                ],
                count as f64,
            ));
        }
    }
    counters(
        encoder,
        "migration_reads",
        "Inter-core migration: reads the thread sent to another thread, reads of other threads it served, and those it answered with an error.",
        &migrated,
    )
}

#[cfg(test)]
mod text_format_tests {
    use super::prometheus_text;

    #[test]
    fn counters_are_described_by_their_total_series_and_eof_goes() {
        let open_metrics = "# HELP reflex_x Time.\n# TYPE reflex_x counter\n# UNIT reflex_x seconds\n\
            reflex_x_total{thread=\"0\"} 1.5\n# HELP reflex_g A gauge.\n# TYPE reflex_g gauge\n\
            reflex_g 2\n# EOF\n";
        assert_eq!(
            prometheus_text(open_metrics),
            "# HELP reflex_x_total Time.\n# TYPE reflex_x_total counter\n\
             reflex_x_total{thread=\"0\"} 1.5\n# HELP reflex_g A gauge.\n# TYPE reflex_g gauge\n\
             reflex_g 2\n"
        );
    }
}
