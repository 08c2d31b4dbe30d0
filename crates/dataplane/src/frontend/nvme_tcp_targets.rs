//! What an NVMe/TCP listener serves, shared by every dataplane thread: the subsystems (NQN,
//! namespaces, the hosts allowed in and the tenant each host's I/O is charged to), the
//! transport's limits, and the table of live controllers.
//!
//! Why a shared table: a host attaches a controller with its admin queue's Connect and then
//! connects I/O queues to it, each a TCP connection that may land on any thread. The table is
//! touched only by Connect and by a connection's end (a mutex, off the data path); the data
//! path reads one atomic per command (whether the controller is ready). A controller lives as
//! long as its admin queue: when that connection ends (the host disconnects, or the keep-alive
//! timer expires), the controller is marked gone and its I/O queues close at their next
//! housekeeping sweep.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use reflex_proto::nvme_tcp::admin::{DiscoveryEntry, discovery};
use reflex_proto::nvme_tcp::command::{CNTLID_DYNAMIC, DISCOVERY_NQN};
use reflex_qos::Nanos;

use super::nvme_tcp_tls::NvmeTlsMode;
use crate::control::TenantRef;

/// Most controllers alive at once on one server.
pub const CONTROLLERS_MAX: usize = 1024;
/// I/O queues one controller may have (each a connection).
pub const IO_QUEUES_PER_CONTROLLER_MAX: u16 = 64;
/// Largest data transfer of one command: MDTS 8 (2^8 × 4 KiB), one buffer run.
pub const TRANSFER_BYTES_MAX: u32 = 1 << 20;
/// MDTS for [`TRANSFER_BYTES_MAX`].
pub const MDTS: u8 = 8;
/// In-capsule data an I/O queue command may carry (advertised in IOCCSZ).
pub const IN_CAPSULE_DATA_BYTES: u32 = 4096;
/// MAXH2CDATA when data digests are off: a command's data in one H2CData PDU, received
/// straight into its buffer run.
pub const MAXH2CDATA_BYTES: u32 = TRANSFER_BYTES_MAX;
/// MAXH2CDATA when data digests are on: every data PDU is checked whole in the receive
/// buffer before its data is copied to the run, so it must fit a gathered unit.
pub const MAXH2CDATA_DIGEST_BYTES: u32 = 4096;
/// Data of an admin or fabrics command that the target itself reads (Connect, Dataset
/// Management ranges, Set Features), in the capsule or by R2T.
pub const COMMAND_DATA_BYTES_MAX: u32 = 4096;

const _: () = assert!(TRANSFER_BYTES_MAX as usize == crate::buffers::RUN_SIZE_MAX);
const _: () = assert!(4096u32 << MDTS == TRANSFER_BYTES_MAX);
const _: () = assert!(MAXH2CDATA_DIGEST_BYTES >= reflex_proto::nvme_tcp::pdu::MAXH2CDATA_MIN);

/// The transport's settings, from the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeTcpOptions {
    /// Entries per queue (MQES + 1), at most the connection window.
    pub queue_entries_max: u16,
    /// I/O queues one controller may have.
    pub io_queues_max: u16,
    /// A host that does not send an R2T's data within this long loses its connection.
    pub r2t_timeout: Nanos,
    /// KATO when a host asks for none is kept as none (0: no keep-alive); a host's KATO
    /// below this is raised to it.
    pub keep_alive_timeout_min: Nanos,
    /// Serial number and model every controller reports.
    pub serial: String,
    pub model: String,
    /// Whether hosts may (or must) start TLS (`nvme_tcp_tls.rs`).
    pub tls_mode: super::nvme_tcp_tls::NvmeTlsMode,
}

impl Default for NvmeTcpOptions {
    fn default() -> NvmeTcpOptions {
        NvmeTcpOptions {
            queue_entries_max: 128,
            io_queues_max: 16,
            r2t_timeout: Nanos(30_000_000_000),
            keep_alive_timeout_min: Nanos(1_000_000_000),
            serial: "REFLEX0001".into(),
            model: "ReFlex reflexd".into(),
            tls_mode: super::nvme_tcp_tls::NvmeTlsMode::Off,
        }
    }
}

/// One namespace of a subsystem: its NSID there and the server's namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubsystemNamespace {
    pub nsid: u32,
    pub namespace_index: u16,
    pub read_only: bool,
    pub size_bytes: u64,
    pub block_size: u32,
    /// The device discards (deallocated blocks read as zeroes).
    pub discards: bool,
    /// NGUID and EUI-64 (stable across restarts: derived from the server's namespace id).
    pub nguid: [u8; 16],
}

/// A host allowed into a subsystem, and the tenant (per namespace of the subsystem, in its
/// order) its I/O is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAccess {
    pub nqn: String,
    pub tenants: Vec<TenantRef>,
    /// The host has a TLS key (TP 8011) for this subsystem: it connects over TLS only.
    pub tls_key: bool,
}

/// An NVM subsystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subsystem {
    pub nqn: String,
    pub namespaces: Vec<SubsystemNamespace>,
    /// Any host may connect (those not listed get `default_tenants`).
    pub allow_any_host: bool,
    pub hosts: Vec<HostAccess>,
    /// Per namespace: the tenant of hosts without their own (the namespace's configured
    /// tenant, or `NONE`: its default best-effort tenant).
    pub default_tenants: Vec<TenantRef>,
    /// Hosts connect over TLS only (a secure channel, `nvme_tcp_tls.rs`).
    pub secure_channel: bool,
}

impl Subsystem {
    /// The tenants a host's I/O is charged to, or `None` when it may not connect.
    pub fn tenants_for(&self, host_nqn: &str) -> Option<Vec<TenantRef>> {
        match self.hosts.iter().find(|host| host.nqn == host_nqn) {
            Some(host) => Some(host.tenants.clone()),
            None if self.allow_any_host => Some(self.default_tenants.clone()),
            None => None,
        }
    }

    pub fn namespace(&self, nsid: u32) -> Option<(usize, &SubsystemNamespace)> {
        self.namespaces
            .iter()
            .enumerate()
            .find(|(_, namespace)| namespace.nsid == nsid)
    }
}

/// Who must use TLS on the discovery subsystem (`[nvme_tcp.discovery]`): it has no hosts
/// list of its own (every host may ask for its discovery log), only keys and a requirement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoveryAccess {
    /// Hosts connect to the discovery subsystem over TLS only.
    pub secure_channel: bool,
    /// Hosts with a TLS key for the discovery subsystem: they connect to it over TLS only.
    pub hosts_with_keys: Vec<String>,
}

/// A controller's state as every queue sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ControllerState {
    /// CC.EN is 0: only fabrics and (on the admin queue) a few admin commands.
    Disabled = 0,
    Ready = 1,
    /// A shutdown notification arrived (CC.SHN): I/O is refused as the namespace not ready.
    ShuttingDown = 2,
    /// The admin queue ended or the controller was reset: its I/O queues close.
    Gone = 3,
}

/// One controller: who attached it, to what, and its queues.
#[derive(Debug)]
pub struct Controller {
    pub cntlid: u16,
    /// `None`: a discovery controller.
    pub subsystem: Option<usize>,
    pub host_nqn: String,
    pub host_id: [u8; 16],
    state: AtomicU8,
    queues: Mutex<IoQueues>,
}

#[derive(Debug)]
struct IoQueues {
    /// I/O queues granted by Set Features (Number of Queues).
    granted: u16,
    /// Whether each I/O queue id (index qid − 1) is connected.
    connected: Vec<bool>,
}

/// Why an I/O queue's Connect is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRefused {
    /// The queue id is 0, above the granted number, or connected already.
    InvalidQueue,
    /// The controller is not (or no longer) ready.
    NotReady,
}

impl Controller {
    pub fn state(&self) -> ControllerState {
        match self.state.load(Ordering::Acquire) {
            0 => ControllerState::Disabled,
            1 => ControllerState::Ready,
            2 => ControllerState::ShuttingDown,
            _ => ControllerState::Gone,
        }
    }

    pub fn set_state(&self, state: ControllerState) {
        // Gone is final.
        let _ = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                (current != ControllerState::Gone as u8).then_some(state as u8)
            });
    }

    /// I/O queues granted so far.
    pub fn granted_io_queues(&self) -> u16 {
        self.lock_queues().granted
    }

    /// Grants up to `wanted` I/O queues (Set Features: Number of Queues); `None` when I/O
    /// queues are connected already (the number cannot change then).
    pub fn grant_io_queues(&self, wanted: u16, max: u16) -> Option<u16> {
        let mut queues = self.lock_queues();
        if queues.connected.iter().any(|&connected| connected) {
            return None;
        }
        queues.granted = wanted.clamp(1, max);
        let granted = queues.granted;
        queues.connected = vec![false; usize::from(granted)];
        Some(granted)
    }

    /// Connects I/O queue `qid`.
    pub fn connect_io_queue(&self, qid: u16) -> Result<(), QueueRefused> {
        if self.state() != ControllerState::Ready {
            return Err(QueueRefused::NotReady);
        }
        let mut queues = self.lock_queues();
        let Some(slot) = usize::from(qid)
            .checked_sub(1)
            .and_then(|index| queues.connected.get_mut(index))
        else {
            return Err(QueueRefused::InvalidQueue);
        };
        if *slot {
            return Err(QueueRefused::InvalidQueue);
        }
        *slot = true;
        Ok(())
    }

    /// I/O queue `qid`'s connection ended.
    pub fn release_io_queue(&self, qid: u16) {
        let mut queues = self.lock_queues();
        if let Some(slot) = usize::from(qid)
            .checked_sub(1)
            .and_then(|index| queues.connected.get_mut(index))
        {
            *slot = false;
        }
    }

    fn lock_queues(&self) -> std::sync::MutexGuard<'_, IoQueues> {
        // A poisoned lock means a thread panicked holding it: the table is still consistent
        // (every update is one assignment), so carry on.
        self.queues
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Why an admin queue's Connect gets no controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachRefused {
    UnknownSubsystem,
    HostNotAllowed,
    /// The controller table is full.
    Busy,
}

/// Everything the NVMe/TCP listener serves.
#[derive(Debug)]
pub struct NvmeTcpTargets {
    pub options: NvmeTcpOptions,
    pub subsystems: Vec<Subsystem>,
    /// The listener's address (for the discovery log).
    pub listen: SocketAddr,
    /// TLS on the discovery subsystem.
    pub discovery: DiscoveryAccess,
    controllers: Mutex<Vec<Option<Arc<Controller>>>>,
    /// Counts controllers created (the discovery log's generation counter is constant).
    created: AtomicU64,
}

impl NvmeTcpTargets {
    pub fn new(options: NvmeTcpOptions, subsystems: Vec<Subsystem>, listen: SocketAddr) -> Self {
        NvmeTcpTargets {
            options,
            subsystems,
            listen,
            discovery: DiscoveryAccess::default(),
            controllers: Mutex::new(Vec::new()),
            created: AtomicU64::new(0),
        }
    }

    /// The same, with TLS on the discovery subsystem as `discovery` says.
    pub fn with_discovery(mut self, discovery: DiscoveryAccess) -> Self {
        self.discovery = discovery;
        self
    }

    /// The subsystem named `nqn` (`Ok(None)`: the discovery subsystem).
    pub fn subsystem_by_nqn(&self, nqn: &str) -> Result<Option<usize>, AttachRefused> {
        if nqn == DISCOVERY_NQN {
            return Ok(None);
        }
        self.subsystems
            .iter()
            .position(|subsystem| subsystem.nqn == nqn)
            .map(Some)
            .ok_or(AttachRefused::UnknownSubsystem)
    }

    /// Creates a controller for `host_nqn` on subsystem `subsystem` (an admin queue's
    /// Connect with the dynamic CNTLID).
    pub fn attach(
        &self,
        subsystem: Option<usize>,
        host_nqn: &str,
        host_id: [u8; 16],
    ) -> Result<Arc<Controller>, AttachRefused> {
        if let Some(index) = subsystem {
            let Some(found) = self.subsystems.get(index) else {
                return Err(AttachRefused::UnknownSubsystem);
            };
            if found.tenants_for(host_nqn).is_none() {
                return Err(AttachRefused::HostNotAllowed);
            }
        }
        let mut controllers = self.lock();
        let slot = match controllers.iter().position(Option::is_none) {
            Some(slot) => slot,
            None if controllers.len() < CONTROLLERS_MAX => {
                controllers.push(None);
                controllers.len() - 1
            }
            None => return Err(AttachRefused::Busy),
        };
        // CNTLIDs 1 ..= 0xFFEF; slot + 1 stays far below.
        let cntlid = (slot + 1) as u16;
        debug_assert!(cntlid < CNTLID_DYNAMIC);
        let controller = Arc::new(Controller {
            cntlid,
            subsystem,
            host_nqn: host_nqn.to_string(),
            host_id,
            state: AtomicU8::new(ControllerState::Disabled as u8),
            queues: Mutex::new(IoQueues {
                granted: self.options.io_queues_max,
                connected: vec![false; usize::from(self.options.io_queues_max)],
            }),
        });
        controllers[slot] = Some(Arc::clone(&controller));
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(controller)
    }

    /// The live controller `cntlid` of `host_nqn` on `subsystem` (an I/O queue's Connect).
    /// The host identifier is not compared, as the Linux target does not: some hosts (the
    /// TrueNAS Python initiator) send a fresh one on every Connect, and the tenant follows
    /// the host NQN anyway.
    pub fn find(
        &self,
        cntlid: u16,
        subsystem: Option<usize>,
        host_nqn: &str,
    ) -> Option<Arc<Controller>> {
        let controllers = self.lock();
        let controller = controllers
            .get(usize::from(cntlid).checked_sub(1)?)?
            .as_ref()?;
        let matches = controller.subsystem == subsystem
            && controller.host_nqn == host_nqn
            && controller.state() != ControllerState::Gone;
        matches.then(|| Arc::clone(controller))
    }

    /// The admin queue of `controller` ended: it is gone.
    pub fn detach(&self, controller: &Controller) {
        controller.set_state(ControllerState::Gone);
        let mut controllers = self.lock();
        if let Some(slot) = usize::from(controller.cntlid)
            .checked_sub(1)
            .and_then(|index| controllers.get_mut(index))
            && slot
                .as_ref()
                .is_some_and(|live| std::ptr::eq(live.as_ref(), controller))
        {
            *slot = None;
        }
    }

    /// Live controllers (for tests and metrics).
    pub fn controller_count(&self) -> usize {
        self.lock().iter().filter(|slot| slot.is_some()).count()
    }

    /// The discovery log entries `host_nqn` may see: the subsystems it may connect to.
    pub fn discovery_entries(&self, host_nqn: &str) -> Vec<DiscoveryEntry> {
        let address_family = if self.listen.is_ipv4() {
            discovery::ADRFAM_IPV4
        } else {
            discovery::ADRFAM_IPV6
        };
        self.subsystems
            .iter()
            .filter(|subsystem| subsystem.tenants_for(host_nqn).is_some())
            .map(|subsystem| {
                // TLS is what this host must use here: on a listener that requires it, on a
                // secure-channel subsystem, or where the host has a key (`nvme_tcp_tls.rs`
                // refuses its plaintext Connect). Elsewhere it names no security, so that a
                // host without a key is not sent to TLS (nvme-cli's connect-all follows
                // SECTYPE).
                let tls_required = self.options.tls_mode != NvmeTlsMode::Off
                    && (self.options.tls_mode == NvmeTlsMode::Require
                        || subsystem.secure_channel
                        || subsystem
                            .hosts
                            .iter()
                            .any(|host| host.nqn == host_nqn && host.tls_key));
                (subsystem, tls_required)
            })
            .map(|(subsystem, tls_required)| DiscoveryEntry {
                transport_type: discovery::TRTYPE_TCP,
                address_family,
                subsystem_type: discovery::SUBTYPE_NVM,
                transport_requirements: if tls_required {
                    discovery::TREQ_REQUIRED
                } else {
                    discovery::TREQ_NOT_REQUIRED
                },
                tcp_security_type: if tls_required {
                    discovery::SECTYPE_TLS13
                } else {
                    discovery::SECTYPE_NONE
                },
                port_id: 1,
                cntlid: CNTLID_DYNAMIC,
                admin_queue_size_max: self.options.queue_entries_max,
                service_id: self.listen.port().to_string(),
                subsystem_nqn: subsystem.nqn.clone(),
                address: self.listen.ip().to_string(),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Arc<Controller>>>> {
        self.controllers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
