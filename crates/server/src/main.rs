//! `reflexd`: the ReFlex server binary. Parses flags over an optional TOML file, starts the
//! server, turns SIGINT/SIGTERM into a graceful shutdown (drain, flush, exit 0) and SIGHUP
//! into a reload of the configured namespaces, tenant bindings and SLOs. See `docs/OPERATIONS.md`.

use std::io::IsTerminal;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use reflex_server::{
    Config, DriverChoice, NamespaceConfig, OriginalPortConfig, Server, TenantConfig,
};

/// ReFlex server: remote NVMe Flash over TCP.
// The doc comments are clap's help, in command-line syntax: `[,ro]` is an optional part, not
// a link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(Debug, Parser)]
#[command(name = "reflexd", version, about)]
struct Args {
    /// TOML configuration file (see reflexd.example.toml); flags override it.
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1; use 0.0.0.0 to serve the network).
    #[arg(long)]
    listen: Option<IpAddr>,
    /// Native protocol port (default 7070; 0 picks a free port).
    #[arg(long)]
    port: Option<u16>,
    /// A namespace: ID=BACKEND[,size=SIZE][,ro][,name=NAME][,tenant=TENANT][,profile=PATH],
    /// e.g. 1=file:/data/ns1,size=10G or 2=mem:1G,name=scratch. NAME is its NBD export name
    /// (default nsID); TENANT is the tenant its NBD clients are charged to; PATH is the QoS
    /// device profile (without one the namespace is served FIFO). Repeatable; replaces the
    /// config file's namespaces. Default: 1=file:./reflex-data/ns1,size=1G.
    #[arg(long = "namespace", short = 'n')]
    namespaces: Vec<String>,
    /// A tenant: NAME=be or NAME=lc,latency_us=US,iops=N[,read_percent=P]. Bound to
    /// namespaces and original ports by name; admitted at startup. Repeatable; replaces the
    /// config file's tenants.
    #[arg(long = "tenant")]
    tenants: Vec<String>,
    /// QoS off: namespaces with a profile are served first in, first out (tenants,
    /// admission and accounting stay), for comparison.
    #[arg(long)]
    no_qos: bool,
    /// Original ReFlex protocol port: PORT[=NAMESPACE][,tenant=NAME] (namespace 1 if
    /// omitted). Repeatable; replaces the config file's list. Default: 1234=1.
    #[arg(long = "original-port")]
    original_ports: Vec<String>,
    /// Do not open any original-protocol port.
    #[arg(long, conflicts_with = "original_ports")]
    no_original: bool,
    /// NBD port (default 10809; 0 picks a free port).
    #[arg(long)]
    nbd_port: Option<u16>,
    /// Do not listen for NBD.
    #[arg(long, conflicts_with = "nbd_port")]
    no_nbd: bool,
    /// NVMe/TCP port (default 4420; 0 picks a free one).
    #[arg(long)]
    nvme_tcp_port: Option<u16>,
    /// Do not listen for NVMe/TCP.
    #[arg(long, conflicts_with = "nvme_tcp_port")]
    no_nvme_tcp: bool,
    /// Serve the key-value table on this port (0 picks a free one); `[kv]` in the config
    /// file has the other settings.
    #[arg(long)]
    kv_port: Option<u16>,
    /// The namespace id holding the key-value table (with --kv-port; default 1).
    #[arg(long, requires = "kv_port")]
    kv_namespace: Option<u32>,
    /// Format a fresh, empty key-value table at start-up (what it held is lost).
    #[arg(long, requires = "kv_port")]
    kv_format: bool,
    /// Dataplane threads (default 1).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Pin dataplane thread i to the i-th CPU of this list, e.g. `2,3`: one dedicated core per
    /// thread, the rest of the process (admin API, control plane) left to the other CPUs.
    #[arg(long, value_delimiter = ',')]
    dataplane_cpus: Option<Vec<usize>>,
    /// Thread scaling: park and wake dataplane threads with the load (`[scaling]` in the
    /// configuration file gives the thresholds).
    #[arg(long)]
    scaling: bool,
    /// Spin instead of sleeping when idle (lowest latency; each thread uses a full core).
    #[arg(long)]
    poll: bool,
    /// I/O driver: auto (io_uring when available, else epoll), uring, or epoll.
    #[arg(long)]
    driver: Option<DriverChoice>,
    /// Outstanding requests per connection (default 128).
    #[arg(long)]
    window: Option<u32>,
    /// Buffer arena per thread, e.g. 32M (a multiple of 1M).
    #[arg(long)]
    arena_size: Option<String>,
    /// Admin API address (default 127.0.0.1:7071; port 0 picks a free one).
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
    /// Do not serve the admin API (and keep no state file).
    #[arg(long, conflicts_with = "admin_listen")]
    no_admin: bool,
    /// Where tenants created through the admin API persist (default ./reflex-data/state.json).
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Check the configuration (file and flags, profiles included) and exit: 0 when valid.
    #[arg(long)]
    check_config: bool,
    /// Log format on standard error: text (default) or json (one object per line).
    #[arg(long, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
    };
    match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_target(false)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter())
            .with_target(false)
            .with_writer(std::io::stderr)
            .init(),
    }
    let config_path = args.config.clone();
    let check_only = args.check_config;
    let config = build_config(args)?;
    if check_only {
        reflex_server::check_config(&config).context("checking the configuration")?;
        println!("configuration OK");
        return Ok(());
    }

    // Register the signal handlers before any thread starts, so every thread inherits them.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .context("installing signal handlers")?;
    let server = Server::start(config).context("starting reflexd")?;
    'serving: loop {
        for signal in signals.pending() {
            if signal == signal_hook::consts::SIGHUP {
                reload(&server, config_path.as_deref());
                continue;
            }
            tracing::info!(
                signal,
                "shutting down: draining connections and flushing devices"
            );
            break 'serving;
        }
        if server.any_thread_finished() {
            tracing::error!("a dataplane thread stopped unexpectedly; shutting down");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = server.shutdown().context("shutting down")?;
    let answered: u64 = stats.iter().map(|s| s.requests_answered).sum();
    let notices: u64 = stats.iter().map(|s| s.notices_sent).sum();
    let queue_full_waits: u64 = stats.iter().map(|s| s.tenant_queue_full_waits).sum();
    let sends: u64 = stats.iter().map(|s| s.sends).sum();
    let reads_lent: u64 = stats.iter().map(|s| s.reads_lent).sum();
    tracing::info!(
        requests_answered = answered,
        sends,
        reads_lent,
        renegotiate_notices = notices,
        tenant_queue_full_waits = queue_full_waits,
        "reflexd stopped"
    );
    Ok(())
}

/// SIGHUP: reads the configuration file again and applies what can change without a restart
/// (new namespaces, tenant bindings and SLOs); connections stay. What needs a restart is
/// logged.
fn reload(server: &reflex_server::ServerHandle, path: Option<&std::path::Path>) {
    let Some(path) = path else {
        tracing::info!("SIGHUP: no configuration file to reload (started without --config)");
        return;
    };
    let config = match Config::from_file(path).and_then(|config| {
        config.validate()?;
        Ok(config)
    }) {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(%error, "SIGHUP: the configuration file is not valid; nothing changed");
            return;
        }
    };
    match server.reload_tls(&config) {
        Ok(true) => {
            tracing::info!(
                "SIGHUP: TLS certificates reloaded, and pre-shared keys (new sessions use them)"
            )
        }
        Ok(false) => {}
        Err(error) => {
            tracing::error!(%error, "SIGHUP: TLS not reloaded; sessions keep the old keys")
        }
    }
    let report = server.reload_tenants(&config);
    tracing::info!(
        changed = report.changed,
        unchanged = report.unchanged,
        refused = report.refused,
        bound = report.bound,
        unbound = report.unbound,
        namespaces_added = report.namespaces_added,
        exports_rebound = report.exports_rebound,
        grants_changed = report.grants_changed,
        rt_alone_changed = report.rt_alone_changed,
        needs_restart = report.needs_restart,
        "SIGHUP: configured namespaces and tenants reloaded"
    );
}

fn build_config(args: Args) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(port) = args.port {
        config.port = port;
    }
    if !args.namespaces.is_empty() {
        config.namespaces = args
            .namespaces
            .iter()
            .map(|text| NamespaceConfig::from_flag(text))
            .collect::<Result<_, _>>()?;
    }
    if !args.tenants.is_empty() {
        config.tenants = args
            .tenants
            .iter()
            .map(|text| TenantConfig::from_flag(text))
            .collect::<Result<_, _>>()?;
    }
    if args.no_qos {
        config.qos = false;
    }
    if args.no_original {
        config.original_ports = Some(Vec::new());
    } else if !args.original_ports.is_empty() {
        config.original_ports = Some(
            args.original_ports
                .iter()
                .map(|text| OriginalPortConfig::from_flag(text))
                .collect::<Result<_, _>>()?,
        );
    }
    if args.no_nvme_tcp {
        config.nvme_tcp.enabled = false;
    } else if let Some(port) = args.nvme_tcp_port {
        config.nvme_tcp.enabled = true;
        config.nvme_tcp.port = port;
    }
    if args.no_nbd {
        config.nbd.enabled = false;
    } else if let Some(port) = args.nbd_port {
        config.nbd.enabled = true;
        config.nbd.port = port;
    }
    if let Some(port) = args.kv_port {
        config.kv.enabled = true;
        config.kv.port = port;
    }
    if let Some(namespace) = args.kv_namespace {
        config.kv.namespace = namespace;
    }
    if args.kv_format {
        config.kv.format = true;
    }
    if let Some(threads) = args.threads {
        config.threads = threads;
    }
    if let Some(cpus) = args.dataplane_cpus {
        config.dataplane_cpus = cpus;
    }
    if args.poll {
        config.poll = true;
    }
    if args.scaling {
        config.scaling.enabled = true;
    }
    if let Some(driver) = args.driver {
        config.driver = driver;
    }
    if let Some(window) = args.window {
        config.window = window;
    }
    if let Some(size) = &args.arena_size {
        config.arena_bytes_per_thread =
            reflex_flash::spec::parse_size(size).context("--arena-size")?;
    }
    if args.no_admin {
        config.admin.enabled = false;
    } else if let Some(addr) = args.admin_listen {
        config.admin.enabled = true;
        config.admin.listen = addr;
    }
    if let Some(path) = &args.state_file {
        config.admin.state_file = Some(path.display().to_string());
    }
    config.validate()?;
    Ok(config)
}
