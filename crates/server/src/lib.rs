//! `reflexd`, the ReFlex server: remote block storage over TCP with one io_uring dataplane
//! thread per core (ReFlex paper §3.1), or one epoll thread per core where io_uring is
//! unavailable.
//!
//! Public API:
//! - [`Config`] (with [`NamespaceConfig`], [`OriginalPortConfig`], [`NbdConfig`]): what to
//!   serve and how; from TOML ([`Config::from_file`]) and flags.
//! - [`Server::start`] opens the namespaces' devices, binds the listeners (native, original
//!   protocol, NBD; one `SO_REUSEPORT` socket per thread and port; port 0 picks a free port
//!   shared by all threads), starts the dataplane threads and returns a [`ServerHandle`] with
//!   the bound addresses.
//! - [`ServerHandle::shutdown`] behaves like SIGTERM: stop accepting, stop reading new
//!   requests (NBD sessions keep reading and answer ESHUTDOWN until their in-flight requests
//!   are done; NBD handshakes are closed), finish in-flight I/O and send its responses, flush
//!   every device, join. It returns each thread's [`CoreStats`], per-tenant figures included
//!   ([`TenantStats`], summed by [`tenant_totals`]), and logs one line per tenant.
//! - QoS: namespaces with a `profile` get the ReFlex token scheduler and admission control
//!   (`docs/QOS.md`); [`ServerHandle::tenant`], [`ServerHandle::tenants`],
//!   [`ServerHandle::qos_plan`] and [`ServerHandle::tenant_handle`] show the control plane's
//!   state.
//!
//! Module map: `config` (TOML and flags), `driver` (choosing and starting a thread's driver),
//! `uring` (the io_uring driver that runs each thread's [`reflex_dataplane::Dataplane`]),
//! `epoll` (the same over epoll, where io_uring is unavailable), `sys` (raw socket calls).
//! The dataplane itself (connections, requests, protocol front ends, tenants and schedulers)
//! is the sans-IO crate `reflex-dataplane`, which the simulator drives too.
//!
//! Architecture invariants: on io_uring the data path allocates nothing, takes no lock and
//! makes no system call besides one `io_uring_enter` per loop iteration (plus accept-time
//! socket options); on epoll it makes one `epoll_wait` per iteration plus one call per socket
//! operation (file I/O goes to the devices' thread pools); every limit is a named constant or
//! config field; bad input from the network gets an error status or closes only its own
//! connection, never panics the server. `unsafe` only in `uring`, `epoll::sys`, `sys` and `migration`.

#![deny(unsafe_code)]

pub mod admin;
pub mod config;
mod device_queues;
mod driver;
mod epoll;
pub mod metrics;
#[allow(unsafe_code)]
mod migration;
pub mod namespaces;
mod run_delay;
pub mod scaling;
#[allow(unsafe_code)]
mod sys;
pub mod tls;
mod uring;

pub use reflex_dataplane as dataplane;

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use reflex_dataplane::access::{AllowList, ListenerAccess};
use reflex_dataplane::control::{
    Catalog, ControlPlane, ControlSetup, HandleKeys, NamespaceControl, NamespaceQosSetup,
    TenantRef, Wake,
};
pub use reflex_dataplane::control::{ControlError, TenantInfo};
use reflex_dataplane::frontend::{ExportBinding, NbdExports, NvmeTcpTargets, Protocol};
use reflex_dataplane::namespaces::NamespaceSet;
pub use reflex_dataplane::{CoreStats, TenantStats};
use reflex_dataplane::{DataplaneSetup, TlsKeys, TlsSetup};
use reflex_qos::{DeviceProfile, Nanos};

pub use crate::config::{
    AccessConfig, Config, ConfigError, DriverChoice, NamespaceConfig, NbdConfig, NbdExportConfig,
    NvmeDiscoveryConfig, NvmeHostConfig, NvmeSubsystemConfig, NvmeTcpConfig, OriginalPortConfig,
    PriorityConfig, TenantClassConfig, TenantConfig, TimeoutsConfig,
};
pub use crate::driver::{Driver, NO_IO_URING_ENV};
use crate::driver::{DriverSetup, EventfdWaker, spawn_driver};
pub use crate::uring::MissingFeature;

/// Listen backlog of every listening socket.
pub const LISTEN_BACKLOG: i32 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "driver = \"uring\" was asked for, but {0}; driver = \"auto\" or \"epoll\" runs \
         on epoll instead"
    )]
    UringUnavailable(MissingFeature),
    #[error("namespace {id}: {source}")]
    Device {
        id: u32,
        source: reflex_flash::FlashError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("dataplane thread {thread}: {message}")]
    Thread { thread: usize, message: String },
    #[error("namespace {namespace_id}: cannot read QoS profile {path}: {reason}")]
    Profile {
        namespace_id: u32,
        path: String,
        reason: String,
    },
    #[error(transparent)]
    Qos(#[from] ControlError),
    #[error(transparent)]
    Admin(#[from] admin::AdminStartError),
    #[error(transparent)]
    Tls(#[from] tls::TlsSetupError),
}

/// Entry point; see the crate doc.
pub struct Server;

impl Server {
    pub fn start(config: Config) -> Result<ServerHandle, ServerError> {
        config.validate()?;
        let driver = Driver::select(config.driver).map_err(ServerError::UringUnavailable)?;
        // Ports first: a port another process holds stops start-up before any backing file
        // or directory is created.
        let mut per_thread: Vec<Vec<(TcpListener, ListenerRole)>> =
            (0..config.threads).map(|_| Vec::new()).collect();
        let native_addr = bind_all(
            SocketAddr::new(config.listen, config.port),
            ListenerRole::Native,
            &mut per_thread,
        )?;
        let mut original_addrs = Vec::new();
        for (position, original) in config.effective_original_ports().iter().enumerate() {
            let addr = bind_all(
                SocketAddr::new(config.listen, original.port),
                ListenerRole::Original(position),
                &mut per_thread,
            )?;
            original_addrs.push((original.namespace, addr));
        }
        let nbd_addr = if config.nbd.enabled {
            Some(bind_all(
                SocketAddr::new(config.listen, config.nbd.port),
                ListenerRole::Nbd,
                &mut per_thread,
            )?)
        } else {
            None
        };
        let nvme_tcp_addr = if config.nvme_tcp.enabled {
            Some(bind_all(
                SocketAddr::new(config.listen, config.nvme_tcp.port),
                ListenerRole::NvmeTcp,
                &mut per_thread,
            )?)
        } else {
            None
        };

        // The key-value port is bound on every thread like the others; thread 0 owns the
        // table and the other threads forward their requests' table steps to it
        // (`reflex_dataplane` `core/kv.rs`).
        let kv_addr = if config.kv.enabled {
            Some(bind_all(
                SocketAddr::new(config.listen, config.kv.port),
                ListenerRole::Kv,
                &mut per_thread,
            )?)
        } else {
            None
        };

        let namespaces = open_namespaces(&config)?;
        let mut kv_table = match kv_addr {
            Some(_) => {
                let (namespace_index, table) = open_kv_table(&config, &namespaces)?;
                Some((namespace_index, Some(table)))
            }
            None => None,
        };
        let clock_origin = Instant::now();

        let mut wakers = Vec::new();
        for thread in 0..config.threads {
            wakers.push(Arc::new(sys::eventfd().map_err(|e| {
                ServerError::Thread {
                    thread,
                    message: format!("eventfd: {e}"),
                }
            })?));
        }
        let control_wakers: Vec<Arc<dyn Wake>> = wakers
            .iter()
            .map(|file| Arc::new(EventfdWaker(Arc::clone(file))) as Arc<dyn Wake>)
            .collect();
        let (control, qos) =
            ControlPlane::start(&control_setup(&config)?, &namespaces, control_wakers)?;
        let control = Arc::new(control);
        control.set_grants(config.grants());
        control.set_configured_alone(config.rt_alone());
        let configured = |namespace_index: u16, name: Option<&String>| -> TenantRef {
            let Some(name) = name else {
                return TenantRef::NONE;
            };
            qos[usize::from(namespace_index)]
                .tenants
                .iter()
                .find(|(known, _)| known == name)
                .map_or(TenantRef::NONE, |(_, tenant)| *tenant)
        };

        let nbd_exports = if config.nbd.enabled {
            Some(Arc::new(nbd_exports(&config, &namespaces, &configured)?))
        } else {
            None
        };
        let nvme_tcp = match nvme_tcp_addr {
            Some(addr) => Some(Arc::new(nvme_tcp_targets(
                &config,
                &namespaces,
                &configured,
                addr,
            )?)),
            None => None,
        };
        let mut original_protocols = Vec::new();
        for original in config.effective_original_ports() {
            let Some(namespace_index) = namespaces.index_of(original.namespace) else {
                return Err(ConfigError::Invalid(format!(
                    "original port serves unknown namespace {}",
                    original.namespace
                ))
                .into());
            };
            original_protocols.push(Protocol::Original {
                namespace_index,
                tenant: configured(namespace_index, original.tenant.as_ref()),
                device_queue: device_queue_of(&config, original.tenant.as_ref()),
            });
        }
        control.set_catalog(Catalog {
            namespaces: Arc::clone(&namespaces),
            nbd_exports: nbd_exports.clone(),
        });
        let effective = config.effective_namespaces();
        let manager = Arc::new(namespaces::NamespaceManager::new(
            Arc::clone(&control),
            config.nbd.enabled,
            effective
                .iter()
                .map(|namespace| namespaces::NamespaceMeta {
                    export: namespace.export_name(),
                    device: namespace.backend.clone(),
                    runtime: None,
                })
                .collect(),
        ));
        // Namespaces and tenants created through the admin API in an earlier life, and SLO
        // changes of configured tenants, before any thread serves.
        let persistence = match (&config.admin.enabled, &config.admin.state_file) {
            (true, Some(path)) => {
                let file = admin::state_file::StateFile::new(path);
                let state = admin::restore(&control, &manager, &file)?;
                Some((file, state))
            }
            _ => None,
        };
        // What the threads start from: the configured namespaces and the restored ones.
        let (namespaces, nbd_exports) = match control.catalog() {
            Some(catalog) => (catalog.namespaces, catalog.nbd_exports),
            None => (namespaces, nbd_exports),
        };
        let qos: Vec<NamespaceQosSetup> = (0..namespaces.len())
            .filter_map(|index| control.qos_setup(index as u16))
            .collect();
        let effective_original_ports = config.effective_original_ports();
        let original_ports: Vec<u16> = original_addrs.iter().map(|(_, addr)| addr.port()).collect();
        let access_of = |role: ListenerRole| {
            let (name, allow) = match role {
                ListenerRole::Native => (format!("native:{}", native_addr.port()), &config.allow),
                ListenerRole::Original(position) => (
                    format!("original:{}", original_ports[position]),
                    &effective_original_ports[position].allow,
                ),
                ListenerRole::Nbd => (
                    format!("nbd:{}", nbd_addr.map_or(0, |addr| addr.port())),
                    &config.nbd.allow,
                ),
                ListenerRole::NvmeTcp => (
                    format!("nvme_tcp:{}", nvme_tcp_addr.map_or(0, |addr| addr.port())),
                    &config.nvme_tcp.allow,
                ),
                ListenerRole::Kv => (
                    format!("kv:{}", kv_addr.map_or(0, |addr| addr.port())),
                    &config.kv.allow,
                ),
            };
            ListenerAccess {
                name,
                allow: allow.clone().map(AllowList::new),
            }
        };
        let kv_protocol = kv_table.as_ref().map(|(namespace_index, _)| Protocol::Kv {
            namespace_index: *namespace_index,
            tenant: configured(*namespace_index, config.kv.tenant.as_ref()),
        });
        let protocol_of = |role: ListenerRole| match role {
            ListenerRole::Native => Protocol::Native,
            ListenerRole::Original(position) => original_protocols[position],
            ListenerRole::Nbd => Protocol::Nbd,
            ListenerRole::NvmeTcp => Protocol::NvmeTcp,
            ListenerRole::Kv => match kv_protocol {
                Some(protocol) => protocol,
                None => panic!("a KV listener without its table"),
            },
        };

        let shutdown = Arc::new(AtomicBool::new(false));
        let mut handle = ServerHandle {
            driver,
            native_addr,
            original_addrs,
            nbd_addr,
            nvme_tcp_addr,
            kv_addr,
            nvme_tcp: nvme_tcp.clone(),
            shutdown: Arc::clone(&shutdown),
            wakers: wakers.clone(),
            threads: Vec::new(),
            control: Arc::clone(&control),
            manager: Arc::clone(&manager),
            admin: None,
            tls: None,
            scaling: None,
            scaling_controller: None,
        };
        let tls_keys = tls::load(&config)?.map(|current| Arc::new(TlsKeys::new(current)));
        handle.tls = tls_keys
            .clone()
            .map(|keys| (keys, config.tls.clone(), config.nvme_tcp.tls));
        let limits = config.limits();
        let cq_entries = config.ring_cq_entries();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(usize, Result<bool, String>)>();
        // Inter-core migration: a bounded queue per ordered pair of threads, of the capacity
        // the dataplane's credits need (`Dataplane::migration_queue_capacity`).
        // Key-value requests' table steps use the same queues.
        let migration = &config.qos_config.fairness.migration;
        let kv_forwards = kv_table.is_some();
        let mut migration_links = if (migration.enabled || kv_forwards) && config.threads > 1 {
            let capacity = reflex_dataplane::exchange_queue_capacity(
                migration.in_transit_per_pair_max,
                namespaces.len(),
                limits.requests_max,
                kv_forwards,
            );
            migration::MigrationLinks::mesh(capacity, &wakers)
                .into_iter()
                .map(Some)
                .collect()
        } else {
            Vec::new()
        };
        // Thread scaling: one socket of each port every thread listens on steers new
        // connections (`scaling`).
        if config.threads > 1 {
            let mut steering = Vec::new();
            for (listener, _) in &per_thread[0] {
                steering.push(listener.try_clone().map_err(|e| ServerError::Thread {
                    thread: 0,
                    message: format!("listener for thread scaling: {e}"),
                })?);
            }
            handle.scaling = Some(scaling::ScalingControl::new(
                config.scaling,
                &wakers,
                steering,
                clock_origin,
            ));
        }
        for (thread_index, listeners) in per_thread.into_iter().enumerate() {
            let (sockets, roles): (Vec<TcpListener>, Vec<ListenerRole>) =
                listeners.into_iter().unzip();
            let tls = tls_keys.as_ref().map(|keys| TlsSetup {
                keys: Arc::clone(keys),
                listeners_tls: roles
                    .iter()
                    .map(|role| {
                        matches!(role, ListenerRole::Native)
                            && config.tls.native == config::TlsMode::Require
                    })
                    .collect(),
            });
            let dataplane_setup = DataplaneSetup {
                // Thread 0 owns the table; every thread serves the KV listener.
                kv: kv_table
                    .as_mut()
                    .map(|(namespace_index, table)| reflex_dataplane::KvSetup {
                        namespace_index: *namespace_index,
                        table: if thread_index == 0 {
                            table.take()
                        } else {
                            None
                        },
                        owner_thread: 0,
                    }),
                tls,
                thread_index,
                listener_access: roles.iter().copied().map(access_of).collect(),
                listeners: roles.into_iter().map(protocol_of).collect(),
                namespaces: Arc::clone(&namespaces),
                nbd_exports: nbd_exports.clone(),
                nvme_tcp: nvme_tcp.clone(),
                limits: limits.clone(),
                control: Arc::clone(&control),
                qos: qos.clone(),
                qos_config: config.qos_config.clone(),
                now: Nanos(clock_origin.elapsed().as_nanos() as u64),
            };
            let driver_setup = DriverSetup {
                listeners: sockets,
                namespaces: Arc::clone(&namespaces),
                poll: config.poll,
                register_buffers: config.register_buffers,
                shutdown: Arc::clone(&shutdown),
                waker: Arc::clone(&wakers[thread_index]),
                clock_origin,
                cq_entries,
                spin_before_deadline_max: Nanos(config.spin_before_deadline_max.as_nanos() as u64),
                migration: migration_links.get_mut(thread_index).and_then(Option::take),
                scaling: handle
                    .scaling
                    .as_ref()
                    .map(|scaling| scaling.thread(thread_index)),
                cpu: config.dataplane_cpus.get(thread_index).copied(),
            };
            let spawned = spawn_driver(driver, dataplane_setup, driver_setup, ready_tx.clone());
            match spawned {
                Ok(thread) => handle.threads.push(thread),
                Err(e) => {
                    return Err(ServerError::Thread {
                        thread: thread_index,
                        message: format!("spawn: {e}"),
                    });
                }
            }
        }
        drop(ready_tx);
        let mut registered = Vec::new();
        for _ in 0..config.threads {
            match ready_rx.recv() {
                Ok((_, Ok(is_registered))) => registered.push(is_registered),
                Ok((thread, Err(message))) => return Err(ServerError::Thread { thread, message }),
                Err(_) => {
                    return Err(ServerError::Thread {
                        thread: 0,
                        message: "exited during start".into(),
                    });
                }
            }
        }
        if let Some(scaling) = &handle.scaling
            && config.scaling.enabled
        {
            let stop = Arc::new(AtomicBool::new(false));
            let controller = scaling
                .spawn_controller(Arc::clone(&control), Arc::clone(&stop))
                .map_err(|e| ServerError::Thread {
                    thread: 0,
                    message: format!("spawn the scaling controller: {e}"),
                })?;
            handle.scaling_controller = Some((stop, controller));
        }
        if config.admin.enabled {
            handle.admin = Some(admin::start(admin::AdminSetup {
                config: config.admin.clone(),
                control: Arc::clone(&control),
                manager: Arc::clone(&manager),
                persistence,
                threads: config.threads,
                scaling: handle.scaling.clone(),
            })?);
        }
        log_startup(&config, driver, &namespaces, &handle, &registered, &qos);
        Ok(handle)
    }
}

/// What the control plane starts from: each namespace's profile (read from its file) and
/// the configured tenants bound to it.
fn control_setup(config: &Config) -> Result<ControlSetup, ServerError> {
    let mut namespaces = Vec::new();
    for namespace in config.effective_namespaces() {
        let bound_tenants = || {
            let mut tenants = Vec::new();
            for name in config.tenants_bound_to(namespace.id) {
                let spec = config
                    .tenant(&name)
                    .spec()
                    .map_err(|reason| ControlError::Qos {
                        namespace_id: namespace.id,
                        reason,
                    })?;
                tenants.push((name, spec));
            }
            Ok::<_, ControlError>(tenants)
        };
        if reflex_dataplane::composite::CompositeSpec::is_composite(namespace.backend.trim()) {
            // No profile of its own: its tenants are admitted on its members' devices.
            namespaces.push(NamespaceControl {
                namespace_id: namespace.id,
                profile: None,
                tenants: bound_tenants()?,
            });
            continue;
        }
        let Some(path) = &namespace.profile else {
            namespaces.push(NamespaceControl {
                namespace_id: namespace.id,
                profile: None,
                tenants: Vec::new(),
            });
            continue;
        };
        let profile_error = |reason: String| ServerError::Profile {
            namespace_id: namespace.id,
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| profile_error(e.to_string()))?;
        let profile = DeviceProfile::from_toml(&text).map_err(|e| profile_error(e.to_string()))?;
        namespaces.push(NamespaceControl {
            namespace_id: namespace.id,
            profile: Some(profile),
            tenants: bound_tenants()?,
        });
    }
    Ok(ControlSetup {
        threads: config.threads as u16,
        handles: HandleKeys::Random,
        tenant_limits: config.tenant_limits(),
        qos_config: config.qos_config.clone(),
        qos_enabled: config.qos,
        namespaces,
    })
}

/// The NBD export table: export `i` is namespace `i`, under its configured name, with its
/// size (rounded down to the 512-byte minimum block), read-only setting and tenant binding.
/// The device queue of the configured tenant `name`'s `priority`, if it has one.
fn device_queue_of(config: &Config, name: Option<&String>) -> Option<u16> {
    let name = name?;
    config
        .tenants
        .iter()
        .find(|tenant| &tenant.name == name)?
        .priority
        .map(config::PriorityConfig::submission_queue)
}

fn nbd_exports(
    config: &Config,
    namespaces: &NamespaceSet,
    configured: &dyn Fn(u16, Option<&String>) -> TenantRef,
) -> Result<NbdExports, ServerError> {
    use reflex_proto::nbd::{BlockSizes, Export};
    let minimum_bytes = u64::from(BlockSizes::default().minimum_bytes);
    let mut exports = Vec::new();
    for (index, namespace) in config.effective_namespaces().iter().enumerate() {
        let namespace_index = index as u16;
        assert_eq!(namespaces.id(namespace_index), namespace.id);
        let size_bytes = namespaces.size_bytes(namespace_index) / minimum_bytes * minimum_bytes;
        let mut export = Export::new(namespace.export_name(), size_bytes)
            .with_description(format!("reflexd namespace {}", namespace.id));
        if namespaces.native_table()[index].read_only {
            export = export.read_only();
        }
        let tenant = configured(namespace_index, namespace.tenant.as_ref());
        exports.push((
            export,
            ExportBinding {
                namespace_index,
                tenant,
                device_queue: device_queue_of(config, namespace.tenant.as_ref()),
            },
        ));
    }
    for extra in &config.nbd.exports {
        let Some(namespace_index) = namespaces.index_of(extra.namespace) else {
            return Err(ConfigError::Invalid(format!(
                "nbd.export {:?}: no namespace {}",
                extra.name, extra.namespace
            ))
            .into());
        };
        let size_bytes = namespaces.size_bytes(namespace_index) / minimum_bytes * minimum_bytes;
        let mut export = Export::new(extra.name.clone(), size_bytes).with_description(format!(
            "reflexd namespace {} for tenant {}",
            extra.namespace,
            extra.tenant.as_deref().unwrap_or("(default)")
        ));
        if namespaces.native_table()[usize::from(namespace_index)].read_only {
            export = export.read_only();
        }
        exports.push((
            export,
            ExportBinding {
                namespace_index,
                tenant: configured(namespace_index, extra.tenant.as_ref()),
                device_queue: device_queue_of(config, extra.tenant.as_ref()),
            },
        ));
    }
    let default_export = config.effective_default_export();
    let tls = match config.tls.nbd {
        config::TlsMode::Off => reflex_proto::nbd::TlsPolicy::Off,
        config::TlsMode::Optional => reflex_proto::nbd::TlsPolicy::Optional,
        config::TlsMode::Require => reflex_proto::nbd::TlsPolicy::Required,
    };
    let known: Vec<&str> = exports
        .iter()
        .map(|(export, _)| export.name.as_str())
        .collect();
    if let Some(unknown) = config
        .tls
        .nbd_tls_only_exports
        .iter()
        .find(|name| !known.contains(&name.as_str()))
    {
        return Err(ConfigError::Invalid(format!(
            "tls.nbd_tls_only_exports: no NBD export {unknown:?}"
        ))
        .into());
    }
    NbdExports::new(exports, default_export.as_deref())
        .and_then(|exports| {
            exports
                .with_tls(tls)
                .with_tls_only(config.tls.nbd_tls_only_exports.clone())
        })
        .map_err(|e| ConfigError::Invalid(format!("NBD exports: {e}")).into())
}

/// The NVMe/TCP subsystems: each namespace under its id as NSID, with its size (whole
/// blocks), and per host the tenant its configuration names (`docs/NVME-TCP.md`).
fn nvme_tcp_targets(
    config: &Config,
    namespaces: &NamespaceSet,
    configured: &dyn Fn(u16, Option<&String>) -> TenantRef,
    listen: SocketAddr,
) -> Result<NvmeTcpTargets, ServerError> {
    use reflex_dataplane::frontend::NvmeTlsMode;
    use reflex_dataplane::frontend::nvme_tcp_targets::{
        DiscoveryAccess, HostAccess, NvmeTcpOptions, Subsystem, SubsystemNamespace,
    };
    let effective = config.effective_namespaces();
    let mut subsystems = Vec::new();
    for subsystem in config.effective_nvme_subsystems() {
        let mut members = Vec::new();
        for id in config.nvme_subsystem_namespaces(&subsystem) {
            let Some(namespace_index) = namespaces.index_of(id) else {
                return Err(ConfigError::Invalid(format!(
                    "nvme_tcp subsystem {:?} serves unknown namespace {id}",
                    subsystem.nqn
                ))
                .into());
            };
            let info = namespaces.info(namespace_index);
            let block_size = info.block_size.max(512);
            let mut nguid = [0u8; 16];
            nguid[..6].copy_from_slice(b"REFLEX");
            nguid[12..].copy_from_slice(&id.to_be_bytes());
            members.push((
                namespace_index,
                SubsystemNamespace {
                    nsid: id,
                    namespace_index,
                    read_only: namespaces.is_read_only(namespace_index),
                    size_bytes: namespaces.size_bytes(namespace_index) / u64::from(block_size)
                        * u64::from(block_size),
                    block_size,
                    discards: info.supports_trim,
                    nguid,
                },
            ));
        }
        let namespace_tenant = |namespace_index: u16| {
            let name = effective
                .get(usize::from(namespace_index))
                .and_then(|namespace| namespace.tenant.as_ref());
            configured(namespace_index, name)
        };
        let default_tenants = members
            .iter()
            .map(|(index, _)| namespace_tenant(*index))
            .collect();
        let hosts = subsystem
            .hosts
            .iter()
            .map(|host| HostAccess {
                nqn: host.nqn.clone(),
                tls_key: host.has_tls_key(),
                tenants: members
                    .iter()
                    .map(|(index, _)| match &host.tenant {
                        Some(name) => configured(*index, Some(name)),
                        None => namespace_tenant(*index),
                    })
                    .collect(),
            })
            .collect();
        subsystems.push(Subsystem {
            nqn: subsystem.nqn.clone(),
            namespaces: members.into_iter().map(|(_, member)| member).collect(),
            allow_any_host: subsystem.allow_any_host,
            hosts,
            default_tenants,
            secure_channel: subsystem.secure_channel,
        });
    }
    let options = NvmeTcpOptions {
        queue_entries_max: config.nvme_queue_entries_max(),
        io_queues_max: config.nvme_tcp.io_queues_max,
        r2t_timeout: Nanos(config.nvme_tcp.r2t_timeout.as_nanos() as u64),
        keep_alive_timeout_min: Nanos(config.nvme_tcp.keep_alive_timeout_min.as_nanos() as u64),
        tls_mode: match config.nvme_tcp.tls {
            config::TlsMode::Off => NvmeTlsMode::Off,
            config::TlsMode::Optional => NvmeTlsMode::Optional,
            config::TlsMode::Require => NvmeTlsMode::Require,
        },
        ..NvmeTcpOptions::default()
    };
    let discovery = DiscoveryAccess {
        secure_channel: config.nvme_tcp.discovery.secure_channel,
        hosts_with_keys: (config.nvme_tcp.discovery.hosts.iter())
            .filter(|host| host.has_tls_key())
            .map(|host| host.nqn.clone())
            .collect(),
    };
    Ok(NvmeTcpTargets::new(options, subsystems, listen).with_discovery(discovery))
}

/// Opens every namespace's device in configuration order; a composite namespace is laid over
/// its members (declared before it, so slot order stays configuration order).
fn open_namespaces(config: &Config) -> Result<Arc<NamespaceSet>, ServerError> {
    use reflex_dataplane::composite::CompositeSpec;
    let mut set = NamespaceSet::new(Vec::new());
    for namespace in config.effective_namespaces() {
        let added = if CompositeSpec::is_composite(namespace.backend.trim()) {
            let spec = CompositeSpec::parse(namespace.backend.trim())
                .map_err(|e| ConfigError::Invalid(format!("namespace {}: {e}", namespace.id)))?;
            set.with_composite(namespace.id, &spec, namespace.read_only)
        } else {
            let device = open_device(&namespace)?;
            set.with_added(namespace.id, device, namespace.read_only)
        };
        set = added.map_err(|e| ConfigError::Invalid(e.to_string()))?;
    }
    Ok(Arc::new(set))
}

/// Opens (or formats, as `[kv]` says) the key-value table on its namespace, synchronously,
/// before the dataplane starts: `(namespace index, table state)`. Opening reads every bucket
/// block once and repairs what a crash between FLUSHes left (`reflex_kv::KvStore::open`).
fn open_kv_table(
    config: &Config,
    namespaces: &NamespaceSet,
) -> Result<(u16, reflex_kv::KvTable), ServerError> {
    let id = config.kv.namespace;
    let invalid = |reason: String| ServerError::from(ConfigError::Invalid(reason));
    let Some(namespace_index) = namespaces.index_of(id) else {
        return Err(invalid(format!("[kv] names unknown namespace {id}")));
    };
    if namespaces.is_read_only(namespace_index) {
        return Err(invalid(format!("[kv] namespace {id} is read-only")));
    }
    let Some(device) = namespaces.device(namespace_index) else {
        return Err(invalid(format!("[kv] namespace {id} has no device")));
    };
    let kv_error = |error: reflex_kv::KvError| invalid(format!("[kv] namespace {id}: {error}"));
    let blocks = || {
        reflex_kv::DeviceBlocks::new(Arc::clone(device))
            .map_err(|error| kv_error(reflex_kv::KvError::Io(error)))
    };
    let format = |blocks: reflex_kv::DeviceBlocks| {
        use reflex_kv::BlockStore;
        let geometry = reflex_kv::Geometry::for_device(blocks.block_count())
            .map_err(|error| kv_error(error.into()))?;
        tracing::info!(namespace = id, ?geometry, "formatting the key-value table");
        reflex_kv::KvStore::format(blocks, geometry).map_err(kv_error)
    };
    let store = if config.kv.format {
        format(blocks()?)?
    } else {
        match reflex_kv::KvStore::open(blocks()?) {
            Ok(store) => store,
            Err(reflex_kv::KvError::Corrupt(reflex_kv::layout::LayoutError::NotFormatted {
                ..
            })) if config.kv.create => format(blocks()?)?,
            Err(error) => return Err(kv_error(error)),
        }
    };
    tracing::info!(
        namespace = id,
        keys = store.len(),
        repaired_slots = store.repaired_slot_count(),
        "key-value table open"
    );
    let (_, table) = store.into_parts();
    Ok((namespace_index, table))
}

/// Opens a namespace's backend as start-up does (a run-time add too): the spec, then the
/// block-size check.
pub(crate) fn open_device(
    namespace: &NamespaceConfig,
) -> Result<Arc<dyn reflex_flash::Device>, ServerError> {
    {
        let options = reflex_flash::spec::OpenOptions {
            size_bytes: namespace.size_bytes,
            read_only: namespace.read_only,
        };
        let device = reflex_flash::spec::open(&namespace.backend, options).map_err(|source| {
            ServerError::Device {
                id: namespace.id,
                source,
            }
        })?;
        let block_size = device.info().block_size;
        if block_size > reflex_proto::native::BLOCK_SIZE_BYTES_DEFAULT {
            return Err(ServerError::Device {
                id: namespace.id,
                source: reflex_flash::FlashError::Open {
                    spec: namespace.backend.clone(),
                    reason: format!("block size {block_size} above the protocol's 512"),
                },
            });
        }
        Ok(device)
    }
}

/// Which front end a listening socket serves, before the namespaces are open (the original
/// protocol's by its position in the configured ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListenerRole {
    Native,
    Original(usize),
    Nbd,
    NvmeTcp,
    Kv,
}

/// Binds one listener per thread on `addr`; with port 0 the first bind picks the port and the
/// others share it through `SO_REUSEPORT`. Returns the bound address.
fn bind_all(
    addr: SocketAddr,
    role: ListenerRole,
    per_thread: &mut [Vec<(TcpListener, ListenerRole)>],
) -> Result<SocketAddr, ServerError> {
    if addr.port() != 0 {
        // SO_REUSEPORT would let this server silently share a port another process already
        // listens on (say, a second reflexd serving other data): the kernel would spread
        // clients between the two. A plain bind first refuses that with EADDRINUSE.
        drop(bind_exclusive(addr)?);
    }
    let mut bound = addr;
    for (thread, listeners) in per_thread.iter_mut().enumerate() {
        let listener = sys::bind_reuseport_listener(bound, LISTEN_BACKLOG).map_err(|source| {
            ServerError::Bind {
                addr: bound,
                source,
            }
        })?;
        if thread == 0 {
            bound = listener
                .local_addr()
                .map_err(|source| ServerError::Bind { addr, source })?;
        }
        listeners.push((listener, role));
    }
    Ok(bound)
}

/// How long start-up keeps retrying a port that is in use. A reflexd killed with SIGKILL
/// leaves its listening sockets open until the kernel has torn down its io_uring (an accept
/// in flight holds the socket), which takes up to a few hundred milliseconds after the
/// process is gone; a restart inside that window must wait, not fail.
pub const BIND_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(5);
const BIND_RETRY_INTERVAL: std::time::Duration = std::time::Duration::from_millis(25);

/// A plain (non-`SO_REUSEPORT`) bind of `addr`, retried for [`BIND_RETRY_FOR`] while the
/// address is in use.
fn bind_exclusive(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    let started = Instant::now();
    let mut logged = false;
    loop {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(listener),
            Err(source)
                if source.kind() == std::io::ErrorKind::AddrInUse
                    && started.elapsed() < BIND_RETRY_FOR =>
            {
                if !logged {
                    tracing::warn!(%addr, retry_for = ?BIND_RETRY_FOR,
                        "address in use (a previous reflexd may still be exiting); retrying");
                    logged = true;
                }
                std::thread::sleep(BIND_RETRY_INTERVAL);
            }
            Err(source) => return Err(ServerError::Bind { addr, source }),
        }
    }
}

fn log_startup(
    config: &Config,
    driver: Driver,
    namespaces: &NamespaceSet,
    handle: &ServerHandle,
    registered: &[bool],
    qos: &[NamespaceQosSetup],
) {
    let effective = config.effective_namespaces();
    for (index, setup) in qos.iter().enumerate() {
        let namespace_index = index as u16;
        let export = effective.get(index).map(NamespaceConfig::export_name);
        let tenant = effective.get(index).and_then(|ns| ns.tenant.clone());
        let tenant_handle = match &tenant {
            Some(name) => setup
                .tenants
                .iter()
                .find(|(known, _)| known == name)
                .map_or(0, |(_, tenant)| tenant.handle),
            None => setup.default_tenant.handle,
        };
        let composite = namespaces.composite(namespace_index).is_some();
        let qos_text = match effective.get(index).and_then(|ns| ns.profile.clone()) {
            _ if composite => "per member device (composite)".to_string(),
            Some(profile) if config.qos => format!("tokens ({profile})"),
            Some(profile) => format!("off: first in, first out ({profile})"),
            None => "none: no profile, first in, first out".to_string(),
        };
        tracing::info!(
            namespace = namespaces.id(namespace_index),
            size_bytes = namespaces.size_bytes(namespace_index),
            read_only = namespaces.native_table()[index].read_only,
            nbd_export = export.as_deref().unwrap_or_default(),
            tenant = tenant.as_deref().unwrap_or("(default)"),
            tenant_handle,
            qos = %qos_text,
            device = %namespaces.info(namespace_index).description,
            "namespace"
        );
        if let Some(plan) = handle.control.plan(namespace_index).filter(|_| !composite) {
            tracing::info!(
                namespace = namespaces.id(namespace_index),
                latency_us_p95 = ?plan.latency_us_p95,
                device_tokens_per_sec = plan.device_tokens_per_sec[0].as_tokens_per_sec_f64(),
                lc_reserved_tokens_per_sec = plan.lc_reserved_tokens_per_sec[0].as_tokens_per_sec_f64(),
                lc_tenants = plan.lc_tenants,
                "QoS plan"
            );
        }
    }
    let originals: Vec<String> = handle
        .original_addrs
        .iter()
        .map(|(namespace, addr)| format!("{addr} -> namespace {namespace}"))
        .collect();
    let registered_count = registered.iter().filter(|&&r| r).count();
    let nbd = match handle.nbd_addr {
        Some(addr) => addr.to_string(),
        None => "off".to_string(),
    };
    let nvme_tcp = match handle.nvme_tcp_addr {
        Some(addr) => addr.to_string(),
        None => "off".to_string(),
    };
    let kv = match handle.kv_addr {
        Some(addr) => addr.to_string(),
        None => "off".to_string(),
    };
    tracing::info!(
        native = %handle.native_addr,
        original = ?originals,
        nbd = %nbd,
        nvme_tcp = %nvme_tcp,
        kv = %kv,
        nbd_default_export = config.effective_default_export().unwrap_or_default(),
        threads = config.threads,
        driver = driver.name(),
        mode = if config.poll { "poll" } else { "blocking" },
        window = config.window,
        arena_bytes_per_thread = config.arena_bytes_per_thread,
        registered_buffers = %format!("{registered_count}/{} threads", registered.len()),
        "reflexd serving"
    );
}

/// A running server. Dropping it shuts the server down (like [`ServerHandle::shutdown`]).
pub struct ServerHandle {
    driver: Driver,
    native_addr: SocketAddr,
    original_addrs: Vec<(u32, SocketAddr)>,
    nbd_addr: Option<SocketAddr>,
    nvme_tcp_addr: Option<SocketAddr>,
    kv_addr: Option<SocketAddr>,
    nvme_tcp: Option<Arc<NvmeTcpTargets>>,
    shutdown: Arc<AtomicBool>,
    wakers: Vec<Arc<File>>,
    threads: Vec<JoinHandle<Result<CoreStats, String>>>,
    control: Arc<ControlPlane>,
    /// The namespaces (they change at run time).
    manager: Arc<namespaces::NamespaceManager>,
    /// The admin API's thread, when it serves.
    admin: Option<admin::AdminHandle>,
    /// What TLS sessions start with, and the `[tls]` the server started with.
    /// The keys and what used TLS at start: `[tls]` and `nvme_tcp.tls`.
    tls: Option<(Arc<TlsKeys>, config::TlsConfig, config::TlsMode)>,
    /// Thread scaling (several threads only), and its controller thread when automatic.
    scaling: Option<Arc<scaling::ScalingControl>>,
    scaling_controller: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl ServerHandle {
    /// Address of the admin API, when it serves.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(admin::AdminHandle::addr)
    }

    /// Thread scaling, when the server runs several threads.
    pub fn scaling(&self) -> Option<&Arc<scaling::ScalingControl>> {
        self.scaling.as_ref()
    }

    /// The I/O driver the dataplane threads run on.
    pub fn driver(&self) -> Driver {
        self.driver
    }

    /// Address of the native protocol listener.
    pub fn native_addr(&self) -> SocketAddr {
        self.native_addr
    }

    /// The commands an emulated device accepted on submission queue `queue` (its priority
    /// class's), `None` when namespace `namespace_id` is not an emulated device.
    pub fn emu_commands_in_queue(&self, namespace_id: u32, queue: u16) -> Option<u64> {
        let namespaces = self.namespaces();
        let index = namespaces.index_of(namespace_id)?;
        let controls = namespaces.device(index)?.emu_controls()?;
        Some(controls.commands_submitted_in(queue))
    }

    /// `(namespace id, address)` of every original-protocol listener.
    pub fn original_addrs(&self) -> &[(u32, SocketAddr)] {
        &self.original_addrs
    }

    /// Address of the NBD listener, unless NBD is disabled.
    pub fn nbd_addr(&self) -> Option<SocketAddr> {
        self.nbd_addr
    }

    /// Address of the key-value listener, when `[kv]` is enabled.
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.kv_addr
    }

    /// Address of the NVMe/TCP listener, unless NVMe/TCP is disabled.
    pub fn nvme_tcp_addr(&self) -> Option<SocketAddr> {
        self.nvme_tcp_addr
    }

    /// NVMe/TCP controllers alive now (0 without NVMe/TCP).
    pub fn nvme_tcp_controllers(&self) -> usize {
        self.nvme_tcp
            .as_ref()
            .map_or(0, |targets| targets.controller_count())
    }

    /// Asks every thread to drain and stop, without waiting.
    pub fn begin_shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        for waker in &self.wakers {
            EventfdWaker(Arc::clone(waker)).wake_eventfd();
        }
    }

    /// A tenant by its handle: name, SLO, connections per thread.
    pub fn tenant(&self, handle: u64) -> Option<TenantInfo> {
        self.control.tenant(handle)
    }

    /// Every tenant of every QoS namespace.
    pub fn tenants(&self) -> Vec<TenantInfo> {
        self.control.tenants()
    }

    /// The handle of a tenant on a namespace by name: a configured tenant, or `"(default)"`.
    pub fn tenant_handle(&self, namespace_id: u32, name: &str) -> Option<u64> {
        self.control
            .tenants()
            .into_iter()
            .find(|tenant| tenant.namespace_id == namespace_id && tenant.name == name)
            .map(|tenant| tenant.handle)
    }

    /// The run-time switches of a namespace's fault-injecting device (`None`: not a `fault:`
    /// backend, or no such namespace).
    pub fn fault_controls(
        &self,
        namespace_id: u32,
    ) -> Option<Arc<reflex_flash::fault::FaultControls>> {
        let namespaces = self.namespaces();
        let index = namespaces.index_of(namespace_id)?;
        namespaces.device(index)?.fault_controls()
    }

    /// The current allocation of a namespace's device (`None`: no QoS on it).
    pub fn qos_plan(&self, namespace_id: u32) -> Option<reflex_qos::Plan> {
        let index = self.namespaces().index_of(namespace_id)?;
        self.control.plan(index)
    }

    /// A namespace's online self-calibration: its statistics and last window (`None`: no
    /// such namespace, or not calibrated).
    pub fn calibration(
        &self,
        namespace_id: u32,
    ) -> Option<reflex_dataplane::self_calibration::CalibrationInfo> {
        self.control
            .calibration()
            .into_iter()
            .find_map(|(id, info)| (id == namespace_id).then_some(info))
    }

    /// The namespaces served now.
    pub fn namespaces(&self) -> Arc<NamespaceSet> {
        self.manager
            .namespaces()
            .unwrap_or_else(|| Arc::new(NamespaceSet::new(Vec::new())))
    }

    /// Namespaces removed at run time whose device some thread still holds (it closes once
    /// every thread has drained it).
    pub fn namespaces_removing(&self) -> usize {
        self.control.namespaces_removing()
    }

    /// Adds and removes namespaces at run time (what the admin API calls).
    pub fn namespace_manager(&self) -> &Arc<namespaces::NamespaceManager> {
        &self.manager
    }

    /// Whether some dataplane thread has exited (only after shutdown, or on a fatal error).
    pub fn any_thread_finished(&self) -> bool {
        self.threads.iter().any(|thread| thread.is_finished())
    }

    /// Shuts down like SIGTERM and waits: stop accepting and reading, finish in-flight I/O
    /// and responses, flush every device. Returns each thread's counters.
    pub fn shutdown(mut self) -> Result<Vec<CoreStats>, ServerError> {
        self.begin_shutdown();
        self.join()
    }

    fn join(&mut self) -> Result<Vec<CoreStats>, ServerError> {
        if let Some(mut admin) = self.admin.take() {
            admin.stop();
        }
        if let Some((stop, controller)) = self.scaling_controller.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = controller.join();
        }
        let mut stats = Vec::new();
        let mut first_error = None;
        for (thread, handle) in self.threads.drain(..).enumerate() {
            match handle.join() {
                Ok(Ok(core_stats)) => stats.push(core_stats),
                Ok(Err(message)) => {
                    first_error.get_or_insert(ServerError::Thread { thread, message });
                }
                Err(_) => {
                    first_error.get_or_insert(ServerError::Thread {
                        thread,
                        message: "panicked".into(),
                    });
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                self.log_tenants(&stats);
                Ok(stats)
            }
        }
    }

    /// One log line per tenant with what it did over the server's life.
    fn log_tenants(&self, stats: &[CoreStats]) {
        for (handle, totals) in tenant_totals(stats) {
            tracing::info!(
                handle,
                tenant = %self.control.name(handle),
                namespace = totals.namespace_id,
                requests = totals.requests,
                arrivals = totals.arrivals,
                bytes = totals.bytes,
                tokens = totals.millitokens as f64 / 1000.0,
                deficit_episodes = totals.deficit_episodes,
                scheduler_wait_us_mean = totals.scheduler_wait_ns as f64 / 1e3 / totals.requests.max(1) as f64,
                scheduler_wait_us_max = totals.scheduler_wait_ns_max as f64 / 1e3,
                device_us_mean = totals.device_ns as f64 / 1e3 / totals.requests.max(1) as f64,
                "tenant totals"
            );
        }
    }
}

/// Per-tenant figures summed over threads, by handle.
pub fn tenant_totals(stats: &[CoreStats]) -> BTreeMap<u64, TenantStats> {
    let mut totals: BTreeMap<u64, TenantStats> = BTreeMap::new();
    for tenant in stats.iter().flat_map(|thread| &thread.tenants) {
        let total = totals.entry(tenant.handle).or_insert_with(|| TenantStats {
            handle: tenant.handle,
            namespace_id: tenant.namespace_id,
            ..TenantStats::default()
        });
        total.add(tenant);
    }
    totals
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.begin_shutdown();
            let _ = self.join();
        }
    }
}

/// `reflexd --check-config`: validates the configuration as start-up would, without opening
/// a device or a port: every field, each QoS profile read and parsed, the configured tenants
/// admitted against it, and the state file (when the admin API keeps one) parsed.
pub fn check_config(config: &Config) -> Result<(), ServerError> {
    config.validate()?;
    let setup = control_setup(config)?;
    for namespace in &setup.namespaces {
        let Some(profile) = &namespace.profile else {
            continue;
        };
        let qos = |reason: String| ControlError::Qos {
            namespace_id: namespace.namespace_id,
            reason,
        };
        let mut registry = reflex_qos::TenantRegistry::new(
            profile.clone(),
            setup.qos_config.clone(),
            setup.threads,
        )
        .map_err(|e| qos(e.to_string()))?;
        for (name, spec) in &namespace.tenants {
            registry
                .register(*spec)
                .map_err(|error| ControlError::Refused {
                    namespace_id: namespace.namespace_id,
                    name: name.clone(),
                    reason: error.to_string(),
                })?;
        }
    }
    if config.admin.enabled
        && let Some(path) = &config.admin.state_file
    {
        admin::state_file::StateFile::new(path)
            .load()
            .map_err(admin::AdminStartError::from)?;
    }
    Ok(())
}

/// What a reload of the configured tenants did ([`ServerHandle::reload_tenants`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReloadReport {
    /// Configured tenants whose SLO changed (admission ran again and admitted it).
    pub changed: u32,
    pub unchanged: u32,
    /// Changes refused (an SLO admission refused, a new binding or namespace that cannot be
    /// made): what was there stays; each is logged with the reason.
    pub refused: u32,
    /// Tenants newly bound to a namespace (admitted).
    pub bound: u32,
    /// Configured tenants whose binding left the configuration (their connections' I/O is
    /// refused from now on).
    pub unbound: u32,
    /// `[[namespace]]` tables that are new: added like the admin API adds one.
    pub namespaces_added: u32,
    /// NBD exports whose new sessions are charged to another tenant now.
    pub exports_rebound: u32,
    /// Configured tenants whose grant (`access`, `range_offset`, `range_size`) changed: in
    /// force for their connections from each thread's next iteration.
    pub grants_changed: u32,
    /// Configured tenants whose `rt_alone_us` changed: the fairness monitors use it from
    /// their next window.
    pub rt_alone_changed: u32,
    /// What a reload cannot change (a namespace gone from the file, a changed backend):
    /// each is logged.
    pub needs_restart: u32,
}

impl ServerHandle {
    /// Reads `config`'s `[tls]` files again (SIGHUP): new TLS sessions use the new
    /// certificate, key and client CA, and the new tenant bindings as identities; sessions
    /// already running keep theirs. Which protocols use TLS takes a restart (an error says
    /// so, and nothing changes).
    pub fn reload_tls(&self, config: &Config) -> Result<bool, tls::TlsSetupError> {
        let Some((keys, started, nvme_started)) = &self.tls else {
            if config.tls_in_use() {
                return Err(tls::TlsSetupError::Rustls(
                    "TLS was off at start: turning it on takes a restart".to_string(),
                ));
            }
            return Ok(false);
        };
        if (config.tls.native, config.tls.nbd, config.nvme_tcp.tls)
            != (started.native, started.nbd, *nvme_started)
        {
            return Err(tls::TlsSetupError::Rustls(
                "tls.native, tls.nbd and nvme_tcp.tls take a restart to change".to_string(),
            ));
        }
        let Some(current) = tls::load(config)? else {
            return Ok(false);
        };
        keys.replace(current);
        Ok(true)
    }

    /// Applies `config`'s namespaces and tenant bindings (SIGHUP) without touching a
    /// connection: a new `[[namespace]]` is added (as `POST /v1/namespaces` would, without
    /// persisting it: the file has it); each tenant bound to a namespace in the file that is
    /// not bound yet is admitted; NBD exports charge new sessions to the tenants the file names
    /// now; a configured tenant whose binding left the file is unbound (its connections' I/O is
    /// refused, as after the admin API's tenant delete); a changed SLO goes through admission
    /// again, its rates reaching the threads before their next scheduling round. Tenants made
    /// through the admin API or over the wire are left alone; a namespace gone from the file
    /// stays (remove it through the admin API); original-protocol ports and NVMe/TCP hosts keep
    /// the tenant they started with until a restart.
    pub fn reload_tenants(&self, config: &Config) -> ReloadReport {
        // Grants first: a tenant bound below takes its grant when it is registered.
        let mut report = ReloadReport {
            grants_changed: self.control.set_grants(config.grants()) as u32,
            rt_alone_changed: self.control.set_configured_alone(config.rt_alone()) as u32,
            ..ReloadReport::default()
        };
        let effective = config.effective_namespaces();
        for namespace in &effective {
            if self.namespaces().index_of(namespace.id).is_none() {
                // Its tenant is bound below, and its export rebound to it, like any binding.
                let mut plain = namespace.clone();
                plain.tenant = None;
                match self.manager.add(&plain, false) {
                    Ok(_) => {
                        tracing::info!(namespace = namespace.id, "reload: namespace added");
                        report.namespaces_added += 1;
                    }
                    Err(error) => {
                        tracing::warn!(namespace = namespace.id, %error,
                            "reload: new namespace refused");
                        report.refused += 1;
                        continue;
                    }
                }
            }
            let bound = config.tenants_bound_to(namespace.id);
            for name in &bound {
                let spec = match config.tenant(name).spec() {
                    Ok(spec) => spec,
                    Err(reason) => {
                        tracing::warn!(tenant = %name, %reason, "reload: tenant not valid");
                        report.refused += 1;
                        continue;
                    }
                };
                let Some(handle) = self.control.find_tenant(namespace.id, name) else {
                    match self.control.bind_configured(namespace.id, name, spec) {
                        Ok(handle) => {
                            tracing::info!(namespace = namespace.id, tenant = %name, handle,
                                ?spec, "reload: tenant bound");
                            report.bound += 1;
                        }
                        Err(error) => {
                            tracing::warn!(namespace = namespace.id, tenant = %name, %error,
                                "reload: new binding refused");
                            report.refused += 1;
                        }
                    }
                    continue;
                };
                if self.control.tenant(handle).map(|info| info.spec) == Some(spec) {
                    report.unchanged += 1;
                    continue;
                }
                match self.control.admin_update(namespace.id, name, spec) {
                    Ok(_) => {
                        tracing::info!(namespace = namespace.id, tenant = %name, ?spec,
                            "reload: tenant's SLO changed");
                        report.changed += 1;
                    }
                    Err(error) => {
                        tracing::warn!(namespace = namespace.id, tenant = %name, %error,
                            "reload: SLO change refused; the old SLO stays");
                        report.refused += 1;
                    }
                }
            }
            // The namespace's NBD exports charge new sessions to the tenants the file names now
            // (an unbound tenant's export would refuse every new session otherwise).
            let mut exports = vec![(namespace.export_name(), namespace.tenant.clone())];
            exports.extend(
                config
                    .nbd
                    .exports
                    .iter()
                    .filter(|export| export.namespace == namespace.id)
                    .map(|export| (export.name.clone(), export.tenant.clone())),
            );
            for (export, tenant) in exports {
                let tenant_ref = match &tenant {
                    None => TenantRef::NONE,
                    Some(name) => match self.control.find_tenant(namespace.id, name) {
                        Some(handle) => self.control.tenant_ref(handle),
                        None => continue,
                    },
                };
                if self.control.rebind_export(
                    &export,
                    tenant_ref,
                    device_queue_of(config, tenant.as_ref()),
                ) {
                    tracing::info!(namespace = namespace.id, nbd_export = %export,
                        tenant = tenant.as_deref().unwrap_or("(default)"),
                        "reload: NBD export rebound");
                    report.exports_rebound += 1;
                }
            }
            let stale: Vec<String> = self
                .control
                .tenants()
                .into_iter()
                .filter(|info| {
                    info.namespace_id == namespace.id
                        && !info.dynamic
                        && info.name != "(default)"
                        && !self.control.is_managed(info.handle)
                        && !bound.contains(&info.name)
                })
                .map(|info| info.name)
                .collect();
            for name in stale {
                match self.control.unbind_configured(namespace.id, &name) {
                    Ok(()) => {
                        tracing::info!(namespace = namespace.id, tenant = %name,
                            "reload: binding left the configuration; tenant unbound");
                        report.unbound += 1;
                    }
                    Err(error) => {
                        tracing::warn!(namespace = namespace.id, tenant = %name, %error,
                            "reload: cannot unbind");
                        report.refused += 1;
                    }
                }
            }
        }
        let namespaces = self.namespaces();
        for index in namespaces.live_indices() {
            let id = namespaces.id(index);
            let runtime = self
                .manager
                .meta(index)
                .is_some_and(|meta| meta.runtime.is_some());
            if !runtime && !effective.iter().any(|namespace| namespace.id == id) {
                tracing::warn!(
                    namespace = id,
                    "reload: the namespace left the configuration; it stays until removed through the admin API or a restart"
                );
                report.needs_restart += 1;
            }
        }
        report
    }
}
