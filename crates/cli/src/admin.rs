//! `reflex admin`: the command line over reflexd's admin API (`docs/admin-openapi.json`).
//!
//! Each subcommand is one or two HTTP requests; the answer is printed as a table (or as the
//! server's JSON with `--json`). A server that does not answer is reported as such, naming the
//! address and how to enable the API; a 4xx/5xx prints the server's message and exits non-zero.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use serde_json::{Map, Value, json};
use thiserror::Error;

/// Default address of the admin API (reflexd's `[admin] listen`).
pub const API_DEFAULT: &str = "http://127.0.0.1:7071";
/// Longest `--watch` run: bounded so a forgotten terminal does not poll forever.
pub const WATCH_REFRESHES_MAX: u64 = 1_000_000;

#[derive(ClapArgs)]
pub struct Args {
    /// Base URL of the admin API (reflexd's `[admin] listen`).
    #[arg(long, env = "REFLEX_ADMIN", default_value = API_DEFAULT, global = true)]
    api: String,
    /// Print the server's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 10, global = true)]
    timeout_secs: u64,
    /// A file holding the admin API's bearer token (reflexd's `[admin] token_file`): sent as
    /// `Authorization: Bearer <token>` with every request.
    #[arg(long, env = "REFLEX_ADMIN_TOKEN_FILE", global = true)]
    token_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The server: version, threads, namespaces, tenants, state file.
    Server,
    /// Tenants: list, show, add, set (change an SLO), rm.
    #[command(subcommand)]
    Tenants(TenantCommand),
    /// Namespaces: list, show, add, rm.
    #[command(subcommand)]
    Namespaces(NamespaceCommand),
    /// Live statistics per tenant, thread and namespace over the server's last window.
    Stats(StatsArgs),
    /// The fairness stage per namespace and thread: held requests, the monitor's last F,
    /// and each tenant's slowdown and density (`GET /v1/fairness`).
    Fairness,
}

#[derive(Clone, Copy, ValueEnum)]
enum Class {
    Lc,
    Be,
}

impl Class {
    fn name(self) -> &'static str {
        match self {
            Class::Lc => "lc",
            Class::Be => "be",
        }
    }
}

#[derive(ClapArgs)]
struct Slo {
    /// Tail read-latency bound (p95), µs.
    #[arg(long)]
    latency_us_p95: Option<u64>,
    /// Reserved IOPS.
    #[arg(long)]
    iops: Option<u64>,
    /// Share of reads in the reserved IOPS, 0..=100.
    #[arg(long)]
    read_percent: Option<u8>,
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Every tenant of every namespace.
    List,
    /// One tenant.
    Show {
        name: String,
        #[arg(short, long, default_value_t = 1)]
        namespace: u32,
    },
    /// Create a tenant: the server answers with its admission decision.
    Add {
        name: String,
        #[arg(short, long, default_value_t = 1)]
        namespace: u32,
        #[arg(long, value_enum)]
        class: Class,
        #[command(flatten)]
        slo: Slo,
        /// The tenant may only read.
        #[arg(long)]
        read_only: bool,
        /// RT_alone of its flows for the fairness monitors, µs (default: learned).
        #[arg(long)]
        rt_alone_us: Option<u32>,
    },
    /// Change a tenant's class or SLO (admission runs again), or its RT_alone (no admission).
    Set {
        name: String,
        #[arg(short, long, default_value_t = 1)]
        namespace: u32,
        #[arg(long, value_enum)]
        class: Option<Class>,
        #[command(flatten)]
        slo: Slo,
        /// RT_alone of its flows for the fairness monitors, µs.
        #[arg(long, conflicts_with = "rt_alone_learned")]
        rt_alone_us: Option<u32>,
        /// Learn RT_alone from the monitors' windows again (clears --rt-alone-us).
        #[arg(long)]
        rt_alone_learned: bool,
    },
    /// Delete a tenant: its connections get an error.
    Rm {
        name: String,
        #[arg(short, long, default_value_t = 1)]
        namespace: u32,
    },
}

#[derive(Subcommand)]
enum NamespaceCommand {
    /// Every namespace.
    List,
    /// One namespace.
    Show { namespace_id: u32 },
    /// Serve a new namespace from now on (kept in the server's state file across restarts).
    Add {
        namespace_id: u32,
        /// As a configuration's `backend`: `file:PATH` or a path, `mem:SIZE`, `null[:SIZE]`,
        /// `emu:NAME`, a block device. A relative path is reflexd's working directory's.
        backend: String,
        /// Size of a file to create (or of `mem`/`null` without one in the spec), e.g. 1G.
        #[arg(long, value_parser = crate::bench::units::parse_size)]
        size: Option<u64>,
        /// Writes, trims and write-zeroes are refused.
        #[arg(long)]
        read_only: bool,
        /// Its NBD export name (default nsID).
        #[arg(long)]
        name: Option<String>,
        /// Device profile (TOML): QoS on for the namespace. A relative path is taken from
        /// here and sent as an absolute one.
        #[arg(long)]
        profile: Option<std::path::PathBuf>,
    },
    /// Stop serving a namespace. Refused while tenants are bound to it or connections use
    /// it, unless --force (its tenants are unbound and its requests refused).
    Rm {
        namespace_id: u32,
        #[arg(long)]
        force: bool,
    },
}

#[derive(ClapArgs)]
struct StatsArgs {
    /// Refresh every SECONDS until interrupted (or `--count` refreshes).
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1")]
    watch: Option<f64>,
    /// With `--watch`: stop after this many refreshes.
    #[arg(long)]
    count: Option<u64>,
}

/// Why a request got no usable answer.
#[derive(Debug, Error)]
pub enum AdminClientError {
    #[error(
        "cannot reach reflexd's admin API at {api}: {reason}\n\
         (is reflexd running with the admin API enabled? See `[admin] listen` and \
         `--admin-listen`; `--api URL` or REFLEX_ADMIN picks another address)"
    )]
    Unreachable { api: String, reason: String },
    #[error("{method} {path}: {status}: {message}")]
    Refused {
        method: &'static str,
        path: String,
        status: u16,
        message: String,
    },
    #[error("{method} {path}: the answer is not JSON: {reason}")]
    NotJson {
        method: &'static str,
        path: String,
        reason: String,
    },
}

struct Client {
    base: String,
    agent: ureq::Agent,
    /// `Authorization` header value (`Bearer <token>`), when a token file was given.
    authorization: Option<String>,
}

impl Client {
    fn new(api: &str, timeout: Duration, token: Option<String>) -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .build()
            .into();
        let api = api.trim_end_matches('/');
        let base = if api.contains("://") {
            api.to_string()
        } else {
            format!("http://{api}")
        };
        Client {
            base,
            agent,
            authorization: token.map(|token| format!("Bearer {token}")),
        }
    }

    fn request(
        &self,
        method: &'static str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, AdminClientError> {
        let url = format!("{}{path}", self.base);
        let authorization = self.authorization.as_deref().unwrap_or("");
        let with_token = |request: ureq::RequestBuilder<ureq::typestate::WithBody>| {
            if authorization.is_empty() {
                request
            } else {
                request.header("authorization", authorization)
            }
        };
        let without_body = |request: ureq::RequestBuilder<ureq::typestate::WithoutBody>| {
            if authorization.is_empty() {
                request
            } else {
                request.header("authorization", authorization)
            }
        };
        let result = match (method, body) {
            ("POST", Some(body)) => with_token(self.agent.post(&url)).send_json(body),
            ("PATCH", Some(body)) => with_token(self.agent.patch(&url)).send_json(body),
            ("DELETE", _) => without_body(self.agent.delete(&url)).call(),
            _ => without_body(self.agent.get(&url)).call(),
        };
        let mut response = result.map_err(|error| AdminClientError::Unreachable {
            api: self.base.clone(),
            reason: error.to_string(),
        })?;
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().map_err(|error| {
            AdminClientError::Unreachable {
                api: self.base.clone(),
                reason: error.to_string(),
            }
        })?;
        let value: Value = if text.trim().is_empty() {
            Value::Null
        } else {
            match serde_json::from_str(&text) {
                Ok(value) => value,
                Err(error) if (200..300).contains(&status) => {
                    return Err(AdminClientError::NotJson {
                        method,
                        path: path.to_string(),
                        reason: error.to_string(),
                    });
                }
                Err(_) => Value::String(text.clone()),
            }
        };
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let message = value["error"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| text.trim().to_string());
        Err(AdminClientError::Refused {
            method,
            path: path.to_string(),
            status,
            message,
        })
    }
}

pub fn run(args: Args) -> Result<()> {
    let token = match &args.token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("token file {}", path.display()))?;
            Some(text.trim().to_string())
        }
        None => None,
    };
    let client = Client::new(
        &args.api,
        Duration::from_secs(args.timeout_secs.max(1)),
        token,
    );
    let json = args.json;
    match args.command {
        Command::Server => {
            let server = client.request("GET", "/v1/server", None)?;
            print_value(json, &server, render_object)
        }
        Command::Tenants(command) => tenants(&client, json, command),
        Command::Namespaces(command) => namespaces(&client, json, command),
        Command::Stats(stats_args) => stats(&client, json, &stats_args),
        Command::Fairness => {
            let fairness = client.request("GET", "/v1/fairness", None)?;
            print_value(json, &fairness, render_fairness)
        }
    }
}

fn print_value(json: bool, value: &Value, table: fn(&Value) -> String) -> Result<()> {
    let text = if json {
        serde_json::to_string_pretty(value)? + "\n"
    } else {
        table(value)
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

fn slo_body(body: &mut Map<String, Value>, slo: &Slo) {
    if let Some(latency) = slo.latency_us_p95 {
        body.insert("latency_us_p95".into(), json!(latency));
    }
    if let Some(iops) = slo.iops {
        body.insert("iops".into(), json!(iops));
    }
    if let Some(read_percent) = slo.read_percent {
        body.insert("read_percent".into(), json!(read_percent));
    }
}

fn tenant_path(namespace: u32, name: &str) -> String {
    format!(
        "/v1/namespaces/{namespace}/tenants/{}",
        encode_segment(name)
    )
}

/// Percent-encodes a path segment (names may hold any UTF-8 but `/`-free is not promised).
fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

fn tenants(client: &Client, json: bool, command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::List => {
            let list = client.request("GET", "/v1/tenants", None)?;
            print_value(json, &list, render_tenants)
        }
        TenantCommand::Show { name, namespace } => {
            let tenant = client.request("GET", &tenant_path(namespace, &name), None)?;
            print_value(json, &tenant, |value| render_tenants(&json!([value])))
        }
        TenantCommand::Add {
            name,
            namespace,
            class,
            slo,
            read_only,
            rt_alone_us,
        } => {
            let mut body = Map::new();
            body.insert("name".into(), json!(name));
            body.insert("class".into(), json!(class.name()));
            slo_body(&mut body, &slo);
            if read_only {
                body.insert("read_only".into(), json!(true));
            }
            if let Some(rt_alone_us) = rt_alone_us {
                body.insert("rt_alone_us".into(), json!(rt_alone_us));
            }
            let path = format!("/v1/namespaces/{namespace}/tenants");
            let changed = client.request("POST", &path, Some(&Value::Object(body)))?;
            print_value(json, &changed, render_changed)
        }
        TenantCommand::Set {
            name,
            namespace,
            class,
            slo,
            rt_alone_us,
            rt_alone_learned,
        } => {
            let mut body = Map::new();
            if let Some(class) = class {
                body.insert("class".into(), json!(class.name()));
            }
            slo_body(&mut body, &slo);
            if let Some(rt_alone_us) = rt_alone_us {
                body.insert("rt_alone_us".into(), json!(rt_alone_us));
            } else if rt_alone_learned {
                body.insert("rt_alone_us".into(), Value::Null);
            }
            if body.is_empty() {
                bail!(
                    "nothing to change: give --class, --latency-us-p95, --iops, --read-percent, --rt-alone-us or --rt-alone-learned"
                );
            }
            let changed = client.request(
                "PATCH",
                &tenant_path(namespace, &name),
                Some(&Value::Object(body)),
            )?;
            print_value(json, &changed, render_changed)
        }
        TenantCommand::Rm { name, namespace } => {
            let answer = client.request("DELETE", &tenant_path(namespace, &name), None)?;
            if json {
                print_value(json, &answer, render_object)
            } else {
                println!("removed tenant {name} of namespace {namespace}");
                Ok(())
            }
        }
    }
}

fn namespaces(client: &Client, json: bool, command: NamespaceCommand) -> Result<()> {
    match command {
        NamespaceCommand::List => {
            let list = client.request("GET", "/v1/namespaces", None)?;
            print_value(json, &list, render_namespaces)
        }
        NamespaceCommand::Show { namespace_id } => {
            let namespace =
                client.request("GET", &format!("/v1/namespaces/{namespace_id}"), None)?;
            print_value(json, &namespace, |value| render_namespaces(&json!([value])))
        }
        NamespaceCommand::Add {
            namespace_id,
            backend,
            size,
            read_only,
            name,
            profile,
        } => {
            let mut body = Map::new();
            body.insert("namespace_id".into(), json!(namespace_id));
            body.insert("backend".into(), json!(backend));
            if let Some(size) = size {
                body.insert("size_bytes".into(), json!(size));
            }
            if read_only {
                body.insert("read_only".into(), json!(true));
            }
            if let Some(name) = name {
                body.insert("nbd_export".into(), json!(name));
            }
            if let Some(profile) = profile {
                let absolute = std::path::absolute(&profile)
                    .with_context(|| format!("profile {}", profile.display()))?;
                body.insert("profile".into(), json!(absolute.display().to_string()));
            }
            let namespace = client.request("POST", "/v1/namespaces", Some(&Value::Object(body)))?;
            print_value(json, &namespace, |value| render_namespaces(&json!([value])))
        }
        NamespaceCommand::Rm {
            namespace_id,
            force,
        } => {
            let path = if force {
                format!("/v1/namespaces/{namespace_id}?force=true")
            } else {
                format!("/v1/namespaces/{namespace_id}")
            };
            let answer = client.request("DELETE", &path, None)?;
            if json {
                print_value(json, &answer, render_object)
            } else {
                println!("removed namespace {namespace_id}");
                Ok(())
            }
        }
    }
}

fn stats(client: &Client, json: bool, args: &StatsArgs) -> Result<()> {
    let Some(period_secs) = args.watch else {
        let stats = client.request("GET", "/v1/stats", None)?;
        return print_value(json, &stats, render_stats);
    };
    if !(period_secs.is_finite() && period_secs >= 0.05) {
        bail!("--watch {period_secs}: the period must be at least 0.05 s");
    }
    let refreshes = args.count.unwrap_or(WATCH_REFRESHES_MAX);
    let clear = !json && std::io::stdout().is_terminal();
    for refresh in 0..refreshes {
        if refresh > 0 {
            std::thread::sleep(Duration::from_secs_f64(period_secs));
        }
        let stats = client.request("GET", "/v1/stats", None)?;
        if clear {
            // Home the cursor and clear the screen: the table refreshes in place.
            print!("\x1b[H\x1b[2J");
        }
        if json {
            println!("{}", serde_json::to_string(&stats)?);
        } else {
            print_value(false, &stats, render_stats)?;
            if !clear {
                println!();
            }
        }
    }
    Ok(())
}

// ----- Tables -------------------------------------------------------------------------------

/// A plain text table: a header row, then rows, each column as wide as its widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|cell| cell.chars().count()).collect();
    for row in rows {
        for (index, cell) in row.iter().enumerate() {
            if let Some(width) = widths.get_mut(index) {
                *width = (*width).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (index, cell) in cells.enumerate() {
            let width = widths.get(index).copied().unwrap_or(0);
            let _ = write!(text, "{cell:<width$}  ");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

fn cell(value: &Value) -> String {
    match value {
        Value::Null => "-".to_string(),
        Value::String(text) => text.clone(),
        Value::Bool(flag) => if *flag { "yes" } else { "no" }.to_string(),
        Value::Number(number) => match (number.as_u64(), number.as_i64(), number.as_f64()) {
            (Some(unsigned), _, _) => unsigned.to_string(),
            (None, Some(signed), _) => signed.to_string(),
            (None, None, Some(float)) => format_float(float),
            _ => number.to_string(),
        },
        other => other.to_string(),
    }
}

fn format_float(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.3}")
    }
}

fn percent(value: &Value) -> String {
    value
        .as_f64()
        .map(|share| format!("{:.1}%", share * 100.0))
        .unwrap_or_else(|| "-".to_string())
}

fn render_object(value: &Value) -> String {
    let Some(object) = value.as_object() else {
        return format!("{}\n", cell(value));
    };
    let rows: Vec<Vec<String>> = object
        .iter()
        .map(|(key, value)| vec![key.clone(), cell(value)])
        .collect();
    table(&["field", "value"], &rows)
}

fn render_tenants(value: &Value) -> String {
    let rows: Vec<Vec<String>> = value
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|tenant| {
            vec![
                cell(&tenant["namespace_id"]),
                cell(&tenant["name"]),
                cell(&tenant["class"]),
                cell(&tenant["latency_us_p95"]),
                cell(&tenant["iops"]),
                cell(&tenant["read_percent"]),
                cell(&tenant["read_only"]),
                cell(&tenant["origin"]),
                cell(&tenant["connections"]),
                cell(&tenant["handle"]),
                cell(&tenant["rt_alone_us"]),
            ]
        })
        .collect();
    table(
        &[
            "ns",
            "tenant",
            "class",
            "p95_us",
            "iops",
            "read_%",
            "read_only",
            "origin",
            "conns",
            "handle",
            "alone_us",
        ],
        &rows,
    )
}

fn render_changed(value: &Value) -> String {
    let mut out = String::new();
    let admitted = value["admission"]["admitted"].as_bool().unwrap_or(false);
    let _ = writeln!(
        out,
        "{}: {}",
        if admitted { "admitted" } else { "refused" },
        value["admission"]["reason"].as_str().unwrap_or("")
    );
    out.push_str(&render_tenants(&json!([value["tenant"]])));
    if let Some(plan) = value["plan"].as_object() {
        let _ = writeln!(
            out,
            "plan: device {} tokens/s, LC reserved {}, left {}, BE each {}, {} LC tenant(s)",
            cell(&plan["device_tokens_per_sec"]),
            cell(&plan["lc_reserved_tokens_per_sec"]),
            cell(&plan["left_tokens_per_sec"]),
            cell(&plan["be_tokens_per_sec_each"]),
            cell(&plan["lc_tenants"]),
        );
    }
    out
}

fn render_namespaces(value: &Value) -> String {
    let rows: Vec<Vec<String>> = value
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|namespace| {
            let tenants = namespace["tenants"]
                .as_array()
                .map(|names| names.iter().map(cell).collect::<Vec<String>>().join(","))
                .unwrap_or_default();
            vec![
                cell(&namespace["namespace_id"]),
                cell(&namespace["nbd_export"]),
                cell(&namespace["size_bytes"]),
                cell(&namespace["read_only"]),
                cell(&namespace["device"]),
                cell(&namespace["qos"]),
                tenants,
            ]
        })
        .collect();
    table(
        &[
            "ns",
            "nbd_export",
            "size_bytes",
            "read_only",
            "device",
            "qos",
            "tenants",
        ],
        &rows,
    )
}

/// One line per namespace and thread (the stage and its monitor's last window), then one
/// per tenant the stage has seen (its figures in that window).
fn render_fairness(value: &Value) -> String {
    let empty = Vec::new();
    let mut threads = Vec::new();
    let mut flows = Vec::new();
    for namespace in value["namespaces"].as_array().unwrap_or(&empty) {
        for thread in namespace["threads"].as_array().unwrap_or(&empty) {
            threads.push(vec![
                cell(&namespace["namespace_id"]),
                cell(&namespace["mode"]),
                cell(&thread["thread"]),
                cell(&thread["held"]),
                cell(&thread["device_in_flight"]),
                cell(&thread["released_total"]),
                cell(&thread["fairness"]),
                percent(&thread["utilisation"]),
                cell(&thread["policy"]),
            ]);
            for flow in thread["flows"].as_array().unwrap_or(&empty) {
                flows.push(vec![
                    cell(&namespace["namespace_id"]),
                    cell(&thread["thread"]),
                    cell(&flow["tenant"]),
                    cell(&flow["held"]),
                    cell(&flow["device_in_flight"]),
                    cell(&flow["intensity_per_sec"]),
                    cell(&flow["rt_us"]),
                    cell(&flow["rt_alone_us"]),
                    cell(&flow["slowdown"]),
                    cell(&flow["density"]),
                    cell(&flow["backwardings"]),
                ]);
            }
        }
    }
    let mut out = table(
        &[
            "ns",
            "mode",
            "thread",
            "held",
            "at_device",
            "released",
            "F",
            "busy",
            "policy",
        ],
        &threads,
    );
    if !flows.is_empty() {
        out.push('\n');
        out.push_str(&table(
            &[
                "ns",
                "thread",
                "tenant",
                "held",
                "at_device",
                "per_sec",
                "rt_us",
                "alone_us",
                "slowdown",
                "density",
                "B",
            ],
            &flows,
        ));
    }
    // Inter-core migration, per thread, once any thread has handed a read over.
    let migration = value["migration"].as_array().unwrap_or(&empty);
    let migrated = |thread: &Value| ["sent", "served", "refused"].iter().any(|k| thread[k] != 0);
    if migration.iter().any(migrated) {
        let rows: Vec<Vec<String>> = migration
            .iter()
            .map(|thread| {
                vec![
                    cell(&thread["thread"]),
                    cell(&thread["sent"]),
                    cell(&thread["served"]),
                    cell(&thread["refused"]),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&table(
            &[
                "thread",
                "migrated_sent",
                "migrated_served",
                "migrated_refused",
            ],
            &rows,
        ));
    }
    out
}

fn render_stats(value: &Value) -> String {
    let empty = Vec::new();
    let list = |key: &str| value[key].as_array().unwrap_or(&empty).clone();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "window {} s, {} windows closed",
        cell(&value["window_seconds"]),
        cell(&value["windows"])
    );
    let tenants: Vec<Vec<String>> = list("tenants")
        .iter()
        .map(|tenant| {
            let window = &tenant["window"];
            vec![
                cell(&tenant["namespace_id"]),
                cell(&tenant["name"]),
                cell(&tenant["class"]),
                cell(&tenant["slo_latency_us_p95"]),
                cell(&window["read_iops"]),
                cell(&window["write_iops"]),
                cell(&window["read_latency_us"]["p50"]),
                cell(&window["read_latency_us"]["p95"]),
                cell(&window["read_latency_us"]["p99"]),
                cell(&window["tokens_spent_per_sec"]),
                cell(&window["tokens_donated_per_sec"]),
                percent(&window["deficit_share"]),
                percent(&tenant["slo"]["attainment"]),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(
        &[
            "ns",
            "tenant",
            "class",
            "slo_p95_us",
            "read_iops",
            "write_iops",
            "p50_us",
            "p95_us",
            "p99_us",
            "tokens/s",
            "donated/s",
            "deficit",
            "slo_met",
        ],
        &tenants,
    ));
    let threads: Vec<Vec<String>> = list("threads")
        .iter()
        .map(|thread| {
            vec![
                cell(&thread["thread"]),
                percent(&thread["busy_share"]),
                cell(&thread["batch_mean"]),
                cell(&thread["connections"]),
                cell(&thread["requests_per_sec"]),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(
        &["thread", "busy", "batch_mean", "conns", "requests/s"],
        &threads,
    ));
    let namespaces: Vec<Vec<String>> = list("namespaces")
        .iter()
        .map(|namespace| {
            vec![
                cell(&namespace["namespace_id"]),
                cell(&namespace["device"]),
                cell(&namespace["device_queue_depth"]),
                cell(&namespace["device_operations_per_sec"]),
                cell(&namespace["device_latency_us_mean"]),
                cell(&namespace["read_latency_us"]["p95"]),
                cell(&namespace["device_tokens_per_sec"]),
                cell(&namespace["tokens_spent_per_sec"]),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(
        &[
            "ns",
            "device",
            "queue_depth",
            "ops/s",
            "latency_us",
            "read_p95_us",
            "token_rate",
            "tokens_in_use/s",
        ],
        &namespaces,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_and_show_missing_values_as_dashes() {
        let text = render_tenants(&json!([
            {"namespace_id": 1, "name": "gold", "class": "lc", "latency_us_p95": 500,
             "iops": 10000, "read_percent": 100, "read_only": false, "origin": "config",
             "connections": 0, "handle": "0x1"},
            {"namespace_id": 1, "name": "b", "class": "be", "latency_us_p95": null}
        ]));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("ns  tenant  class  p95_us"));
        assert!(lines[1].contains("gold    lc     500"));
        assert!(lines[2].contains("b       be     -"));
    }

    #[test]
    fn the_fairness_table_has_a_line_per_thread_and_per_flow() {
        let text = render_fairness(&json!({"namespaces": [{
            "namespace_id": 1, "mode": "fair_share",
            "threads": [{"thread": 0, "held": 3, "device_in_flight": 8, "released_total": 90,
                         "fairness": 0.5, "utilisation": 0.9, "policy": "intra",
                         "flows": [{"tenant": "dense", "held": 3, "device_in_flight": 4,
                                    "intensity_per_sec": 2000.0, "rt_us": 300.0,
                                    "rt_alone_us": 150.0, "slowdown": 2.0,
                                    "density": "dense", "backwardings": 0},
                                   {"tenant": null, "held": 0, "device_in_flight": 0}]}]
        }]}));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        assert!(lines[1].starts_with("1   fair_share  0"), "{text}");
        assert!(
            lines[1].contains("0.500") && lines[1].contains("90.0%"),
            "{text}"
        );
        assert!(
            lines[4].contains("dense") && lines[4].contains("2.0"),
            "{text}"
        );
        assert!(lines[5].contains("-"), "{text}");
    }

    #[test]
    fn migration_counters_get_a_table_once_a_read_moved() {
        let idle = json!({"namespaces": [], "migration": [
            {"thread": 0, "sent": 0, "served": 0, "refused": 0}]});
        assert!(!render_fairness(&idle).contains("migrated_sent"));
        let moved = render_fairness(&json!({"namespaces": [], "migration": [
            {"thread": 0, "sent": 0, "served": 12, "refused": 0},
            {"thread": 1, "sent": 12, "served": 0, "refused": 1}]}));
        let lines: Vec<&str> = moved.lines().collect();
        let header = lines
            .iter()
            .position(|line| line.starts_with("thread  migrated_sent"))
            .unwrap_or_else(|| panic!("{moved}"));
        assert!(lines[header + 1].starts_with("0       0"), "{moved}");
        assert!(
            lines[header + 2].contains("12") && lines[header + 2].ends_with('1'),
            "{moved}"
        );
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
        assert_eq!(encode_segment("gold-1.x"), "gold-1.x");
    }
}
