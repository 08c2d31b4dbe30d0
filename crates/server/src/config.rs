//! `reflexd` configuration: namespaces (and the NBD exports, tenant bindings and QoS device
//! profiles they carry), tenants declared with their SLOs, listening ports, threads and
//! limits, from a TOML file (`--config`) and command-line flags, with defaults that let a bare
//! `reflexd` serve at once.
//!
//! Precedence: built-in defaults, then the file, then flags. `--namespace` flags, when given,
//! replace the file's namespaces (so one flag is enough to point a configured server at
//! another backend). Every limit has a named default and a checked range ([`Config::validate`]);
//! see `docs/OPERATIONS.md` and `reflexd.example.toml` for the operator's view.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use reflex_dataplane::access::{ByteRange, Grant};
use reflex_dataplane::composite::CompositeSpec;
use reflex_flash::spec::parse_size;
use reflex_qos::{QosConfig, TenantSpec};
use serde::Deserialize;

/// Native protocol port when none is configured.
pub const NATIVE_PORT_DEFAULT: u16 = 7070;
/// Original ReFlex protocol port when none is configured (serves namespace 1).
pub const ORIGINAL_PORT_DEFAULT: u16 = 1234;
/// NBD port when none is configured (the port IANA assigned to NBD).
pub const NBD_PORT_DEFAULT: u16 = 10809;
/// NVMe/TCP port when none is configured (the port IANA assigned to NVMe over TCP).
pub const NVME_TCP_PORT_DEFAULT: u16 = 4420;
/// The NQN of the NVMe/TCP subsystem serving every namespace when none is configured.
pub const NVME_TCP_DEFAULT_NQN: &str = "nqn.2026-01.io.reflex:default";
/// Longest NQN (the NVMe specification's limit).
pub const NQN_BYTES_MAX: usize = 223;
/// Longest NBD export name reflexd accepts in its configuration: the spec's recommended
/// limit (it allows 4096), which also keeps a LIST reply of every export small.
pub const EXPORT_NAME_BYTES_MAX: usize = 256;
/// Longest tenant name in a namespace's binding.
pub const TENANT_NAME_BYTES_MAX: usize = 256;
/// Tenants one configuration may declare.
pub const TENANTS_CONFIGURED_MAX: usize = 1024;
/// The largest RT_alone a tenant may be given (µs): one minute, like a latency SLO.
pub const RT_ALONE_US_MAX: u32 = 60_000_000;
/// Requests a connection may have outstanding (advertised in HELLO).
pub const WINDOW_DEFAULT: u32 = 128;
pub const WINDOW_MAX: u32 = 4096;
pub const THREADS_MAX: usize = 64;
/// Buffer arena per dataplane thread: enough for 32 concurrent 1 MiB requests or 8192 4 KiB.
pub const ARENA_BYTES_PER_THREAD_DEFAULT: u64 = 32 << 20;
pub const ARENA_BYTES_PER_THREAD_MAX: u64 = 1 << 30;
pub const CONNECTIONS_PER_THREAD_DEFAULT: u32 = 1024;
pub const CONNECTIONS_PER_THREAD_MAX: u32 = 65_536;
/// Request slots per thread: 32 connections at the default window, all full.
pub const REQUESTS_PER_THREAD_DEFAULT: u32 = 4096;
pub const REQUESTS_PER_THREAD_MAX: u32 = 1 << 20;
/// Receive buffer of each connection: request headers and small WRITE payloads (a WRITE of
/// up to half of it is gathered whole before it is parsed).
pub const RECV_BUFFER_BYTES_DEFAULT: u64 = 64 << 10;
pub const RECV_BUFFER_BYTES_MIN: u64 = 16 << 10;
pub const RECV_BUFFER_BYTES_MAX: u64 = 1 << 20;
/// Share of a thread's arena one connection may hold by default, in percent.
pub const CONNECTION_ARENA_PERCENT_DEFAULT: u8 = 25;
/// Connections of a thread kept for each other listener (a flood on one port cannot take them).
pub const CONNECTIONS_RESERVED_PER_LISTENER_DEFAULT: u32 = 16;
/// The completion queue holds at most this many entries (the kernel's limit).
pub const RING_CQ_ENTRIES_MAX: u32 = 65_536;
/// The default namespace: a 1 GiB sparse file under `./reflex-data/`.
pub const DEFAULT_NAMESPACE_BACKEND: &str = "file:./reflex-data/ns1";
pub const DEFAULT_NAMESPACE_SIZE_BYTES: u64 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("--namespace {text:?}: {message}")]
    NamespaceFlag { text: String, message: String },
    #[error("--original-port {text:?}: {message}")]
    OriginalPortFlag { text: String, message: String },
    #[error("--tenant {text:?}: {message}")]
    TenantFlag { text: String, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Which I/O driver runs the dataplane threads: `driver` in the file, `--driver` on the
/// command line. See `docs/OPERATIONS.md` ("I/O driver").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverChoice {
    /// io_uring when the kernel offers everything reflexd needs, otherwise epoll (with one
    /// log line naming the reason).
    #[default]
    Auto,
    /// io_uring or nothing: start-up fails with the reason when it is unavailable.
    Uring,
    /// epoll, with file and block device I/O on a small thread pool per device.
    Epoll,
}

impl DriverChoice {
    pub const NAMES: [&'static str; 3] = ["auto", "uring", "epoll"];

    pub fn name(self) -> &'static str {
        match self {
            DriverChoice::Auto => "auto",
            DriverChoice::Uring => "uring",
            DriverChoice::Epoll => "epoll",
        }
    }
}

impl std::str::FromStr for DriverChoice {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<DriverChoice, ConfigError> {
        match text.trim() {
            "auto" => Ok(DriverChoice::Auto),
            "uring" | "io_uring" => Ok(DriverChoice::Uring),
            "epoll" => Ok(DriverChoice::Epoll),
            other => Err(ConfigError::Invalid(format!(
                "driver {other:?}: expected one of {}",
                DriverChoice::NAMES.join(", ")
            ))),
        }
    }
}

impl std::fmt::Display for DriverChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A byte count written as a number or a string with a binary suffix (`"1G"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(n) => Ok(ByteSize(n)),
            Raw::Text(text) => parse_size(&text)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// One namespace: an id clients address and the backend that stores it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// Namespace id on the wire (≥ 1; 0 means "none" in the protocol).
    pub id: u32,
    /// Backend spec: `file:PATH` or a bare path, `mem:SIZE`, `null[:SIZE]`, `emu:NAME`.
    pub backend: String,
    /// Size; required for `mem` without an inline size and for files that do not exist yet.
    #[serde(default, deserialize_with = "optional_size")]
    pub size_bytes: Option<u64>,
    #[serde(default)]
    pub read_only: bool,
    /// NBD export name; `None`: `ns<ID>` (see [`NamespaceConfig::export_name`]).
    #[serde(default)]
    pub name: Option<String>,
    /// Tenant whose SLO or best-effort share the NBD connections to this export get
    /// (`docs/NBD.md`, "Exports, namespaces and tenants"). `None`: the default best-effort
    /// tenant. Native connections choose their tenant themselves.
    #[serde(default)]
    pub tenant: Option<String>,
    /// The device profile (`docs/CALIBRATION.md`) the QoS scheduler uses for this namespace,
    /// a TOML path (in a configuration file, relative to the file's folder). Without one the namespace is served
    /// first in, first out, without tenants' SLOs (logged at startup).
    #[serde(default)]
    pub profile: Option<String>,
}

/// What the configuration alone can tell of a composite namespace (`stripe:SIZE:ID,...`,
/// `concat:ID,...`): its spec parses, its members are plain namespaces declared before it,
/// and it sets nothing that belongs to a device. Block sizes, stripe size against them and
/// the members' sizes are checked when the members are open
/// (`reflex_dataplane::namespaces::NamespaceSet::with_composite`).
fn validate_composite(
    namespace: &NamespaceConfig,
    before: &[NamespaceConfig],
) -> Result<(), ConfigError> {
    let invalid = |message: String| {
        Err(ConfigError::Invalid(format!(
            "namespace {}: {message}",
            namespace.id
        )))
    };
    let spec = match CompositeSpec::parse(namespace.backend.trim()) {
        Ok(spec) => spec,
        Err(error) => return invalid(error.to_string()),
    };
    for member in &spec.members {
        match before.iter().find(|other| other.id == *member) {
            None => {
                return invalid(format!(
                    "member {member} is not a namespace declared before it"
                ));
            }
            Some(other) if CompositeSpec::is_composite(other.backend.trim()) => {
                return invalid(format!("member {member} is itself composite"));
            }
            Some(_) => {}
        }
    }
    if namespace.profile.is_some() {
        return invalid(
            "a composite namespace takes no profile: each member's device has its own".into(),
        );
    }
    if namespace.size_bytes.is_some() {
        return invalid("a composite namespace takes no size: its members' sizes make it".into());
    }
    Ok(())
}

fn optional_size<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    Option::<ByteSize>::deserialize(deserializer).map(|size| size.map(|s| s.0))
}

impl NamespaceConfig {
    /// A writable namespace with no size, name or tenant given.
    pub fn new(id: u32, backend: impl Into<String>) -> NamespaceConfig {
        NamespaceConfig {
            id,
            backend: backend.into(),
            size_bytes: None,
            read_only: false,
            name: None,
            tenant: None,
            profile: None,
        }
    }

    /// This namespace with `size_bytes` set (a file created at that size, or the first bytes
    /// of a device).
    pub fn sized(mut self, size_bytes: u64) -> NamespaceConfig {
        self.size_bytes = Some(size_bytes);
        self
    }

    /// The name NBD clients use for this namespace: the configured one, or `ns<ID>`.
    pub fn export_name(&self) -> String {
        match &self.name {
            Some(name) => name.clone(),
            None => format!("ns{}", self.id),
        }
    }

    /// Parses a `--namespace` flag:
    /// `ID=BACKEND[,size=SIZE][,ro][,name=NAME][,tenant=TENANT][,profile=PATH]`, e.g.
    /// `1=file:/data/ns1,size=10G`, `2=mem:1G,name=scratch`, `3=null`, `4=/dev/nvme0n1,ro`,
    /// `5=mem:1G,tenant=analytics`, `6=emu:device-a-small,profile=profiles/device-a-small.toml`;
    /// composite namespaces: `7=stripe:64K:1,2`, `8=concat:1,2,tenant=gold` (the numbers
    /// after the layout are its members; options never are numbers).
    pub fn from_flag(text: &str) -> Result<NamespaceConfig, ConfigError> {
        let fail = |message: &str| ConfigError::NamespaceFlag {
            text: text.to_string(),
            message: message.to_string(),
        };
        let (id, rest) = text.split_once('=').ok_or_else(|| {
            fail("expected ID=BACKEND[,size=SIZE][,ro][,name=NAME][,tenant=TENANT][,profile=PATH]")
        })?;
        let id: u32 = id
            .trim()
            .parse()
            .map_err(|_| fail("the id must be a positive integer"))?;
        let mut parts = rest.split(',');
        let backend = parts.next().unwrap_or_default().trim().to_string();
        if backend.is_empty() {
            return Err(fail("missing backend"));
        }
        let mut backend = backend;
        let mut parts = parts.peekable();
        if CompositeSpec::is_composite(&backend) {
            // A composite's member list goes on over the commas: options are never numbers.
            while let Some(member) = parts.next_if(|part| {
                let part = part.trim();
                !part.is_empty() && part.bytes().all(|byte| byte.is_ascii_digit())
            }) {
                backend.push(',');
                backend.push_str(member.trim());
            }
        }
        let mut namespace = NamespaceConfig::new(id, backend);
        for option in parts {
            let option = option.trim();
            if option == "ro" || option == "read_only" {
                namespace.read_only = true;
            } else if let Some(size) = option.strip_prefix("size=") {
                let size = parse_size(size).map_err(|e| fail(&e.to_string()))?;
                namespace.size_bytes = Some(size);
            } else if let Some(name) = option.strip_prefix("name=") {
                namespace.name = Some(name.to_string());
            } else if let Some(tenant) = option.strip_prefix("tenant=") {
                namespace.tenant = Some(tenant.to_string());
            } else if let Some(profile) = option.strip_prefix("profile=") {
                namespace.profile = Some(profile.to_string());
            } else {
                return Err(fail(&format!(
                    "unknown option {option:?} (size=SIZE, ro, name=NAME, tenant=TENANT or profile=PATH)"
                )));
            }
        }
        Ok(namespace)
    }
}

/// A port speaking the original ReFlex protocol; the port selects the namespace and, as in
/// the original server, the tenant its connections are charged to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OriginalPortConfig {
    /// 0 picks a free port (tests).
    pub port: u16,
    pub namespace: u32,
    /// Tenant of every connection to this port; `None`: the namespace's tenant
    /// ([`NamespaceConfig::tenant`]), else its default best-effort tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Source addresses (CIDR blocks) this port serves; `None`: every address. The original
    /// protocol has no credentials: this list and the port's tenant are its access control.
    #[serde(default)]
    pub allow: Option<Vec<IpNet>>,
}

impl OriginalPortConfig {
    /// A port serving `namespace` as the namespace's own tenant.
    pub fn new(port: u16, namespace: u32) -> OriginalPortConfig {
        OriginalPortConfig {
            port,
            namespace,
            tenant: None,
            allow: None,
        }
    }

    /// Parses `--original-port PORT[=NAMESPACE][,tenant=NAME]` (namespace 1 when omitted).
    pub fn from_flag(text: &str) -> Result<OriginalPortConfig, ConfigError> {
        let fail = |message: &str| ConfigError::OriginalPortFlag {
            text: text.to_string(),
            message: message.to_string(),
        };
        let (text_port, tenant) = match text.split_once(',') {
            Some((head, option)) => match option.trim().strip_prefix("tenant=") {
                Some(name) => (head, Some(name.to_string())),
                None => return Err(fail("the only option is tenant=NAME")),
            },
            None => (text, None),
        };
        let (port, namespace) = match text_port.split_once('=') {
            Some((port, namespace)) => (port, namespace),
            None => (text_port, "1"),
        };
        Ok(OriginalPortConfig {
            port: port.trim().parse().map_err(|_| fail("bad port"))?,
            namespace: namespace
                .trim()
                .parse()
                .map_err(|_| fail("bad namespace id"))?,
            tenant,
            allow: None,
        })
    }
}

/// The class of a configured tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantClassConfig {
    /// Latency-critical: `latency_us_p95`, `iops` and `read_percent` are required.
    Lc,
    /// Best-effort: a fair share of what LC tenants leave.
    Be,
}

/// A tenant declared in the configuration (`[[tenant]]`): bound to namespaces (and so to
/// their NBD exports) by `tenant = "NAME"` and to original-protocol ports by their `tenant`.
/// Each namespace with a QoS profile admits it at startup; a refusal stops the server with
/// the reason.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub class: TenantClassConfig,
    #[serde(default)]
    pub latency_us_p95: Option<u64>,
    #[serde(default)]
    pub iops: Option<u64>,
    /// Reads among the reserved I/Os, in percent (LC only; default 100).
    #[serde(default)]
    pub read_percent: Option<u8>,
    /// The device submission queue (NVMe priority class) the tenant's I/O goes to when it
    /// arrives through an NBD export or an original-protocol port bound to the tenant;
    /// `None`: the connection's own (the class its client declared, else the default).
    #[serde(default)]
    pub priority: Option<PriorityConfig>,
    /// What its connections may do (`docs/OPERATIONS.md`, "Access control"): `read-write`
    /// (the default) or `read-only` (WRITE, TRIM and WRITE ZEROES refused).
    #[serde(default)]
    pub access: AccessConfig,
    /// The bytes of each of its namespaces it may touch: from `range_offset` (default 0)
    /// for `range_size` bytes (default: to the end). Neither: the whole namespace.
    #[serde(default, deserialize_with = "optional_size")]
    pub range_offset: Option<u64>,
    #[serde(default, deserialize_with = "optional_size")]
    pub range_size: Option<u64>,
    /// Its flows' response time alone (µs), for the fairness monitors' slowdowns instead of
    /// what they learn from low-contention windows (`docs/FAIRNESS.md`).
    #[serde(default)]
    pub rt_alone_us: Option<u32>,
}

/// `access` of a tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessConfig {
    #[default]
    ReadWrite,
    ReadOnly,
}

/// `priority` of a tenant: an NVMe arbitration class (`docs/EMULATION.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PriorityConfig {
    Urgent,
    High,
    Medium,
    Low,
}

impl PriorityConfig {
    /// The device submission queue of the class.
    pub fn submission_queue(self) -> u16 {
        use reflex_flash::emu::PriorityClass;
        match self {
            PriorityConfig::Urgent => PriorityClass::Urgent,
            PriorityConfig::High => PriorityClass::High,
            PriorityConfig::Medium => PriorityClass::Medium,
            PriorityConfig::Low => PriorityClass::Low,
        }
        .submission_queue()
    }
}

impl TenantConfig {
    /// A best-effort tenant.
    pub fn best_effort(name: impl Into<String>) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            class: TenantClassConfig::Be,
            latency_us_p95: None,
            iops: None,
            read_percent: None,
            priority: None,
            access: AccessConfig::ReadWrite,
            range_offset: None,
            range_size: None,
            rt_alone_us: None,
        }
    }

    /// What the tenant's configuration grants it on a namespace (a range is not checked
    /// against the namespace's size: bytes past its end are refused anyway).
    pub fn grant(&self) -> Grant {
        let range = match (self.range_offset, self.range_size) {
            (None, None) => None,
            (offset, size) => Some(ByteRange {
                offset_bytes: offset.unwrap_or(0),
                length_bytes: size.unwrap_or(u64::MAX - offset.unwrap_or(0)),
            }),
        };
        Grant {
            read_only: self.access == AccessConfig::ReadOnly,
            range,
        }
    }

    /// A latency-critical tenant.
    pub fn latency_critical(
        name: impl Into<String>,
        latency_us_p95: u64,
        iops: u64,
        read_percent: u8,
    ) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            class: TenantClassConfig::Lc,
            latency_us_p95: Some(latency_us_p95),
            iops: Some(iops),
            read_percent: Some(read_percent),
            priority: None,
            access: AccessConfig::ReadWrite,
            range_offset: None,
            range_size: None,
            rt_alone_us: None,
        }
    }

    /// What the tenant asks of admission control. Checked by [`Config::validate`].
    pub fn spec(&self) -> Result<TenantSpec, String> {
        match self.class {
            TenantClassConfig::Be => {
                if self.latency_us_p95.is_some()
                    || self.iops.is_some()
                    || self.read_percent.is_some()
                {
                    return Err(format!(
                        "tenant {:?} is best-effort: it takes no latency_us_p95, iops or read_percent",
                        self.name
                    ));
                }
                Ok(TenantSpec::BestEffort)
            }
            TenantClassConfig::Lc => match (self.latency_us_p95, self.iops) {
                (Some(latency_us_p95), Some(iops)) if latency_us_p95 > 0 && iops > 0 => {
                    let read_percent = self.read_percent.unwrap_or(100);
                    if read_percent > 100 {
                        return Err(format!("tenant {:?}: read_percent above 100", self.name));
                    }
                    Ok(TenantSpec::LatencyCritical {
                        latency_us_p95,
                        iops,
                        read_percent,
                    })
                }
                _ => Err(format!(
                    "latency-critical tenant {:?} needs latency_us_p95 and iops above 0",
                    self.name
                )),
            },
        }
    }

    /// Parses `--tenant NAME=be` or `--tenant NAME=lc,latency_us=500,iops=12000[,read_percent=100]`.
    pub fn from_flag(text: &str) -> Result<TenantConfig, ConfigError> {
        let fail = |message: &str| ConfigError::TenantFlag {
            text: text.to_string(),
            message: message.to_string(),
        };
        let (name, rest) = text.split_once('=').ok_or_else(|| {
            fail("expected NAME=be or NAME=lc,latency_us=US,iops=N[,read_percent=P]")
        })?;
        let mut parts = rest.split(',');
        let mut tenant = match parts.next().map(str::trim) {
            Some("be") => TenantConfig::best_effort(name.trim()),
            Some("lc") => TenantConfig {
                class: TenantClassConfig::Lc,
                ..TenantConfig::best_effort(name.trim())
            },
            _ => return Err(fail("the class must be be or lc")),
        };
        for option in parts {
            let (key, value) = option
                .trim()
                .split_once('=')
                .ok_or_else(|| fail("options are KEY=VALUE"))?;
            let number: u64 = value.trim().parse().map_err(|_| fail("bad number"))?;
            match key {
                "latency_us" | "latency_us_p95" => tenant.latency_us_p95 = Some(number),
                "iops" => tenant.iops = Some(number),
                "read_percent" => {
                    tenant.read_percent =
                        Some(u8::try_from(number).map_err(|_| fail("read_percent above 100"))?)
                }
                _ => return Err(fail("options are latency_us, iops and read_percent")),
            }
        }
        tenant.spec().map_err(|message| fail(&message))?;
        Ok(tenant)
    }
}

/// The NBD listener (`docs/NBD.md`). Exports are the namespaces, under their
/// [`NamespaceConfig::export_name`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NbdConfig {
    /// Whether to listen for NBD at all.
    pub enabled: bool,
    /// 0 picks a free port.
    pub port: u16,
    /// The export a client gets when it asks for the empty name; `None`: the first namespace
    /// in the configuration.
    pub default_export: Option<String>,
    /// Exports besides each namespace's own (`[[nbd.export]]`): several may name one
    /// namespace, each charged to its own tenant, so that standard clients (fio's nbd engine,
    /// one job per export) can be several tenants at once.
    #[serde(rename = "export")]
    pub exports: Vec<NbdExportConfig>,
    /// Source addresses (CIDR blocks) the NBD port serves; `None`: every address.
    pub allow: Option<Vec<IpNet>>,
}

/// `[[nbd.export]]`: an NBD export of namespace `namespace` charged to `tenant`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NbdExportConfig {
    /// The export's name (unique among every export, the namespaces' own included).
    pub name: String,
    /// The namespace id it serves.
    pub namespace: u32,
    /// The tenant its connections are charged to; `None`: the namespace's default
    /// best-effort tenant.
    #[serde(default)]
    pub tenant: Option<String>,
}

impl Default for NbdConfig {
    fn default() -> NbdConfig {
        NbdConfig {
            enabled: true,
            port: NBD_PORT_DEFAULT,
            default_export: None,
            exports: Vec::new(),
            allow: None,
        }
    }
}

/// The key-value port (`docs/KV.md`): the table on one namespace, accepted on every dataplane
/// thread; thread 0 owns the table and steps every operation's machine, the other threads
/// forward their requests' steps to it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvConfig {
    /// Whether to serve the table at all (off by default: it owns its namespace's blocks).
    pub enabled: bool,
    /// 0 picks a free port.
    pub port: u16,
    /// The namespace id that holds the table. Nothing else should write that namespace.
    pub namespace: u32,
    /// The tenant KV connections are charged to; `None`: the namespace's default tenant.
    pub tenant: Option<String>,
    /// Format a table when the namespace holds none (a first start); otherwise start-up
    /// fails on a namespace without a table.
    pub create: bool,
    /// Format a fresh, empty table at every start-up (what was stored is lost).
    pub format: bool,
    /// Source addresses (CIDR blocks) the KV port serves; `None`: every address.
    pub allow: Option<Vec<IpNet>>,
}

/// The KV port's default (`reflex bench --kv` and the client use it too).
pub const KV_PORT_DEFAULT: u16 = 7077;

impl Default for KvConfig {
    fn default() -> KvConfig {
        KvConfig {
            enabled: false,
            port: KV_PORT_DEFAULT,
            namespace: 1,
            tenant: None,
            create: true,
            format: false,
            allow: None,
        }
    }
}

/// A host allowed into an NVMe/TCP subsystem, and the tenant its I/O is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmeHostConfig {
    /// The host NQN it connects with.
    pub nqn: String,
    /// Tenant (declared with `[[tenant]]` or best-effort by this name) of its I/O on every
    /// namespace of the subsystem; `None`: each namespace's own tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Its TLS key for this subsystem (TP 8011) in the PSK interchange format,
    /// `NVMeTLSkey-1:01:<base64>:` (`nvme gen-tls-key`); with a key the host connects over
    /// TLS only (`docs/NVME-TCP.md`, "TLS").
    #[serde(default)]
    pub psk: Option<String>,
    /// The same key read from a file (as SPDK's `nvmf_subsystem_add_host --psk FILE`), read
    /// again on SIGHUP.
    #[serde(default)]
    pub psk_file: Option<String>,
}

impl NvmeHostConfig {
    /// Whether the host has a TLS key.
    pub fn has_tls_key(&self) -> bool {
        self.psk.is_some() || self.psk_file.is_some()
    }
}

/// An NVMe/TCP subsystem (`docs/NVME-TCP.md`): namespaces under their ids as NSIDs, and who
/// may connect.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmeSubsystemConfig {
    pub nqn: String,
    /// Namespace ids it serves; empty: every namespace.
    #[serde(default)]
    pub namespaces: Vec<u32>,
    /// Hosts not listed in `host` may connect too (charged to each namespace's tenant).
    #[serde(default = "default_true")]
    pub allow_any_host: bool,
    #[serde(default, rename = "host")]
    pub hosts: Vec<NvmeHostConfig>,
    /// Hosts connect over TLS only (SPDK's `--secure-channel`; needs `nvme_tcp.tls`).
    #[serde(default)]
    pub secure_channel: bool,
}

fn default_true() -> bool {
    true
}

/// TLS on the discovery subsystem (`nqn.2014-08.org.nvmexpress.discovery`): which hosts have
/// a key for it and whether plaintext discovery is refused. Why apart from the subsystems:
/// the discovery subsystem has no namespaces or tenants, and every host may ask for its
/// discovery log (which lists only the subsystems that host may connect to).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmeDiscoveryConfig {
    /// Hosts connect to the discovery subsystem over TLS only (needs `nvme_tcp.tls`).
    pub secure_channel: bool,
    /// Hosts with a TLS key for the discovery subsystem (`nqn` and `psk` or `psk_file`; no
    /// `tenant`): each asks for the discovery log over TLS only.
    #[serde(rename = "host")]
    pub hosts: Vec<NvmeHostConfig>,
}

/// The NVMe/TCP listener (`docs/NVME-TCP.md`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmeTcpConfig {
    /// Whether to listen for NVMe/TCP at all.
    pub enabled: bool,
    /// 0 picks a free port.
    pub port: u16,
    /// Entries per queue a host may ask for (MQES + 1); the window lowers it when smaller.
    pub queue_entries_max: u16,
    /// I/O queues (connections) one controller may have.
    pub io_queues_max: u16,
    /// A host that does not send the data an R2T asked for within this long loses the
    /// connection.
    #[serde(with = "humantime_serde")]
    pub r2t_timeout: Duration,
    /// A host's keep-alive timeout below this is raised to it (0 in Connect keeps it off).
    #[serde(with = "humantime_serde")]
    pub keep_alive_timeout_min: Duration,
    /// Subsystems; none: one, [`NVME_TCP_DEFAULT_NQN`], with every namespace, any host.
    #[serde(rename = "subsystem")]
    pub subsystems: Vec<NvmeSubsystemConfig>,
    /// Source addresses (CIDR blocks) the NVMe/TCP port serves; `None`: every address.
    pub allow: Option<Vec<IpNet>>,
    /// TLS (TP 8011, pre-shared keys of the hosts): `"off"`, `"optional"` (each host
    /// chooses) or `"require"` (a plaintext host is closed before its ICResp).
    pub tls: TlsMode,
    /// TLS keys and requirement of the discovery subsystem (`[nvme_tcp.discovery]`).
    pub discovery: NvmeDiscoveryConfig,
}

impl Default for NvmeTcpConfig {
    fn default() -> NvmeTcpConfig {
        NvmeTcpConfig {
            enabled: true,
            port: NVME_TCP_PORT_DEFAULT,
            queue_entries_max: 128,
            io_queues_max: 16,
            r2t_timeout: Duration::from_secs(30),
            keep_alive_timeout_min: Duration::from_secs(1),
            subsystems: Vec::new(),
            allow: None,
            tls: TlsMode::Off,
            discovery: NvmeDiscoveryConfig::default(),
        }
    }
}

/// How long a connection, a request or a device may take before reflexd gives up on it
/// (`docs/OPERATIONS.md`, "Limits and timeouts"). Durations as `"10s"`, `"500ms"`, `"2m"`;
/// `"0s"` turns a timeout off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsConfig {
    /// A connection that completes no request (for NBD: no handshake) this long after it was
    /// accepted is closed.
    #[serde(with = "humantime_serde")]
    pub handshake: Duration,
    /// A connection with nothing outstanding that sends nothing for this long is closed.
    /// Off by default: NBD clients (qemu, the kernel) stay connected while idle.
    #[serde(with = "humantime_serde")]
    pub idle: Duration,
    /// A request whose header or payload stops arriving for this long closes its connection.
    #[serde(with = "humantime_serde")]
    pub receive: Duration,
    /// A connection whose answers make no progress (the client does not read) for this long
    /// is closed, and its buffers go back to the others.
    #[serde(with = "humantime_serde")]
    pub send: Duration,
    /// A device operation outstanding this long is answered with an error (ETIMEDOUT; EIO on
    /// protocols without it) while the device keeps its buffer until it answers.
    #[serde(with = "humantime_serde")]
    pub device: Duration,
    /// How long a shutdown waits for clients to take their last answers.
    #[serde(with = "humantime_serde")]
    pub drain: Duration,
}

impl Default for TimeoutsConfig {
    fn default() -> TimeoutsConfig {
        TimeoutsConfig {
            handshake: Duration::from_secs(10),
            idle: Duration::ZERO,
            receive: Duration::from_secs(30),
            send: Duration::from_secs(60),
            device: Duration::from_secs(30),
            drain: Duration::from_secs(10),
        }
    }
}

/// Everything `Server::start` needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address every protocol listens on. Loopback by default: exposing storage to the network
    /// is a decision the operator makes with `--listen 0.0.0.0`.
    pub listen: IpAddr,
    /// Native protocol port (0 picks a free one).
    pub port: u16,
    /// Source addresses (CIDR blocks) the native port serves; `None`: every address. The
    /// other listeners have their own (`[nbd]`, `[nvme_tcp]`, `[[original_port]]`, `[admin]`).
    pub allow: Option<Vec<IpNet>>,
    /// Original-protocol ports. `None`: port 1234 serving namespace 1 if it exists.
    pub original_ports: Option<Vec<OriginalPortConfig>>,
    /// The NBD listener: on port 10809 unless configured otherwise.
    pub nbd: NbdConfig,
    /// The NVMe/TCP listener: on port 4420 unless configured otherwise.
    pub nvme_tcp: NvmeTcpConfig,
    /// The key-value port: off unless configured.
    pub kv: KvConfig,
    /// Dataplane threads, each with its own ring, buffers and share of connections.
    pub threads: usize,
    /// CPUs the dataplane threads are pinned to, thread i to the i-th (as many as `threads`);
    /// empty: not pinned. ReFlex gives each dataplane thread a core of its own: pin them here
    /// and keep everything else, the process's own admin and control threads included, off
    /// those CPUs (e.g. `isolcpus`, or `bench/lib/isolate.py`).
    pub dataplane_cpus: Vec<usize>,
    /// Spin on the rings instead of sleeping when idle (lowest latency, one busy core each).
    pub poll: bool,
    /// In blocking mode, how long at most a thread spins before a device or scheduler
    /// deadline instead of sleeping through it: it sleeps until shortly before the deadline
    /// (by the wake-up delay it measured lately) and spins the rest, so deadlines are met
    /// even where waking from a sleep costs hundreds of microseconds. `"0s"`: never spins.
    #[serde(with = "humantime_serde")]
    pub spin_before_deadline_max: Duration,
    /// The I/O driver: io_uring, epoll, or io_uring when available (the default).
    pub driver: DriverChoice,
    /// Outstanding requests per connection; more are not read until some complete.
    pub window: u32,
    #[serde(deserialize_with = "size_bytes")]
    pub arena_bytes_per_thread: u64,
    pub connections_per_thread_max: u32,
    /// Connections of a thread kept for each other listener.
    pub connections_reserved_per_listener: u32,
    /// Open connections of a thread from one address; 0: no limit.
    pub connections_per_source_max: u32,
    pub requests_per_thread_max: u32,
    /// Receive buffer of each connection.
    #[serde(deserialize_with = "size_bytes")]
    pub recv_buffer_bytes: u64,
    /// A connection idle this long gives its receive buffer back and waits for readiness
    /// instead, so idle connections cost no buffer; `"0s"`: never.
    #[serde(with = "humantime_serde")]
    pub recv_buffer_park_after: Duration,
    /// Tenants one connection may register (and own) at once.
    pub tenants_per_connection_max: u32,
    /// Tenants the connections of one address may register (and own) at once.
    pub tenants_per_source_max: u32,
    /// How long a registered tenant outlives the connection that registered it (so a
    /// reconnecting client can bind again); then it is unregistered unless still in use.
    #[serde(with = "humantime_serde")]
    pub tenant_orphan_grace: Duration,
    /// Share of a thread's arena one connection may hold, in percent (at least one 1 MiB
    /// run): a client that never reads its answers cannot take the others' buffers.
    pub connection_arena_percent: u8,
    pub timeouts: TimeoutsConfig,
    /// Whether to register the arena with the ring (fixed-buffer I/O); off only for testing
    /// the unregistered path.
    pub register_buffers: bool,
    #[serde(rename = "namespace")]
    pub namespaces: Vec<NamespaceConfig>,
    /// The QoS scheduler on namespaces with a profile (`docs/QOS.md`); `false` (`--no-qos`)
    /// serves them first in, first out (tenants, admission and accounting stay), for
    /// comparison.
    pub qos: bool,
    /// Scheduler and admission knobs (`docs/QOS.md` §7).
    pub qos_config: QosConfig,
    /// Tenants declared with their class and SLO.
    #[serde(rename = "tenant")]
    pub tenants: Vec<TenantConfig>,
    /// The admin API, its metrics and the state file (`docs/OPERATIONS.md`, "Admin API").
    pub admin: crate::admin::AdminConfig,
    /// TLS on the native and NBD listeners (`docs/OPERATIONS.md`, "TLS").
    pub tls: TlsConfig,
    /// Thread scaling: threads parked and woken with the load (`docs/OPERATIONS.md`,
    /// "Thread scaling"); automatic scaling is off by default.
    pub scaling: reflex_qos::ScalingConfig,
}

/// `[tls]`: the server's certificate and key, the CA whose client certificates name tenants,
/// and which protocols use TLS.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The server's certificate chain (PEM), leaf first.
    pub certificate: Option<String>,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<String>,
    /// CA certificates (PEM) that sign client certificates. When set, a TLS client must
    /// present a certificate signed by one of them, and its subject's common name is the
    /// connection's identity (`docs/OPERATIONS.md`, "TLS").
    pub client_ca: Option<String>,
    /// Pre-shared keys (the `psktool` format nbdkit and qemu read: one `identity:hexkey` per
    /// line). A client that offers one of them instead of a certificate is the tenant its
    /// identity names (`docs/OPERATIONS.md`, "TLS").
    pub psk_file: Option<String>,
    /// The native protocol: `"off"`, or `"require"` (TLS from the first byte).
    pub native: TlsMode,
    /// NBD: `"off"` (STARTTLS refused), `"optional"` (the client may upgrade) or `"require"`
    /// (every option but STARTTLS refused until TLS, as `nbdkit --tls=require`).
    pub nbd: TlsMode,
    /// With `nbd = "optional"`: the NBD exports served only over TLS (the NBD spec's
    /// SELECTIVETLS mode); the others are served either way.
    pub nbd_tls_only_exports: Vec<String>,
}

/// Whether a listener speaks TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    #[default]
    Off,
    Optional,
    Require,
}

impl Config {
    /// Whether any listener uses TLS: `[tls]`'s, or NVMe/TCP's with its hosts' keys.
    pub fn tls_in_use(&self) -> bool {
        self.tls.enabled() || (self.nvme_tcp.enabled && self.nvme_tcp.tls != TlsMode::Off)
    }
}

impl TlsConfig {
    /// Whether any listener uses TLS (the certificate and key must then be given).
    pub fn enabled(&self) -> bool {
        self.native != TlsMode::Off || self.nbd != TlsMode::Off
    }
}

fn size_bytes<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    ByteSize::deserialize(deserializer).map(|size| size.0)
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: NATIVE_PORT_DEFAULT,
            allow: None,
            original_ports: None,
            nbd: NbdConfig::default(),
            nvme_tcp: NvmeTcpConfig::default(),
            kv: KvConfig::default(),
            threads: 1,
            dataplane_cpus: Vec::new(),
            poll: false,
            spin_before_deadline_max: Duration::from_micros(500),
            driver: DriverChoice::Auto,
            window: WINDOW_DEFAULT,
            arena_bytes_per_thread: ARENA_BYTES_PER_THREAD_DEFAULT,
            connections_per_thread_max: CONNECTIONS_PER_THREAD_DEFAULT,
            connections_reserved_per_listener: CONNECTIONS_RESERVED_PER_LISTENER_DEFAULT,
            connections_per_source_max: 0,
            requests_per_thread_max: REQUESTS_PER_THREAD_DEFAULT,
            recv_buffer_bytes: RECV_BUFFER_BYTES_DEFAULT,
            recv_buffer_park_after: Duration::from_secs(1),
            tenants_per_connection_max: 16,
            tenants_per_source_max: 1024,
            tenant_orphan_grace: Duration::from_secs(30),
            connection_arena_percent: CONNECTION_ARENA_PERCENT_DEFAULT,
            timeouts: TimeoutsConfig::default(),
            register_buffers: true,
            namespaces: Vec::new(),
            qos: true,
            qos_config: QosConfig::default(),
            tenants: Vec::new(),
            admin: crate::admin::AdminConfig::default(),
            tls: TlsConfig::default(),
            scaling: reflex_qos::ScalingConfig::default(),
        }
    }
}

impl Config {
    /// A server embedded in a test or a tool: the native protocol on a free loopback port
    /// (port 0), no original-protocol ports, NBD off, one thread, a 16 MiB arena; QoS and
    /// the rest as by default. Callers override fields with struct update syntax.
    pub fn loopback(namespaces: Vec<NamespaceConfig>) -> Config {
        Config {
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            original_ports: Some(Vec::new()),
            nbd: NbdConfig {
                enabled: false,
                ..NbdConfig::default()
            },
            nvme_tcp: NvmeTcpConfig {
                enabled: false,
                ..NvmeTcpConfig::default()
            },
            threads: 1,
            arena_bytes_per_thread: 16 << 20,
            namespaces,
            admin: crate::admin::AdminConfig::disabled(),
            ..Config::default()
        }
    }

    pub fn from_toml(text: &str, path_for_errors: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path_for_errors.to_string(),
            message: e.to_string(),
        })
    }

    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let mut config = Config::from_toml(&text, &shown)?;
        config.resolve_relative_paths(path.parent().unwrap_or(Path::new("")));
        Ok(config)
    }

    /// Makes the relative paths a configuration file names (file backends, QoS profiles, the
    /// admin state file) relative to `base`, the file's folder, so that a configuration means
    /// the same whatever the working directory. Absolute paths and non-file backends stay.
    pub fn resolve_relative_paths(&mut self, base: &Path) {
        let resolve = |path: &str| -> String {
            if path.is_empty() || Path::new(path).is_absolute() {
                path.to_string()
            } else {
                base.join(path).display().to_string()
            }
        };
        for namespace in &mut self.namespaces {
            let backend = namespace.backend.trim();
            if let Some(path) = backend.strip_prefix("file:") {
                namespace.backend = format!("file:{}", resolve(path));
            } else if !backend.contains(':')
                && !backend.starts_with("emu(")
                && !backend.starts_with("fault(")
                && backend != "null"
                && backend != "mem"
                && backend != "fault"
            {
                namespace.backend = resolve(backend);
            }
            if let Some(profile) = &namespace.profile {
                namespace.profile = Some(resolve(profile));
            }
        }
        if let Some(token_file) = &self.admin.token_file {
            self.admin.token_file = Some(resolve(token_file));
        }
        if let Some(state_file) = &self.admin.state_file {
            self.admin.state_file = Some(resolve(state_file));
        }
        for path in [
            &mut self.tls.certificate,
            &mut self.tls.key,
            &mut self.tls.client_ca,
            &mut self.tls.psk_file,
        ]
        .into_iter()
        .flatten()
        {
            *path = resolve(path);
        }
        let discovery_hosts = self.nvme_tcp.discovery.hosts.iter_mut();
        for host in (self.nvme_tcp.subsystems.iter_mut())
            .flat_map(|subsystem| subsystem.hosts.iter_mut())
            .chain(discovery_hosts)
        {
            if let Some(path) = &host.psk_file {
                host.psk_file = Some(resolve(path));
            }
        }
    }

    /// The namespaces to serve: the configured ones, or the default 1 GiB file.
    pub fn effective_namespaces(&self) -> Vec<NamespaceConfig> {
        if self.namespaces.is_empty() {
            vec![NamespaceConfig {
                size_bytes: Some(DEFAULT_NAMESPACE_SIZE_BYTES),
                ..NamespaceConfig::new(1, DEFAULT_NAMESPACE_BACKEND)
            }]
        } else {
            self.namespaces.clone()
        }
    }

    /// Completion-queue entries one thread's ring needs so that no completion can be
    /// refused: per connection slot a receive, a send and their two cancellations; per
    /// listener an accept and its cancellation; the device operations in flight and the
    /// shutdown flushes; the wake-up read and its cancellation. Rounded up to a power of two
    /// (never below `RING_CQ_ENTRIES_MIN`).
    pub fn ring_cq_entries(&self) -> u32 {
        let slots = u64::from(self.connections_per_thread_max)
            + u64::from(reflex_dataplane::CONNECTION_SLACK);
        // Native, NBD, NVMe/TCP, the original ports, and the KV port.
        let listeners =
            3 + self.effective_original_ports().len() as u64 + u64::from(self.kv.enabled);
        let needed = 4 * slots
            + 2 * listeners
            + u64::from(reflex_dataplane::DEVICE_IN_FLIGHT_PER_THREAD_MAX)
            + self.effective_namespaces().len() as u64
            + 2;
        let needed = needed
            .next_power_of_two()
            .max(u64::from(crate::uring::RING_CQ_ENTRIES_MIN));
        u32::try_from(needed).unwrap_or(u32::MAX)
    }

    /// Bounds on tenants registered over the wire.
    pub fn tenant_limits(&self) -> reflex_dataplane::control::TenantLimits {
        reflex_dataplane::control::TenantLimits {
            per_connection_max: self.tenants_per_connection_max,
            per_source_max: self.tenants_per_source_max,
            orphan_grace: reflex_qos::Nanos(self.tenant_orphan_grace.as_nanos() as u64),
        }
    }

    /// The limits every dataplane thread runs within.
    pub fn limits(&self) -> reflex_dataplane::Limits {
        let arena_bytes = self.arena_bytes_per_thread as usize;
        let (connection_pages_max, arena_reserve_pages, connection_pages_share) =
            reflex_dataplane::Limits::shares_for_arena(
                arena_bytes,
                u32::from(self.connection_arena_percent),
            );
        let optional = |duration: Duration| {
            (!duration.is_zero()).then_some(reflex_qos::Nanos(duration.as_nanos() as u64))
        };
        reflex_dataplane::Limits {
            window: self.window,
            requests_max: self.requests_per_thread_max,
            connections_max: self.connections_per_thread_max,
            connections_reserved_per_listener: self.connections_reserved_per_listener,
            connections_per_source_max: (self.connections_per_source_max > 0)
                .then_some(self.connections_per_source_max),
            recv_buffer_bytes: self.recv_buffer_bytes as usize,
            arena_bytes,
            connection_pages_max,
            arena_reserve_pages,
            connection_pages_share,
            handshake_timeout: optional(self.timeouts.handshake),
            idle_timeout: optional(self.timeouts.idle),
            receive_timeout: optional(self.timeouts.receive),
            send_timeout: optional(self.timeouts.send),
            device_timeout: optional(self.timeouts.device),
            drain_timeout: reflex_qos::Nanos(self.timeouts.drain.as_nanos() as u64),
            device_in_flight_max: reflex_dataplane::DEVICE_IN_FLIGHT_PER_THREAD_MAX,
            park_after: optional(self.recv_buffer_park_after),
        }
    }

    /// The original-protocol ports to open.
    pub fn effective_original_ports(&self) -> Vec<OriginalPortConfig> {
        match &self.original_ports {
            Some(ports) => ports.clone(),
            None => {
                let has_one = self.effective_namespaces().iter().any(|ns| ns.id == 1);
                if has_one {
                    vec![OriginalPortConfig::new(ORIGINAL_PORT_DEFAULT, 1)]
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// The export a client naming the empty string gets: the configured default, or the first
    /// namespace's export.
    pub fn effective_default_export(&self) -> Option<String> {
        match &self.nbd.default_export {
            Some(name) => Some(name.clone()),
            None => self
                .effective_namespaces()
                .first()
                .map(NamespaceConfig::export_name),
        }
    }

    /// The NVMe/TCP subsystems to serve: the configured ones, or one with every namespace.
    pub fn effective_nvme_subsystems(&self) -> Vec<NvmeSubsystemConfig> {
        if self.nvme_tcp.subsystems.is_empty() {
            vec![NvmeSubsystemConfig {
                nqn: NVME_TCP_DEFAULT_NQN.to_string(),
                namespaces: Vec::new(),
                allow_any_host: true,
                hosts: Vec::new(),
                secure_channel: false,
            }]
        } else {
            self.nvme_tcp.subsystems.clone()
        }
    }

    /// Entries per NVMe/TCP queue (MQES + 1): the configured maximum, at most the window.
    pub fn nvme_queue_entries_max(&self) -> u16 {
        let window = u16::try_from(self.window).unwrap_or(u16::MAX);
        self.nvme_tcp.queue_entries_max.min(window)
    }

    /// The namespace ids an NVMe/TCP subsystem serves.
    pub fn nvme_subsystem_namespaces(&self, subsystem: &NvmeSubsystemConfig) -> Vec<u32> {
        if subsystem.namespaces.is_empty() {
            self.effective_namespaces().iter().map(|ns| ns.id).collect()
        } else {
            subsystem.namespaces.clone()
        }
    }

    /// The configured tenant called `name`: its declaration, or (for a name only used in a
    /// binding) a best-effort tenant of that name.
    pub fn tenant(&self, name: &str) -> TenantConfig {
        self.tenants
            .iter()
            .find(|tenant| tenant.name == name)
            .cloned()
            .unwrap_or_else(|| TenantConfig::best_effort(name))
    }

    /// The names of the tenants bound to namespace `id`, through the namespace itself or an
    /// original-protocol port serving it, in order of first appearance.
    pub fn tenants_bound_to(&self, id: u32) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let namespace_tenant = self
            .effective_namespaces()
            .into_iter()
            .filter(|namespace| namespace.id == id)
            .filter_map(|namespace| namespace.tenant);
        let port_tenants = self
            .effective_original_ports()
            .into_iter()
            .filter(|port| port.namespace == id)
            .filter_map(|port| port.tenant);
        let nvme_tenants: Vec<String> = if self.nvme_tcp.enabled {
            self.effective_nvme_subsystems()
                .iter()
                .filter(|subsystem| self.nvme_subsystem_namespaces(subsystem).contains(&id))
                .flat_map(|subsystem| {
                    subsystem
                        .hosts
                        .iter()
                        .filter_map(|host| host.tenant.clone())
                })
                .collect()
        } else {
            Vec::new()
        };
        let export_tenants = self
            .nbd
            .exports
            .iter()
            .filter(|export| export.namespace == id)
            .filter_map(|export| export.tenant.clone());
        for name in namespace_tenant
            .chain(port_tenants)
            .chain(nvme_tenants)
            .chain(export_tenants)
        {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The grants of the configured tenants that have one, by name.
    pub fn grants(&self) -> std::collections::BTreeMap<String, Grant> {
        self.tenants
            .iter()
            .map(|tenant| (tenant.name.clone(), tenant.grant()))
            .filter(|(_, grant)| !grant.is_unrestricted())
            .collect()
    }

    /// The RT_alone of the configured tenants that have one, by name.
    pub fn rt_alone(&self) -> std::collections::BTreeMap<String, u32> {
        self.tenants
            .iter()
            .filter_map(|tenant| Some((tenant.name.clone(), tenant.rt_alone_us?)))
            .collect()
    }

    /// Checks every field against its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.threads == 0 || self.threads > THREADS_MAX {
            return invalid(format!("threads {} not in 1..={THREADS_MAX}", self.threads));
        }
        if !self.dataplane_cpus.is_empty() && self.dataplane_cpus.len() != self.threads {
            return invalid(format!(
                "dataplane_cpus names {} CPUs for {} dataplane threads (one per thread)",
                self.dataplane_cpus.len(),
                self.threads
            ));
        }
        for (index, cpu) in self.dataplane_cpus.iter().enumerate() {
            if self.dataplane_cpus[..index].contains(cpu) {
                return invalid(format!(
                    "dataplane_cpus names CPU {cpu} twice (each thread gets a core of its own)"
                ));
            }
        }
        if let Err(error) = self.scaling.validate(self.threads) {
            return invalid(error.to_string());
        }
        if self.window == 0 || self.window > WINDOW_MAX {
            return invalid(format!("window {} not in 1..={WINDOW_MAX}", self.window));
        }
        if self.tls.native == TlsMode::Optional {
            return invalid(
                "tls.native = \"optional\": the native protocol has no upgrade; use \"off\" or \"require\""
                    .to_string(),
            );
        }
        if !self.tls.nbd_tls_only_exports.is_empty() && self.tls.nbd == TlsMode::Off {
            return invalid(
                "tls.nbd_tls_only_exports needs tls.nbd = \"optional\" (or \"require\")"
                    .to_string(),
            );
        }
        if self.tls.certificate.is_some() != self.tls.key.is_some() {
            return invalid(
                "tls.certificate and tls.key go together: name both PEM files, or neither"
                    .to_string(),
            );
        }
        if self.tls.enabled() && self.tls.certificate.is_none() && self.tls.psk_file.is_none() {
            return invalid(
                "[tls] native or nbd uses TLS: tls.certificate and tls.key must name PEM files, or tls.psk_file a key file"
                    .to_string(),
            );
        }
        let arena = self.arena_bytes_per_thread;
        if !((1 << 20)..=ARENA_BYTES_PER_THREAD_MAX).contains(&arena)
            || !arena.is_multiple_of(1 << 20)
        {
            return invalid(format!(
                "arena_bytes_per_thread {arena} must be a multiple of 1 MiB in 1 MiB..=1 GiB"
            ));
        }
        if self.connections_per_thread_max == 0
            || self.connections_per_thread_max > CONNECTIONS_PER_THREAD_MAX
        {
            return invalid(format!(
                "connections_per_thread_max {} not in 1..={CONNECTIONS_PER_THREAD_MAX}",
                self.connections_per_thread_max
            ));
        }
        if !(RECV_BUFFER_BYTES_MIN..=RECV_BUFFER_BYTES_MAX).contains(&self.recv_buffer_bytes) {
            return invalid(format!(
                "recv_buffer_bytes {} not in {RECV_BUFFER_BYTES_MIN}..={RECV_BUFFER_BYTES_MAX}",
                self.recv_buffer_bytes
            ));
        }
        if !(1..=100).contains(&self.connection_arena_percent) {
            return invalid(format!(
                "connection_arena_percent {} not in 1..=100",
                self.connection_arena_percent
            ));
        }
        let cq_entries = self.ring_cq_entries();
        if cq_entries > RING_CQ_ENTRIES_MAX {
            return invalid(format!(
                "connections_per_thread_max {} needs {cq_entries} completion queue entries per \
                 thread, more than a ring holds ({RING_CQ_ENTRIES_MAX}): use more threads or \
                 fewer connections per thread",
                self.connections_per_thread_max
            ));
        }
        if self.requests_per_thread_max < self.window
            || self.requests_per_thread_max > REQUESTS_PER_THREAD_MAX
        {
            return invalid(format!(
                "requests_per_thread_max {} not in window..={REQUESTS_PER_THREAD_MAX}",
                self.requests_per_thread_max
            ));
        }
        let namespaces = self.effective_namespaces();
        if namespaces.len() > reflex_proto::native::NAMESPACE_COUNT_MAX {
            return invalid(format!("{} namespaces, at most 256", namespaces.len()));
        }
        for (index, namespace) in namespaces.iter().enumerate() {
            if namespace.id == 0 {
                return invalid("namespace id 0 is reserved".into());
            }
            if namespaces[..index]
                .iter()
                .any(|other| other.id == namespace.id)
            {
                return invalid(format!("namespace {} configured twice", namespace.id));
            }
            if CompositeSpec::is_composite(namespace.backend.trim()) {
                validate_composite(namespace, &namespaces[..index])?;
            }
        }
        if self.kv.enabled {
            match namespaces.iter().find(|ns| ns.id == self.kv.namespace) {
                None => {
                    return invalid(format!(
                        "[kv] namespace {} is not configured",
                        self.kv.namespace
                    ));
                }
                Some(namespace) if CompositeSpec::is_composite(namespace.backend.trim()) => {
                    return invalid(format!(
                        "[kv] namespace {} is composite: the table needs one device",
                        self.kv.namespace
                    ));
                }
                Some(namespace) if namespace.read_only => {
                    return invalid(format!(
                        "[kv] namespace {} is read-only: the table writes it",
                        self.kv.namespace
                    ));
                }
                Some(_) => {}
            }
            if let Some(tenant) = &self.kv.tenant
                && (tenant.is_empty() || tenant.len() > TENANT_NAME_BYTES_MAX)
            {
                return invalid(format!(
                    "[kv] tenant name {tenant:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes"
                ));
            }
        }
        for original in self.effective_original_ports() {
            if !namespaces.iter().any(|ns| ns.id == original.namespace) {
                return invalid(format!(
                    "original port {} serves namespace {}, which is not configured",
                    original.port, original.namespace
                ));
            }
            if let Some(tenant) = &original.tenant
                && (tenant.is_empty() || tenant.len() > TENANT_NAME_BYTES_MAX)
            {
                return invalid(format!(
                    "original port {}: tenant name {tenant:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes",
                    original.port
                ));
            }
        }
        if self.tenants.len() > TENANTS_CONFIGURED_MAX {
            return invalid(format!(
                "{} tenants declared, at most {TENANTS_CONFIGURED_MAX}",
                self.tenants.len()
            ));
        }
        for (index, tenant) in self.tenants.iter().enumerate() {
            if tenant.name.is_empty() || tenant.name.len() > TENANT_NAME_BYTES_MAX {
                return invalid(format!(
                    "tenant name {:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes",
                    tenant.name
                ));
            }
            if self.tenants[..index].iter().any(|t| t.name == tenant.name) {
                return invalid(format!("tenant {:?} declared twice", tenant.name));
            }
            tenant.spec().map_err(ConfigError::Invalid)?;
            if tenant.range_size == Some(0) {
                return invalid(format!("tenant {:?}: range_size is 0", tenant.name));
            }
            if let Some(us) = tenant.rt_alone_us
                && !(1..=RT_ALONE_US_MAX).contains(&us)
            {
                return invalid(format!(
                    "tenant {:?}: rt_alone_us {us} must be 1..={RT_ALONE_US_MAX} (one minute)",
                    tenant.name
                ));
            }
            // A namespace without a QoS profile charges everything to its default tenant: a
            // grant bound there would not be enforced, so it is refused rather than ignored.
            if !tenant.grant().is_unrestricted() {
                for namespace in &namespaces {
                    if namespace.profile.is_none()
                        && self.tenants_bound_to(namespace.id).contains(&tenant.name)
                    {
                        return invalid(format!(
                            "tenant {:?} has an access grant (access, range_offset, \
                             range_size) but is bound to namespace {}, which has no QoS \
                             profile and so no tenants but its default: give the namespace a \
                             profile",
                            tenant.name, namespace.id
                        ));
                    }
                }
            }
        }
        self.qos_config
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.limits().check().map_err(ConfigError::Invalid)?;
        self.admin.validate().map_err(ConfigError::Invalid)?;

        let names: Vec<String> = namespaces
            .iter()
            .map(NamespaceConfig::export_name)
            .collect();
        for (index, (namespace, name)) in namespaces.iter().zip(&names).enumerate() {
            if name.is_empty() || name.len() > EXPORT_NAME_BYTES_MAX || name.contains('\0') {
                return invalid(format!(
                    "namespace {}: export name {name:?} must be 1..={EXPORT_NAME_BYTES_MAX} bytes without NUL",
                    namespace.id
                ));
            }
            if names[..index].contains(name) {
                return invalid(format!(
                    "namespace {}: export name {name:?} is taken by another namespace",
                    namespace.id
                ));
            }
            if let Some(tenant) = &namespace.tenant
                && (tenant.is_empty() || tenant.len() > TENANT_NAME_BYTES_MAX)
            {
                return invalid(format!(
                    "namespace {}: tenant name {tenant:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes",
                    namespace.id
                ));
            }
        }
        let mut all_names = names.clone();
        for export in &self.nbd.exports {
            let name = &export.name;
            if name.is_empty() || name.len() > EXPORT_NAME_BYTES_MAX || name.contains('\0') {
                return invalid(format!(
                    "nbd.export {name:?}: the name must be 1..={EXPORT_NAME_BYTES_MAX} bytes without NUL"
                ));
            }
            if all_names.contains(name) {
                return invalid(format!(
                    "nbd.export {name:?}: the name is taken by another export or namespace"
                ));
            }
            if !namespaces
                .iter()
                .any(|namespace| namespace.id == export.namespace)
            {
                return invalid(format!(
                    "nbd.export {name:?}: no namespace {}",
                    export.namespace
                ));
            }
            if let Some(tenant) = &export.tenant
                && (tenant.is_empty() || tenant.len() > TENANT_NAME_BYTES_MAX)
            {
                return invalid(format!(
                    "nbd.export {name:?}: tenant name {tenant:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes"
                ));
            }
            all_names.push(name.clone());
        }
        if let Some(default) = &self.nbd.default_export
            && !all_names.contains(default)
        {
            return invalid(format!(
                "nbd.default_export {default:?} is not the name of any export"
            ));
        }
        if self.nvme_tcp.enabled {
            self.validate_nvme_tcp(&namespaces)?;
        }
        Ok(())
    }

    fn validate_nvme_tcp(&self, namespaces: &[NamespaceConfig]) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        let nvme = &self.nvme_tcp;
        if nvme.queue_entries_max < 2 || self.window < 2 {
            return invalid(format!(
                "nvme_tcp.queue_entries_max {} and window {} must be at least 2",
                nvme.queue_entries_max, self.window
            ));
        }
        let io_queues_max =
            reflex_dataplane::frontend::nvme_tcp_targets::IO_QUEUES_PER_CONTROLLER_MAX;
        if nvme.io_queues_max == 0 || nvme.io_queues_max > io_queues_max {
            return invalid(format!(
                "nvme_tcp.io_queues_max {} not in 1..={io_queues_max}",
                nvme.io_queues_max
            ));
        }
        if nvme.r2t_timeout.is_zero() {
            return invalid("nvme_tcp.r2t_timeout must be above 0".into());
        }
        let nqn_ok = |nqn: &str| {
            nqn.starts_with("nqn.")
                && nqn.len() <= NQN_BYTES_MAX
                && !nqn.contains('\0')
                && nqn != reflex_proto::nvme_tcp::command::DISCOVERY_NQN
        };
        let subsystems = self.effective_nvme_subsystems();
        for (index, subsystem) in subsystems.iter().enumerate() {
            if !nqn_ok(&subsystem.nqn) {
                return invalid(format!(
                    "nvme_tcp subsystem NQN {:?} must start with \"nqn.\", be at most {NQN_BYTES_MAX} bytes and not be the discovery NQN",
                    subsystem.nqn
                ));
            }
            if subsystems[..index]
                .iter()
                .any(|other| other.nqn == subsystem.nqn)
            {
                return invalid(format!(
                    "nvme_tcp subsystem {:?} configured twice",
                    subsystem.nqn
                ));
            }
            for id in self.nvme_subsystem_namespaces(subsystem) {
                if !namespaces.iter().any(|ns| ns.id == id) {
                    return invalid(format!(
                        "nvme_tcp subsystem {:?} serves namespace {id}, which is not configured",
                        subsystem.nqn
                    ));
                }
                if id == u32::MAX {
                    return invalid(format!(
                        "namespace id {id} is the NVMe broadcast id: NVMe/TCP cannot serve it"
                    ));
                }
            }
            for (position, host) in subsystem.hosts.iter().enumerate() {
                if host.nqn.is_empty() || host.nqn.len() > NQN_BYTES_MAX {
                    return invalid(format!(
                        "nvme_tcp subsystem {:?}: host NQN {:?} must be 1..={NQN_BYTES_MAX} bytes",
                        subsystem.nqn, host.nqn
                    ));
                }
                if subsystem.hosts[..position]
                    .iter()
                    .any(|other| other.nqn == host.nqn)
                {
                    return invalid(format!(
                        "nvme_tcp subsystem {:?}: host {:?} listed twice",
                        subsystem.nqn, host.nqn
                    ));
                }
                if let Some(tenant) = &host.tenant
                    && (tenant.is_empty() || tenant.len() > TENANT_NAME_BYTES_MAX)
                {
                    return invalid(format!(
                        "nvme_tcp host {:?}: tenant name {tenant:?} must be 1..={TENANT_NAME_BYTES_MAX} bytes",
                        host.nqn
                    ));
                }
                self.validate_nvme_host_key(&subsystem.nqn, host)?;
            }
            if subsystem.secure_channel && nvme.tls == TlsMode::Off {
                return invalid(format!(
                    "nvme_tcp subsystem {:?}: secure_channel needs nvme_tcp.tls = \"optional\" or \"require\"",
                    subsystem.nqn
                ));
            }
        }
        self.validate_nvme_discovery()?;
        if nvme.tls != TlsMode::Off
            && !subsystems
                .iter()
                .flat_map(|subsystem| subsystem.hosts.iter())
                .chain(nvme.discovery.hosts.iter())
                .any(NvmeHostConfig::has_tls_key)
        {
            return invalid(
                "nvme_tcp.tls: no [[nvme_tcp.subsystem.host]] or [[nvme_tcp.discovery.host]] has a psk or psk_file, so no host could connect over TLS"
                    .into(),
            );
        }
        Ok(())
    }

    /// `[nvme_tcp.discovery]`: hosts listed once, each with a key and no tenant (discovery
    /// does no I/O), and a secure channel only where TLS is on.
    fn validate_nvme_discovery(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        let discovery = &self.nvme_tcp.discovery;
        let discovery_nqn = reflex_proto::nvme_tcp::command::DISCOVERY_NQN;
        if discovery.secure_channel && self.nvme_tcp.tls == TlsMode::Off {
            return invalid(
                "nvme_tcp.discovery.secure_channel needs nvme_tcp.tls = \"optional\" or \"require\""
                    .into(),
            );
        }
        for (position, host) in discovery.hosts.iter().enumerate() {
            if host.nqn.is_empty() || host.nqn.len() > NQN_BYTES_MAX {
                return invalid(format!(
                    "nvme_tcp.discovery: host NQN {:?} must be 1..={NQN_BYTES_MAX} bytes",
                    host.nqn
                ));
            }
            if discovery.hosts[..position]
                .iter()
                .any(|other| other.nqn == host.nqn)
            {
                return invalid(format!(
                    "nvme_tcp.discovery: host {:?} listed twice",
                    host.nqn
                ));
            }
            if host.tenant.is_some() {
                return invalid(format!(
                    "nvme_tcp.discovery: host {:?} has a tenant, but discovery does no I/O",
                    host.nqn
                ));
            }
            if !host.has_tls_key() {
                return invalid(format!(
                    "nvme_tcp.discovery: host {:?} needs a psk or psk_file (it is listed only for its key)",
                    host.nqn
                ));
            }
            self.validate_nvme_host_key(discovery_nqn, host)?;
        }
        Ok(())
    }

    /// A host's TLS key: one of `psk` and `psk_file`, TLS on, and an inline key that parses
    /// (a key file is read and checked when the server starts and on SIGHUP).
    fn validate_nvme_host_key(
        &self,
        subsystem_nqn: &str,
        host: &NvmeHostConfig,
    ) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if host.psk.is_some() && host.psk_file.is_some() {
            return invalid(format!(
                "nvme_tcp subsystem {:?}, host {:?}: psk and psk_file both set: give one",
                subsystem_nqn, host.nqn
            ));
        }
        if host.has_tls_key() && self.nvme_tcp.tls == TlsMode::Off {
            return invalid(format!(
                "nvme_tcp subsystem {:?}, host {:?} has a TLS key: set nvme_tcp.tls = \"optional\" or \"require\"",
                subsystem_nqn, host.nqn
            ));
        }
        if let Some(text) = &host.psk
            && let Err(reason) = crate::tls::nvme_host_key(text, &host.nqn, subsystem_nqn)
        {
            return invalid(format!(
                "nvme_tcp subsystem {:?}, host {:?}: psk: {reason}",
                subsystem_nqn, host.nqn
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped configuration (`configs/`, the example) parses and validates, so that
    /// the commands in the docs that start reflexd with one run as written.
    #[test]
    fn every_shipped_configuration_is_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files: Vec<_> = std::fs::read_dir(root.join("configs"))
            .unwrap_or_else(|e| panic!("configs/: {e}"))
            .map(|entry| entry.unwrap_or_else(|e| panic!("{e}")).path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
            .collect();
        files.push(root.join("reflexd.example.toml"));
        assert!(files.len() > 5, "{files:?}");
        for file in files {
            let config = Config::from_file(&file).unwrap_or_else(|e| panic!("{e}"));
            config
                .validate()
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        }
    }

    #[test]
    fn defaults_are_valid_and_serve_a_file() {
        let config = Config::default();
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        let namespaces = config.effective_namespaces();
        assert_eq!(namespaces.len(), 1);
        assert_eq!(namespaces[0].backend, DEFAULT_NAMESPACE_BACKEND);
        assert_eq!(
            config.effective_original_ports()[0].port,
            ORIGINAL_PORT_DEFAULT
        );
        assert!(config.listen.is_loopback());
    }

    #[test]
    fn kv_section_parses_and_its_namespace_is_checked() {
        let text = r#"
            [kv]
            enabled = true
            port = 0
            namespace = 2
            tenant = "kv"
            format = true

            [[namespace]]
            id = 2
            backend = "mem:64M"
        "#;
        let config: Config = toml::from_str(text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            config.kv,
            KvConfig {
                enabled: true,
                port: 0,
                namespace: 2,
                tenant: Some("kv".into()),
                create: true,
                format: true,
                allow: None,
            }
        );
        let original_ports = Some(Vec::new());
        let valid = Config {
            original_ports,
            ..config
        };
        valid.validate().unwrap_or_else(|e| panic!("{e}"));
        let unknown = Config {
            kv: KvConfig {
                namespace: 3,
                ..valid.kv.clone()
            },
            ..valid.clone()
        };
        assert!(unknown.validate().is_err());
        let mut read_only = valid.clone();
        read_only.namespaces[0].read_only = true;
        assert!(read_only.validate().is_err());
        assert!(toml::from_str::<Config>("[kv]\nport_number = 1\n").is_err());
    }

    #[test]
    fn toml_file() {
        let text = r#"
            listen = "0.0.0.0"
            port = 7000
            threads = 2
            window = 64
            arena_bytes_per_thread = "16M"
            original_ports = [{ port = 1300, namespace = 2 }]

            [[namespace]]
            id = 1
            backend = "mem:1G"

            [[namespace]]
            id = 2
            backend = "file:/tmp/x"
            size_bytes = "10G"
            read_only = true
        "#;
        let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.port, 7000);
        assert_eq!(config.arena_bytes_per_thread, 16 << 20);
        assert_eq!(config.namespaces[1].size_bytes, Some(10 << 30));
        assert!(config.namespaces[1].read_only);
        assert_eq!(config.effective_original_ports()[0].port, 1300);
        assert_eq!(config.driver, DriverChoice::Auto);
        assert!(Config::from_toml("bogus = 1", "test").is_err());
    }

    #[test]
    fn access_control_keys() {
        let text = r#"
            allow = ["127.0.0.1/32", "::1/128"]
            original_ports = [{ port = 1300, namespace = 1, tenant = "viewer", allow = ["10.0.0.0/8"] }]

            [nbd]
            allow = ["192.168.0.0/16"]

            [nvme_tcp]
            allow = ["fd00::/8"]

            [admin]
            allow = ["127.0.0.0/8"]
            token_file = "/etc/reflex/admin.token"
            token_exempt = []
            allow_remote = true

            [[namespace]]
            id = 1
            backend = "mem:64M"
            profile = "p.toml"

            [[tenant]]
            name = "viewer"
            class = "be"
            access = "read-only"
            range_offset = "1M"
            range_size = "4M"

            [[tenant]]
            name = "writer"
            class = "be"
        "#;
        let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        let net = |text: &str| -> IpNet { text.parse().unwrap_or_else(|e| panic!("{e}")) };
        assert_eq!(
            config.allow,
            Some(vec![net("127.0.0.1/32"), net("::1/128")])
        );
        assert_eq!(config.nbd.allow, Some(vec![net("192.168.0.0/16")]));
        assert_eq!(config.nvme_tcp.allow, Some(vec![net("fd00::/8")]));
        let ports = config.effective_original_ports();
        assert_eq!(ports[0].allow, Some(vec![net("10.0.0.0/8")]));
        assert_eq!(config.admin.allow, Some(vec![net("127.0.0.0/8")]));
        assert!(config.admin.token_exempt.is_empty());
        assert_eq!(
            config.tenant("viewer").grant(),
            Grant {
                read_only: true,
                range: Some(ByteRange {
                    offset_bytes: 1 << 20,
                    length_bytes: 4 << 20,
                }),
            }
        );
        assert!(config.tenant("writer").grant().is_unrestricted());
        assert_eq!(
            config.grants().len(),
            1,
            "only restricted tenants have a grant"
        );
        // Defaults: no allow-lists, loopback needs no admin token.
        let plain = Config::default();
        assert_eq!(plain.allow, None);
        assert_eq!(plain.admin.token_exempt, crate::admin::loopback_nets());

        for (bad, expected) in [
            ("allow = [\"127.0.0.1/33\"]", "invalid"),
            ("allow = [\"localhost\"]", "invalid"),
            (
                "[[tenant]]\nname = \"t\"\nclass = \"be\"\naccess = \"write-only\"",
                "unknown variant",
            ),
            ("[admin]\nallow_remote = true", "token_file"),
            (
                "[[tenant]]\nname = \"t\"\nclass = \"be\"\nrange_size = 0",
                "range_size is 0",
            ),
            (
                "[[tenant]]\nname = \"t\"\nclass = \"be\"\nrt_alone_us = 0",
                "rt_alone_us 0 must be",
            ),
            (
                "[qos_config.fairness]\nmode = \"fair_share\"\nbe_device_depth_max = 4\n\
                 [qos_config.fairness.adaptive_depth]\nenabled = true\ndepth_min = 5",
                "adaptive_depth.depth_min",
            ),
            (
                "[[tenant]]\nname = \"t\"\nclass = \"be\"\nrt_alone_us = 60000001",
                "rt_alone_us 60000001 must be",
            ),
            (
                "[[namespace]]\nid = 1\nbackend = \"mem:1M\"\ntenant = \"t\"\n[[tenant]]\nname = \"t\"\nclass = \"be\"\naccess = \"read-only\"",
                "no QoS",
            ),
        ] {
            let error = Config::from_toml(bad, "test")
                .and_then(|config| config.validate().map(|()| config))
                .err()
                .unwrap_or_else(|| panic!("accepted: {bad}"));
            assert!(error.to_string().contains(expected), "{bad}: {error}");
        }
    }

    /// `bad` is refused with a message naming `expected` and never showing the key.
    fn refused_without_the_key(bad: &str, expected: &str) {
        let error = Config::from_toml(bad, "test")
            .and_then(|config| config.validate().map(|()| config))
            .err()
            .unwrap_or_else(|| panic!("accepted: {bad}"));
        let message = error.to_string();
        assert!(message.contains(expected), "{bad}: {message}");
        assert!(
            !message.contains("AAECAwQF"),
            "an error shows the key: {message}"
        );
    }

    #[test]
    fn nvme_tcp_tls_keys_are_checked() {
        const KEY: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
        let subsystem = |tls: &str, secure: bool, host_keys: &str| {
            format!(
                "[[namespace]]\nid = 1\nbackend = \"mem:1M\"\n[nvme_tcp]\ntls = \"{tls}\"\n\
                 [[nvme_tcp.subsystem]]\nnqn = \"nqn.2026-01.io.reflex:s\"\nsecure_channel = {secure}\n\
                 [[nvme_tcp.subsystem.host]]\nnqn = \"nqn.2026-01.io.reflex:h\"\n{host_keys}"
            )
        };
        let good = subsystem("require", true, &format!("psk = \"{KEY}\""));
        let config = Config::from_toml(&good, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert!(config.tls_in_use());
        // A 48-byte key (TLS_AES_256_GCM_SHA384).
        let good_48 = subsystem(
            "require",
            true,
            "psk = \"NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:\"",
        );
        let config = Config::from_toml(&good_48, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        for (bad, expected) in [
            (
                subsystem("off", false, &format!("psk = \"{KEY}\"")),
                "has a TLS key",
            ),
            (
                subsystem("optional", false, ""),
                "no [[nvme_tcp.subsystem.host]]",
            ),
            (subsystem("off", true, ""), "secure_channel needs"),
            (
                subsystem(
                    "optional",
                    false,
                    &format!("psk = \"{KEY}\"\npsk_file = \"k\""),
                ),
                "both set",
            ),
            (
                subsystem(
                    "optional",
                    false,
                    &format!("psk = \"{}S:\"", &KEY[..KEY.len() - 2]),
                ),
                "CRC-32",
            ),
            (
                // A 48-byte key under hash 01.
                subsystem(
                    "optional",
                    false,
                    "psk = \"NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:\"",
                ),
                "must be 32 or 48",
            ),
        ] {
            refused_without_the_key(&bad, expected);
        }
    }

    #[test]
    fn nvme_tcp_discovery_keys_are_checked() {
        const KEY: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
        let discovery = |tls: &str, secure: bool, hosts: &str| {
            format!(
                "[[namespace]]\nid = 1\nbackend = \"mem:1M\"\n[nvme_tcp]\ntls = \"{tls}\"\n\
                 [nvme_tcp.discovery]\nsecure_channel = {secure}\n{hosts}"
            )
        };
        let host = |nqn: &str, extra: &str| {
            format!("[[nvme_tcp.discovery.host]]\nnqn = \"{nqn}\"\n{extra}\n")
        };
        let keyed = host("nqn.2026-01.io.reflex:h", &format!("psk = \"{KEY}\""));
        // A discovery key alone is enough for TLS to be in use.
        let good = discovery("optional", true, &keyed);
        let config = Config::from_toml(&good, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert!(config.tls_in_use());
        assert!(config.nvme_tcp.discovery.secure_channel);
        assert_eq!(config.nvme_tcp.discovery.hosts.len(), 1);
        for (bad, expected) in [
            (discovery("off", false, &keyed), "has a TLS key"),
            (discovery("off", true, ""), "discovery.secure_channel needs"),
            (
                discovery("optional", false, &host("nqn.2026-01.io.reflex:h", "")),
                "needs a psk or psk_file",
            ),
            (
                discovery(
                    "optional",
                    false,
                    &host(
                        "nqn.2026-01.io.reflex:h",
                        &format!("psk = \"{KEY}\"\ntenant = \"t\""),
                    ),
                ),
                "discovery does no I/O",
            ),
            (
                discovery("optional", false, &format!("{keyed}{keyed}")),
                "listed twice",
            ),
            (
                discovery(
                    "optional",
                    false,
                    &host(
                        "nqn.2026-01.io.reflex:h",
                        &format!("psk = \"{}S:\"", &KEY[..KEY.len() - 2]),
                    ),
                ),
                "CRC-32",
            ),
        ] {
            refused_without_the_key(&bad, expected);
        }
    }

    #[test]
    fn driver_choice_from_the_file_and_the_flag() {
        for (text, expected) in [
            ("auto", DriverChoice::Auto),
            ("uring", DriverChoice::Uring),
            ("epoll", DriverChoice::Epoll),
        ] {
            let config = Config::from_toml(&format!("driver = {text:?}"), "test")
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(config.driver, expected);
            assert_eq!(text.parse::<DriverChoice>().ok(), Some(expected));
            assert_eq!(expected.to_string(), text);
        }
        assert_eq!(
            "io_uring".parse::<DriverChoice>().ok(),
            Some(DriverChoice::Uring)
        );
        assert!(Config::from_toml("driver = \"kqueue\"", "test").is_err());
        let refused = "kqueue"
            .parse::<DriverChoice>()
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            refused.as_deref(),
            Some("invalid configuration: driver \"kqueue\": expected one of auto, uring, epoll")
        );
    }

    #[test]
    fn flags() {
        let ns = NamespaceConfig::from_flag("3=file:/data/x,size=10G,ro")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ns.id, 3);
        assert_eq!(ns.backend, "file:/data/x");
        assert_eq!(ns.size_bytes, Some(10 << 30));
        assert!(ns.read_only);
        assert!(NamespaceConfig::from_flag("x=mem:1G").is_err());
        assert!(NamespaceConfig::from_flag("1=mem:1G,bogus").is_err());
        assert!(NamespaceConfig::from_flag("1").is_err());
        let port = OriginalPortConfig::from_flag("1300=2").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((port.port, port.namespace), (1300, 2));
        let port = OriginalPortConfig::from_flag("1300").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(port.namespace, 1);
        let ns = NamespaceConfig::from_flag("5=mem:1G,name=scratch,tenant=analytics")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ns.name.as_deref(), Some("scratch"));
        assert_eq!(ns.tenant.as_deref(), Some("analytics"));
        assert_eq!(ns.export_name(), "scratch");
        assert_eq!(NamespaceConfig::new(9, "null").export_name(), "ns9");
    }

    #[test]
    fn tenants_profiles_and_the_qos_switch() {
        let text = r#"
            qos = false
            original_ports = [{ port = 1300, namespace = 1, tenant = "legacy" }]

            [qos_config]
            deficit_limit_tokens = 20.0

            [[tenant]]
            name = "gold"
            class = "lc"
            latency_us_p95 = 500
            iops = 12000
            read_percent = 80

            [[tenant]]
            name = "legacy"
            class = "be"

            [[namespace]]
            id = 1
            backend = "emu:device-a-small"
            profile = "profiles/device-a-small.toml"
            tenant = "gold"
        "#;
        let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert!(!config.qos);
        assert_eq!(config.qos_config.deficit_limit_tokens, 20.0);
        assert_eq!(
            config.namespaces[0].profile.as_deref(),
            Some("profiles/device-a-small.toml")
        );
        assert_eq!(
            config.tenants_bound_to(1),
            vec!["gold".to_string(), "legacy".to_string()]
        );
        assert_eq!(
            config.tenant("gold").spec(),
            Ok(TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: 12_000,
                read_percent: 80
            })
        );
        assert_eq!(config.tenant("legacy").spec(), Ok(TenantSpec::BestEffort));

        let bad = |text: &str| {
            let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
            assert!(config.validate().is_err(), "{text}");
        };
        bad("[[tenant]]\nname = \"x\"\nclass = \"lc\"\niops = 5");
        bad("[[tenant]]\nname = \"x\"\nclass = \"be\"\niops = 5");
        bad("[[tenant]]\nname = \"x\"\nclass = \"be\"\n[[tenant]]\nname = \"x\"\nclass = \"be\"");
        bad("[qos_config]\ndonate_percent = 200");
        assert!(Config::from_toml("[[tenant]]\nname = \"x\"\nclass = \"gold\"", "t").is_err());
    }

    #[test]
    fn tenant_and_port_flags() {
        let tenant = TenantConfig::from_flag("gold=lc,latency_us=500,iops=12000,read_percent=80")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            tenant,
            TenantConfig::latency_critical("gold", 500, 12_000, 80)
        );
        let tenant = TenantConfig::from_flag("batch=be").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tenant, TenantConfig::best_effort("batch"));
        assert!(TenantConfig::from_flag("gold=lc,iops=5").is_err());
        assert!(TenantConfig::from_flag("gold=silver").is_err());
        assert!(TenantConfig::from_flag("gold").is_err());
        let port =
            OriginalPortConfig::from_flag("1300=2,tenant=gold").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            port,
            OriginalPortConfig {
                tenant: Some("gold".into()),
                ..OriginalPortConfig::new(1300, 2)
            }
        );
        assert!(OriginalPortConfig::from_flag("1300=2,gold").is_err());
        let ns = NamespaceConfig::from_flag("1=emu:device-a-small,profile=p.toml")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ns.profile.as_deref(), Some("p.toml"));
    }

    #[test]
    fn nbd_exports_and_tenants() {
        let text = r#"
            [nbd]
            port = 10900
            default_export = "scratch"

            [[namespace]]
            id = 1
            backend = "mem:1G"
            tenant = "gold"

            [[namespace]]
            id = 2
            backend = "mem:1G"
            name = "scratch"
            tenant = "bronze"

            [[namespace]]
            id = 3
            backend = "null"
            tenant = "gold"
        "#;
        let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert!(config.nbd.enabled);
        assert_eq!(config.nbd.port, 10900);
        assert_eq!(
            config.effective_default_export().as_deref(),
            Some("scratch")
        );
        assert_eq!(config.tenants_bound_to(1), vec!["gold".to_string()]);
        assert_eq!(config.tenants_bound_to(2), vec!["bronze".to_string()]);
        // Undeclared names are best-effort tenants.
        assert_eq!(config.tenant("gold"), TenantConfig::best_effort("gold"));
        let defaults = Config::default();
        assert_eq!(defaults.nbd.port, NBD_PORT_DEFAULT);
        assert_eq!(defaults.effective_default_export().as_deref(), Some("ns1"));
        assert!(defaults.tenants_bound_to(1).is_empty());
        let disabled =
            Config::from_toml("[nbd]\nenabled = false", "test").unwrap_or_else(|e| panic!("{e}"));
        assert!(!disabled.nbd.enabled);
        assert!(Config::from_toml("[nbd]\nbogus = 1", "test").is_err());
    }

    #[test]
    fn bad_export_names_and_tenants() {
        let bad = |namespaces: Vec<NamespaceConfig>, default_export: Option<&str>| {
            let config = Config {
                namespaces,
                nbd: NbdConfig {
                    default_export: default_export.map(str::to_string),
                    ..NbdConfig::default()
                },
                original_ports: Some(Vec::new()),
                ..Config::default()
            };
            assert!(config.validate().is_err(), "{config:?}");
        };
        let named = |id, name: &str| NamespaceConfig {
            name: Some(name.to_string()),
            ..NamespaceConfig::new(id, "null")
        };
        // A configured name colliding with another namespace's default name.
        bad(vec![NamespaceConfig::new(1, "null"), named(2, "ns1")], None);
        bad(vec![named(1, "")], None);
        bad(vec![named(1, "a\0b")], None);
        bad(vec![named(1, &"x".repeat(EXPORT_NAME_BYTES_MAX + 1))], None);
        bad(vec![NamespaceConfig::new(1, "null")], Some("nope"));
        let tenant = NamespaceConfig {
            tenant: Some(String::new()),
            ..NamespaceConfig::new(1, "null")
        };
        bad(vec![tenant], None);
    }

    #[test]
    fn a_configuration_beyond_the_completion_queue_is_refused() {
        // 17,000 connections per thread need 4 completions each in the worst case: more than
        // one ring holds. Refused at start, with the reason, instead of a panic under load.
        let config = Config {
            connections_per_thread_max: 17_000,
            ..Config::default()
        };
        assert!(config.ring_cq_entries() > RING_CQ_ENTRIES_MAX);
        let error = config
            .validate()
            .err()
            .unwrap_or_else(|| panic!("accepted"));
        assert!(error.to_string().contains("completion queue"), "{error}");
        // The default fits, and 10,000 connections per thread too.
        assert!(Config::default().ring_cq_entries() <= RING_CQ_ENTRIES_MAX);
        let ten_thousand = Config {
            connections_per_thread_max: 10_000,
            ..Config::default()
        };
        ten_thousand
            .validate()
            .unwrap_or_else(|e| panic!("10,000 connections per thread: {e}"));
    }

    #[test]
    fn dataplane_cpus_name_one_cpu_per_thread() {
        let refused = |threads: usize, cpus: Vec<usize>, expected: &str| {
            let config = Config {
                threads,
                dataplane_cpus: cpus,
                ..Config::default()
            };
            let error = config
                .validate()
                .err()
                .unwrap_or_else(|| panic!("accepted {:?}", config.dataplane_cpus));
            assert!(error.to_string().contains(expected), "{error}");
        };
        refused(2, vec![0], "names 1 CPUs for 2 dataplane threads");
        refused(1, vec![0, 1], "names 2 CPUs for 1 dataplane threads");
        refused(2, vec![3, 3], "CPU 3 twice");
        for cpus in [vec![], vec![1, 0]] {
            let config = Config {
                threads: 2,
                dataplane_cpus: cpus,
                ..Config::default()
            };
            config.validate().unwrap_or_else(|e| panic!("{e}"));
        }
        let parsed: Config = toml::from_str("threads = 2\ndataplane_cpus = [2, 3]\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parsed.dataplane_cpus, vec![2, 3]);
    }

    #[test]
    fn validation_catches_mistakes() {
        let bad = |config: Config| assert!(config.validate().is_err(), "{config:?}");
        bad(Config {
            threads: 0,
            ..Config::default()
        });
        bad(Config {
            window: 0,
            ..Config::default()
        });
        bad(Config {
            arena_bytes_per_thread: 1000,
            ..Config::default()
        });
        let ns = |id| NamespaceConfig::new(id, "null");
        bad(Config {
            namespaces: vec![ns(0)],
            ..Config::default()
        });
        bad(Config {
            namespaces: vec![ns(1), ns(1)],
            ..Config::default()
        });
        bad(Config {
            namespaces: vec![ns(2)],
            original_ports: Some(vec![OriginalPortConfig::new(1, 1)]),
            ..Config::default()
        });
    }
}

#[cfg(test)]
mod example_file {
    use super::*;

    #[test]
    fn scaling_is_off_by_default_and_its_knobs_are_checked() {
        let config = Config::from_toml("threads = 2\n", "test").unwrap_or_else(|e| panic!("{e}"));
        assert!(!config.scaling.enabled);
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        let text = "threads = 2\n[scaling]\nenabled = true\npark_below = 0.1\nwake_above = 0.5\n\
                    active_min = 2\n";
        let config = Config::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        assert!(config.scaling.enabled);
        assert_eq!(config.scaling.active_min, 2);
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        for bad in [
            "threads = 2\n[scaling]\npark_below = 0.7\nwake_above = 0.5\n",
            "threads = 2\n[scaling]\nactive_min = 3\n",
            "threads = 2\n[scaling]\nwindow_ms = 0\n",
        ] {
            let config = Config::from_toml(bad, "test").unwrap_or_else(|e| panic!("{e}"));
            assert!(config.validate().is_err(), "{bad}");
        }
        assert!(Config::from_toml("[scaling]\nthreshold = 1\n", "test").is_err());
    }

    #[test]
    fn the_shipped_example_parses_and_validates() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../reflexd.example.toml");
        let config = Config::from_file(Path::new(path)).unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.namespaces.len(), 3);
        // The state file is the default one, resolved against the example's folder.
        let folder = Path::new(path).parent().unwrap_or_else(|| panic!("{path}"));
        assert_eq!(
            config.admin.state_file,
            Some(folder.join("reflex-data/state.json").display().to_string())
        );
        assert_eq!(
            config,
            Config {
                namespaces: config.namespaces.clone(),
                original_ports: config.original_ports.clone(),
                admin: crate::admin::AdminConfig {
                    state_file: config.admin.state_file.clone(),
                    ..crate::admin::AdminConfig::default()
                },
                ..Config::default()
            }
        );
    }

    #[test]
    fn relative_paths_resolve_against_the_configuration_files_folder() {
        let directory = tempfile_dir();
        let path = directory.join("reflexd.toml");
        std::fs::write(
            &path,
            r#"
[admin]
state_file = "state/state.json"
[[namespace]]
id = 1
backend = "file:data/ns1"
profile = "../profiles/p.toml"
[[namespace]]
id = 2
backend = "disk.img"
[[namespace]]
id = 3
backend = "/abs/disk.img"
profile = "/abs/p.toml"
[[namespace]]
id = 4
backend = "mem:1M"
[[namespace]]
id = 5
backend = "emu:device-a-small"
[[namespace]]
id = 6
backend = "null"
"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let config = Config::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let at = |relative: &str| directory.join(relative).display().to_string();
        let backends: Vec<&str> = config
            .namespaces
            .iter()
            .map(|n| n.backend.as_str())
            .collect();
        assert_eq!(
            backends,
            [
                format!("file:{}", at("data/ns1")).as_str(),
                at("disk.img").as_str(),
                "/abs/disk.img",
                "mem:1M",
                "emu:device-a-small",
                "null"
            ]
        );
        assert_eq!(config.namespaces[0].profile, Some(at("../profiles/p.toml")));
        assert_eq!(config.namespaces[2].profile.as_deref(), Some("/abs/p.toml"));
        assert_eq!(config.admin.state_file, Some(at("state/state.json")));
        let _ = std::fs::remove_dir_all(&directory);
    }

    /// A fresh folder under the system's temporary directory (no dev-dependency needed).
    fn tempfile_dir() -> std::path::PathBuf {
        let directory = std::env::temp_dir().join(format!(
            "reflex-config-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&directory).unwrap_or_else(|e| panic!("{e}"));
        directory
    }
}
