//! How long the control plane takes to register and connect many tenants (every change
//! recomputes the plan). Usage: `registry_scale TENANTS THREADS`.

use reflex_qos::{DeviceProfile, QosConfig, TenantRegistry, TenantSpec, TokenLimit};

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap_or(0))
        .collect();
    let (tenants, threads) = match args[..] {
        [t, h] => (t, h as u16),
        _ => (10_000, 4),
    };
    let profile = DeviceProfile {
        name: "scale".into(),
        write_cost: 10.0,
        read_only_read_cost: 0.5,
        token_limits: vec![TokenLimit {
            latency_us_p95: 500,
            tokens_per_sec: 4.2e9,
            reads_per_sec_read_only: 8.5e9,
        }],
    };
    let config = QosConfig {
        tenants_max: tenants.max(1),
        ..QosConfig::default()
    };
    let mut registry = TenantRegistry::new(profile, config, threads).expect("valid");
    let started = std::time::Instant::now();
    let mut updates = 0;
    for index in 0..tenants {
        let spec = if index % 10 == 9 {
            TenantSpec::BestEffort
        } else {
            TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: 100,
                read_percent: 90,
            }
        };
        let id = registry.register(spec).expect("fits");
        registry
            .connect(id, (index % u32::from(threads)) as u16)
            .expect("valid");
        updates += registry.take_updates().len();
    }
    println!(
        "{tenants} tenants on {threads} threads: {:.2} s, {updates} rate updates",
        started.elapsed().as_secs_f64()
    );
}
