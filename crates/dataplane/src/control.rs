//! The control plane: tenants, admission control and the messages that keep every dataplane
//! thread's QoS schedulers in step (`docs/QOS.md`, "In reflexd").
//!
//! Why a mutex and mailboxes rather than a thread of its own: control requests (REGISTER,
//! UNREGISTER, BIND, a connection's first I/O to a namespace, its close, a deficit episode)
//! are rare next to I/O, and the thread that receives one must see its effect before it reads
//! the next request of that connection (a BIND followed by a READ in the same receive must
//! charge the READ to the new tenant). So the receiving dataplane thread performs the change
//! itself, under [`ControlPlane`]'s lock, off the I/O path: it first takes every message
//! still waiting for it (so messages reach each thread in the order they were made), changes
//! the registries, and gets back the messages meant for itself to apply at once; messages for
//! other threads go to their mailboxes, and the threads are woken through their eventfds.
//! Each dataplane iteration checks one atomic flag and applies at most
//! [`MESSAGES_PER_ITERATION_MAX`] waiting messages.
//!
//! Tenants: each namespace with a QoS profile has one `reflex_qos::TenantRegistry` (one
//! device, one admission budget). Every tenant has a **handle** (a u64 that is unguessable:
//! a keyed hash of a counter, with a key from the operating system, never 0, never reused)
//! that names it on the wire and is the capability to BIND to it; the registry's dense `TenantId` (reused
//! after UNREGISTER) names it inside that namespace's schedulers. Tenants come from three
//! places: the namespace's default best-effort tenant (registered at startup; what
//! connections that never BIND are charged to), tenants declared in the configuration and
//! bound to the namespace or to an original-protocol port (admitted at startup: a refusal
//! stops the server), and REGISTER requests (admitted at run time; the only ones UNREGISTER
//! may remove).
//!
//! Tenants registered over the wire belong to the connection that registered them: only it may
//! change or UNREGISTER them; one connection may own at most
//! [`TenantLimits::per_connection_max`] and one source address
//! [`TenantLimits::per_source_max`]; when the owner closes, its tenants live on for
//! [`TenantLimits::orphan_grace`] (so a client that reconnects can BIND again) and are then
//! unregistered, unless a connection still counts for them.
//!
//! Namespaces at run time: the plane holds the catalog the threads serve ([`Catalog`]: the
//! namespace slots and the NBD exports). [`ControlPlane::add_namespace`] and
//! [`ControlPlane::remove_namespace`] make a new catalog and send every thread a
//! [`ControlMessage::Namespaces`] ahead of any rate update of the slot; a thread adopts it
//! (`core::catalog`), and reports a removed slot drained ([`ControlPlane::namespace_drained`])
//! once none of its requests uses it; when every thread has, the slot is gone and the catalog
//! drops its device.
//!
//! Invariants: a handle maps to exactly one live (namespace, `TenantId`) pair; a connection
//! is counted in a registry (`connect`) exactly while it is in its connection's charge list
//! (`core.rs`); lock order is state, then a mailbox.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use reflex_proto::native::{
    RegisterBody, RenegotiateBody, RenegotiateReason, Status, TenantClassRequest,
};
use reflex_qos::{
    Action, DeviceProfile, DeviceShared, LoadMode, Nanos, Notice, Plan, Policy, QosConfig,
    RateUpdate, SchedulerEvent, TenantId, TenantRegistry, TenantSpec, TokenLimit,
};

use crate::access::Grant;
use crate::composite::{Composite, CompositeLayout};
use crate::core::TelemetryWindow;
use crate::frontend::{ExportBinding, NbdExports};
use crate::namespaces::{NamespaceSet, SlotState};
use crate::self_calibration::{CalibrationInfo, DeviceCalibration};

/// A RENEGOTIATE notice as the control plane makes it (encoded by the native front end).
pub type NoticeBody = RenegotiateBody;

/// Control messages one dataplane iteration applies at most (the rest wait for the next).
pub const MESSAGES_PER_ITERATION_MAX: usize = 64;
/// Longest REFUSED reason sent on the wire (longer ones are cut at a character boundary).
pub const REASON_BYTES_MAX: usize = 1024;

/// A tenant as the dataplane addresses it: the wire handle and the registry's id inside its
/// namespace. [`TenantRef::NONE`] stands for "no tenant chosen": the namespace's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantRef {
    pub handle: u64,
    pub id: u32,
}

impl TenantRef {
    pub const NONE: TenantRef = TenantRef { handle: 0, id: 0 };

    pub fn is_none(self) -> bool {
        self.handle == 0
    }
}

/// What the control plane tells one dataplane thread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ControlMessage {
    /// A rate update for this thread's scheduler of a namespace.
    Rates {
        namespace_index: u16,
        update: RateUpdate,
    },
    /// The tenant was unregistered: I/O on connections bound to it is refused (PERMISSION)
    /// from now on, and they no longer count as its connections.
    Revoke { handle: u64 },
    /// The tenant's grant changed (a configuration reload): connections charged to it check
    /// their next requests against `grant`.
    Grant { handle: u64, grant: Grant },
    /// Send this RENEGOTIATE notice to every native connection charged to the tenant.
    Notice { body: RenegotiateBody },
    /// The operator set the tenant's RT_alone (µs; `None`: learn it again) for the fairness
    /// monitors of namespace `namespace_index` (`docs/FAIRNESS.md`).
    Alone {
        namespace_index: u16,
        tenant: u32,
        rt_alone_us: Option<u32>,
    },
    /// The namespaces changed (one added, one being removed, one gone): adopt
    /// [`ControlPlane::catalog`]. Sent before any other message about a new namespace.
    Namespaces,
}

/// A connection as the control plane knows it: its thread, slot and the slot's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionKey {
    pub thread: u16,
    pub index: u32,
    pub generation: u32,
}

/// Who asks for a control request: the connection and its peer's address, if known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requester {
    pub connection: ConnectionKey,
    pub source: Option<std::net::IpAddr>,
}

/// Bounds on tenants registered over the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantLimits {
    /// Tenants one connection may own at once.
    pub per_connection_max: u32,
    /// Tenants the connections of one address may own at once.
    pub per_source_max: u32,
    /// How long a tenant outlives its owner's connection (a reconnecting client binds again).
    pub orphan_grace: Nanos,
}

impl Default for TenantLimits {
    fn default() -> TenantLimits {
        TenantLimits {
            per_connection_max: 16,
            per_source_max: 1024,
            orphan_grace: Nanos(30_000_000_000),
        }
    }
}

/// Where tenant handles come from: a keyed hash of a counter, keyed by the operating
/// system's randomness (reflexd) or by a fixed seed (the simulator, tests: runs replay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleKeys {
    Random,
    Seeded(u64),
}

impl HandleKeys {
    /// The `n`th handle candidate (from 1) of a `Seeded(seed)` source: the `n`th tenant
    /// registered gets it unless it is 0 or already in use (then a later one), so simulations
    /// and tests can name tenants by registration order.
    pub fn seeded_candidate(seed: u64, n: u64) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        (seed, n).hash(&mut hasher);
        hasher.finish()
    }
}

struct HandleSource {
    hasher: HandleHasher,
    counter: u64,
}

enum HandleHasher {
    Random(std::hash::RandomState),
    Seeded(u64),
}

impl HandleSource {
    fn new(keys: HandleKeys) -> HandleSource {
        let hasher = match keys {
            HandleKeys::Random => HandleHasher::Random(std::hash::RandomState::new()),
            HandleKeys::Seeded(seed) => HandleHasher::Seeded(seed),
        };
        HandleSource { hasher, counter: 0 }
    }

    /// The next handle candidate (never 0; the caller skips one already in use).
    fn next(&mut self) -> u64 {
        use std::hash::BuildHasher;
        loop {
            self.counter += 1;
            let value = match &self.hasher {
                HandleHasher::Random(state) => state.hash_one(self.counter),
                HandleHasher::Seeded(seed) => HandleKeys::seeded_candidate(*seed, self.counter),
            };
            if value != 0 {
                return value;
            }
        }
    }
}

/// A tenant's entry, by handle.
#[derive(Debug, Clone)]
pub struct TenantEntry {
    pub namespace_index: u16,
    pub id: TenantId,
    pub name: String,
    pub spec: TenantSpec,
    /// Writes and trims are refused.
    pub read_only: bool,
    /// What the configuration grants it (`[[tenant]] access`, `range_offset`, `range_size`):
    /// configured tenants take it by name; tenants registered over the wire have none.
    pub grant: Grant,
    /// Registered over the wire (UNREGISTER may remove it); configured and default tenants
    /// live as long as the server.
    pub dynamic: bool,
    /// A dynamic tenant's owner, while that connection is open.
    pub owner: Option<ConnectionKey>,
    /// The owner's address (counted against [`TenantLimits::per_source_max`]).
    pub source: Option<std::net::IpAddr>,
    /// When its owner closed (it is unregistered [`TenantLimits::orphan_grace`] later).
    pub orphaned_at: Option<Nanos>,
    /// A composite namespace's tenant: the handles of its member tenants, in member order
    /// (each admitted on its member's own registry; see [`member_spec`]).
    pub members: Vec<u64>,
    /// RT_alone the operator set for the fairness monitors (µs); `None`: learned.
    pub rt_alone_us: Option<u32>,
    /// A member tenant: the composite namespace's tenant it serves (its notices go to that
    /// tenant's connections, the only ones that know a handle).
    pub member_of: Option<u64>,
}

impl TenantEntry {
    pub fn tenant_ref(&self, handle: u64) -> TenantRef {
        TenantRef {
            handle,
            id: self.id.0,
        }
    }
}

/// The answer to a control request: a status and what follows the response header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlAnswer {
    pub status: Status,
    pub body: ControlBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlBody {
    None,
    /// REGISTER's OK answer.
    Handle(u64),
    /// REFUSED's reason, UTF-8, at most [`REASON_BYTES_MAX`] bytes.
    Reason(String),
}

impl ControlAnswer {
    /// Done, nothing to say.
    pub fn ok() -> ControlAnswer {
        ControlAnswer::status(Status::Ok)
    }

    /// The request named something that does not exist (an unknown handle).
    pub fn invalid() -> ControlAnswer {
        ControlAnswer::status(Status::Invalid)
    }

    /// The connection may not do this (its certificate names another tenant).
    pub fn permission() -> ControlAnswer {
        ControlAnswer::status(Status::Permission)
    }

    pub fn is_ok(&self) -> bool {
        self.status == Status::Ok
    }

    fn status(status: Status) -> ControlAnswer {
        ControlAnswer {
            status,
            body: ControlBody::None,
        }
    }

    fn refused(reason: &str) -> ControlAnswer {
        let mut end = reason.len().min(REASON_BYTES_MAX);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        ControlAnswer {
            status: Status::Refused,
            body: ControlBody::Reason(reason[..end].to_string()),
        }
    }
}

/// What a BIND resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    pub tenant: TenantRef,
    pub namespace_index: u16,
    pub read_only: bool,
    pub grant: Grant,
}

/// What a connection charged to a tenant for the first time learns of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connected {
    /// The namespace the tenant belongs to.
    pub namespace_index: u16,
    pub grant: Grant,
}

/// The QoS setup of one namespace, for the dataplane threads.
#[derive(Debug, Clone)]
pub struct NamespaceQosSetup {
    /// Tokens where the namespace has a profile and QoS is on, first in first out otherwise.
    pub policy: Policy,
    pub shared: Arc<DeviceShared>,
    /// The tenant of connections that chose none.
    pub default_tenant: TenantRef,
    /// Configured tenants admitted on this namespace, by name.
    pub tenants: Vec<(String, TenantRef)>,
}

/// A tenant as the operator sees it (reflexd's `ServerHandle::tenant`).
#[derive(Debug, Clone, PartialEq)]
pub struct TenantInfo {
    pub handle: u64,
    pub name: String,
    pub namespace_id: u32,
    pub spec: TenantSpec,
    pub read_only: bool,
    pub dynamic: bool,
    /// Its connections on each dataplane thread.
    pub connections_per_thread: Vec<u32>,
    /// Deficit episodes so far (one RENEGOTIATE notice each).
    pub deficit_episodes: u64,
    /// Whether a deficit episode is going on.
    pub in_deficit_episode: bool,
    /// RT_alone set for the fairness monitors (µs); `None`: learned from the windows.
    pub rt_alone_us: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("namespace {namespace_id}: tenant {name:?} refused at startup: {reason}")]
    Refused {
        namespace_id: u32,
        name: String,
        reason: String,
    },
    #[error("namespace {namespace_id}: QoS configuration: {reason}")]
    Qos { namespace_id: u32, reason: String },
}

struct Mailbox {
    /// Set when `messages` may be non-empty; read once per dataplane iteration.
    pending: AtomicBool,
    messages: Mutex<VecDeque<ControlMessage>>,
}

struct NamespaceState {
    namespace_id: u32,
    /// Removed at run time: its tenants are gone and nothing refers to it any more.
    removed: bool,
    /// Without a profile the registry's rate is unlimited and only the default tenant lives.
    has_profile: bool,
    registry: TenantRegistry,
    /// Online self-calibration of the device rate (with a profile, QoS and calibration on).
    calibration: Option<DeviceCalibration>,
    /// The handle of each registered tenant id.
    handles: BTreeMap<TenantId, u64>,
    /// The grant (tokens/s) last told to each LC tenant over the device's scaled rate: a new
    /// notice goes out only when the grant moves by more than `NOTICE_GRANT_CHANGE_MIN`.
    notified_grants: BTreeMap<TenantId, u64>,
    /// A composite namespace: its members' slots and layout. Its own registry has an
    /// unlimited rate and admits everything; admission happens on the members'.
    composite: Option<(Vec<u16>, CompositeLayout)>,
}

/// A tenant still over the device's rate hears again only when its grant moved by more than
/// this share (calibration moves the rate every window; a notice per window is noise).
const NOTICE_GRANT_CHANGE_MIN: f64 = 0.05;

struct State {
    threads: u16,
    namespaces: Vec<NamespaceState>,
    tenants: BTreeMap<u64, TenantEntry>,
    handles: HandleSource,
    limits: TenantLimits,
    /// Dynamic tenants owned, by connection and by source address.
    owned_by_connection: BTreeMap<ConnectionKey, u32>,
    owned_by_source: BTreeMap<std::net::IpAddr, u32>,
    /// Dynamic tenants whose owner closed, by handle.
    orphans: BTreeMap<u64, Nanos>,
    /// Messages for threads other than the registries' rate updates: (thread, message).
    outbox: Vec<(u16, ControlMessage)>,
    /// Tenants created through the admin API (`Self::admin_register`): they live until the
    /// admin API removes them.
    managed: std::collections::BTreeSet<u64>,
    /// The namespaces and NBD exports the threads serve now (`None` until the server sets
    /// them: namespaces cannot change at run time then).
    catalog: Option<Catalog>,
    /// Per namespace slot: its scheduler setup, for threads that adopt a new namespace.
    qos_setups: Vec<NamespaceQosSetup>,
    /// Slots being removed: the threads (bit per thread) that have not drained them yet.
    removing: BTreeMap<u16, u64>,
    /// Every thread must adopt the catalog before the next messages ([`ControlMessage::Namespaces`]).
    announce: bool,
    qos_config: QosConfig,
    qos_enabled: bool,
    /// Grants of configured tenants, by name ([`ControlPlane::set_grants`]).
    grants: BTreeMap<String, Grant>,
    /// RT_alone of configured tenants, by name ([`ControlPlane::set_configured_alone`]).
    alone: BTreeMap<String, u32>,
    /// Connections a spreading decision sent to another thread that has not adopted them yet
    /// ([`ControlPlane::spread_target`]): the registry counts them on their old thread until
    /// then, so the next decisions count them where they go.
    spreading: Vec<SpreadMove>,
}

/// A connection on its way to another thread to spread its tenant's connections (from
/// `key.thread`, the thread it was on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SpreadMove {
    key: ConnectionKey,
    handle: u64,
    to: u16,
}

/// What the threads serve: the namespace slots and the NBD export table.
#[derive(Debug, Clone)]
pub struct Catalog {
    pub namespaces: Arc<NamespaceSet>,
    pub nbd_exports: Option<Arc<NbdExports>>,
}

/// Why a namespace was not added or removed (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamespaceChangeError {
    #[error("namespaces cannot change at run time on this server")]
    Fixed,
    #[error(transparent)]
    Set(#[from] crate::namespaces::NamespaceSetError),
    #[error("NBD export: {0}")]
    Export(#[from] reflex_proto::nbd::ExportError),
    #[error("namespace {namespace_id}: QoS configuration: {reason}")]
    Qos { namespace_id: u32, reason: String },
    #[error("no namespace {0}")]
    NoSuchNamespace(u32),
    #[error("namespace {0} is composite: it is declared in the configuration and stays")]
    Composite(u32),
    #[error("namespace {namespace_id} is a member of composite namespace {composite_id}")]
    Member {
        namespace_id: u32,
        composite_id: u32,
    },
    #[error(
        "namespace {namespace_id} is in use ({tenants} tenant(s) bound: {names}; {connections} connection(s)): remove with force to unbind them"
    )]
    InUse {
        namespace_id: u32,
        tenants: usize,
        names: String,
        connections: u32,
    },
}

/// A namespace to add at run time ([`ControlPlane::add_namespace`]).
pub struct NewNamespace {
    pub id: u32,
    pub device: Arc<dyn reflex_flash::Device>,
    pub read_only: bool,
    /// Its device profile (`None`: no QoS, first in, first out).
    pub profile: Option<DeviceProfile>,
    /// Its NBD export (when the server speaks NBD).
    pub export: Option<reflex_proto::nbd::Export>,
}

/// Tenants, registries and the threads' mailboxes. Shared by the server handle and every
/// dataplane thread.
pub struct ControlPlane {
    state: Mutex<State>,
    mailboxes: Box<[Mailbox]>,
    wakers: Vec<Arc<dyn Wake>>,
    /// Where the threads publish their live figures (`crate::live`).
    live: Arc<crate::live::LiveBoard>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("threads", &self.mailboxes.len())
            .finish()
    }
}

/// How a dataplane thread is woken when a message waits in its mailbox (an eventfd write in
/// reflexd; nothing in the simulator, which polls every thread's mailbox).
pub trait Wake: Send + Sync {
    fn wake(&self);
}

/// What the control plane starts from: per namespace, its device profile (`None`: no QoS,
/// served first in, first out) and the configured tenants bound to it.
#[derive(Debug, Clone)]
pub struct ControlSetup {
    pub threads: u16,
    pub handles: HandleKeys,
    pub tenant_limits: TenantLimits,
    pub qos_config: QosConfig,
    /// `false`: every namespace schedules first in, first out (`--no-qos`).
    pub qos_enabled: bool,
    pub namespaces: Vec<NamespaceControl>,
}

#[derive(Debug, Clone)]
pub struct NamespaceControl {
    pub namespace_id: u32,
    pub profile: Option<DeviceProfile>,
    /// Configured tenants (name, SLO or best effort), admitted at start in this order.
    pub tenants: Vec<(String, TenantSpec)>,
}

impl ControlPlane {
    /// Builds a registry for every namespace, admits the configured tenants bound to it and
    /// registers its default best-effort tenant. A namespace without a profile gets a registry
    /// of unlimited rate that admits only its default tenant, so every namespace is served by
    /// the same scheduler (first in, first out there). `wakers[t]` wakes thread `t`. Returns
    /// the plane and each namespace's setup.
    pub fn start(
        setup: &ControlSetup,
        namespaces: &NamespaceSet,
        wakers: Vec<Arc<dyn Wake>>,
    ) -> Result<(ControlPlane, Vec<NamespaceQosSetup>), ControlError> {
        let threads = setup.threads;
        assert!(threads >= 1);
        assert_eq!(wakers.len(), usize::from(threads));
        assert_eq!(setup.namespaces.len(), namespaces.len());
        let mut state = State {
            threads,
            namespaces: Vec::new(),
            tenants: BTreeMap::new(),
            handles: HandleSource::new(setup.handles),
            limits: setup.tenant_limits,
            owned_by_connection: BTreeMap::new(),
            owned_by_source: BTreeMap::new(),
            orphans: BTreeMap::new(),
            outbox: Vec::new(),
            managed: std::collections::BTreeSet::new(),
            catalog: None,
            qos_setups: Vec::new(),
            removing: BTreeMap::new(),
            announce: false,
            qos_config: setup.qos_config.clone(),
            qos_enabled: setup.qos_enabled,
            grants: BTreeMap::new(),
            alone: BTreeMap::new(),
            spreading: Vec::new(),
        };
        let mut setups = Vec::new();
        for (index, namespace) in setup.namespaces.iter().enumerate() {
            let namespace_index = index as u16;
            assert_eq!(namespaces.id(namespace_index), namespace.namespace_id);
            setups
                .push(state.add_namespace_state(namespace, namespaces.composite(namespace_index))?);
        }
        state.qos_setups = setups.clone();
        let mailboxes = (0..threads)
            .map(|_| Mailbox {
                pending: AtomicBool::new(false),
                messages: Mutex::new(VecDeque::new()),
            })
            .collect();
        let plane = ControlPlane {
            state: Mutex::new(state),
            mailboxes,
            wakers,
            live: Arc::new(crate::live::LiveBoard::new(usize::from(threads))),
        };
        // The registries' first messages (device rates) wait in the mailboxes until each
        // thread starts; no thread runs yet, so none needs waking.
        {
            let mut state = plane.lock();
            plane.distribute(&mut state, None);
        }
        Ok((plane, setups))
    }

    /// The board the dataplane threads publish their live figures on.
    pub fn live(&self) -> &Arc<crate::live::LiveBoard> {
        &self.live
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug in this module; the state is still
        // consistent enough to keep serving (every change is applied or refused whole).
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether messages may be waiting for `thread` (one relaxed atomic load: the hot path).
    #[inline]
    pub fn has_messages(&self, thread: usize) -> bool {
        self.mailboxes[thread].pending.load(Ordering::Acquire)
    }

    /// Takes up to `max` waiting messages of `thread`, oldest first.
    pub fn take_messages(&self, thread: usize, max: usize, out: &mut Vec<ControlMessage>) {
        let mailbox = &self.mailboxes[thread];
        let mut messages = mailbox
            .messages
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for _ in 0..max {
            match messages.pop_front() {
                Some(message) => out.push(message),
                None => break,
            }
        }
        mailbox
            .pending
            .store(!messages.is_empty(), Ordering::Release);
    }

    /// Runs `change` on the state for thread `thread` and returns its result with the
    /// messages `thread` must apply now: first those that were waiting for it, then the new
    /// ones, in order. Messages for other threads go to their mailboxes.
    fn change<R>(
        &self,
        thread: usize,
        own: &mut Vec<ControlMessage>,
        change: impl FnOnce(&mut State) -> R,
    ) -> R {
        let mut state = self.lock();
        self.take_messages(thread, usize::MAX, own);
        let result = change(&mut state);
        let woken = self.distribute_to(&mut state, Some(thread), own);
        drop(state);
        self.wake(&woken);
        result
    }

    /// Moves the registries' updates and the outbox to the mailboxes (startup: no thread to
    /// serve directly).
    fn distribute(&self, state: &mut State, own_thread: Option<usize>) {
        let mut none = Vec::new();
        let woken = self.distribute_to(state, own_thread, &mut none);
        assert!(none.is_empty());
        let _ = woken;
    }

    /// Returns the other threads that got messages.
    fn distribute_to(
        &self,
        state: &mut State,
        own_thread: Option<usize>,
        own: &mut Vec<ControlMessage>,
    ) -> u64 {
        let mut woken = 0u64;
        let mut send = |thread: usize, message: ControlMessage| {
            if Some(thread) == own_thread {
                own.push(message);
                return;
            }
            let mailbox = &self.mailboxes[thread];
            mailbox
                .messages
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push_back(message);
            mailbox.pending.store(true, Ordering::Release);
            woken |= 1u64 << thread;
        };
        if std::mem::take(&mut state.announce) {
            for thread in 0..usize::from(state.threads) {
                send(thread, ControlMessage::Namespaces);
            }
        }
        for (index, namespace) in state.namespaces.iter_mut().enumerate() {
            if namespace.removed {
                let _ = namespace.registry.take_updates();
                continue;
            }
            for (thread, update) in namespace.registry.take_updates() {
                send(
                    usize::from(thread),
                    ControlMessage::Rates {
                        namespace_index: index as u16,
                        update,
                    },
                );
            }
        }
        for (thread, message) in state.outbox.drain(..) {
            send(usize::from(thread), message);
        }
        woken
    }

    fn wake(&self, threads: &u64) {
        for (thread, waker) in self.wakers.iter().enumerate() {
            if threads & (1u64 << thread) != 0 {
                waker.wake();
            }
        }
    }

    // ----- Requests from the dataplane ----------------------------------------------------------

    /// REGISTER on `namespace_index` (`None`: the body names no namespace of this server).
    pub fn register(
        &self,
        thread: usize,
        namespace_index: Option<u16>,
        body: &RegisterBody,
        requester: Requester,
        own: &mut Vec<ControlMessage>,
    ) -> ControlAnswer {
        let Some(namespace_index) = namespace_index else {
            return ControlAnswer::status(Status::NoSuchNamespace);
        };
        let spec = match body.class {
            TenantClassRequest::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            } => TenantSpec::LatencyCritical {
                latency_us_p95: u64::from(latency_us_p95),
                iops,
                read_percent,
            },
            TenantClassRequest::BestEffort => TenantSpec::BestEffort,
        };
        self.change(thread, own, |state| {
            if !state
                .namespace(namespace_index)
                .is_some_and(|namespace| namespace.has_profile)
            {
                return ControlAnswer::refused(&format!(
                    "namespace {} has no QoS profile: tenants cannot register",
                    body.namespace_id
                ));
            }
            if body.handle == 0 {
                return state.register_owned(namespace_index, spec, body.read_only, requester);
            }
            let Some(entry) = state.tenants.get(&body.handle) else {
                return ControlAnswer::status(Status::Invalid);
            };
            if !entry.dynamic
                || entry.namespace_index != namespace_index
                || entry.owner != Some(requester.connection)
            {
                return ControlAnswer::status(Status::Permission);
            }
            if entry.read_only != body.read_only {
                return ControlAnswer::status(Status::Invalid);
            }
            match state.reregister(body.handle, spec) {
                Ok(()) => {
                    if let Some(entry) = state.tenants.get_mut(&body.handle) {
                        entry.spec = spec;
                    }
                    ControlAnswer {
                        status: Status::Ok,
                        body: ControlBody::Handle(body.handle),
                    }
                }
                Err(reason) => ControlAnswer::refused(&reason),
            }
        })
    }

    /// UNREGISTER: removes a tenant registered over the wire; only the connection that
    /// registered it may.
    pub fn unregister(
        &self,
        thread: usize,
        handle: u64,
        requester: Requester,
        own: &mut Vec<ControlMessage>,
    ) -> ControlAnswer {
        self.change(thread, own, |state| {
            let Some(entry) = state.tenants.get(&handle) else {
                return ControlAnswer::status(Status::Invalid);
            };
            if !entry.dynamic || entry.owner != Some(requester.connection) {
                return ControlAnswer::status(Status::Permission);
            }
            if state.remove_dynamic(handle) {
                ControlAnswer::status(Status::Ok)
            } else {
                ControlAnswer::status(Status::Invalid)
            }
        })
    }

    /// A connection that owned tenants closed: they become orphans, unregistered after the
    /// grace period unless a connection still counts for them.
    pub fn connection_closed(
        &self,
        thread: usize,
        connection: ConnectionKey,
        now: Nanos,
        own: &mut Vec<ControlMessage>,
    ) {
        self.change(thread, own, |state| {
            let Some(count) = state.owned_by_connection.remove(&connection) else {
                return;
            };
            let owned: Vec<u64> = state
                .tenants
                .iter()
                .filter(|(_, entry)| entry.owner == Some(connection))
                .map(|(handle, _)| *handle)
                .collect();
            assert_eq!(owned.len() as u32, count, "owner counts out of step");
            for handle in owned {
                if let Some(entry) = state.tenants.get_mut(&handle) {
                    entry.owner = None;
                    entry.orphaned_at = Some(now);
                }
                state.orphans.insert(handle, now);
            }
        });
    }

    /// Unregisters the orphans whose grace period is over and that no connection counts for
    /// (called from a dataplane thread's housekeeping).
    pub fn reap_orphans(&self, thread: usize, now: Nanos, own: &mut Vec<ControlMessage>) {
        self.change(thread, own, |state| {
            let grace = state.limits.orphan_grace;
            let due: Vec<u64> = state
                .orphans
                .iter()
                .filter(|(_, orphaned_at)| now.saturating_since(**orphaned_at) >= grace)
                .map(|(handle, _)| *handle)
                .collect();
            for handle in due {
                let in_use = state.tenants.get(&handle).is_some_and(|entry| {
                    let (namespace_index, id) = (entry.namespace_index, entry.id);
                    state.namespaces[usize::from(namespace_index)]
                        .registry
                        .connections(id)
                        .is_some_and(|counts| counts.iter().any(|&c| c > 0))
                });
                if in_use {
                    // Still used: it lives on, and is checked again after another grace.
                    state.orphans.insert(handle, now);
                    continue;
                }
                tracing::info!(handle, "orphaned tenant unregistered (its owner left)");
                state.remove_dynamic(handle);
            }
        });
    }

    /// Whether orphans wait for [`Self::reap_orphans`] (one atomic-free check under the lock;
    /// callers use it at housekeeping rate only).
    pub fn has_orphans(&self) -> bool {
        !self.lock().orphans.is_empty()
    }

    /// The member tenants of a composite namespace's tenant, in member order (empty for a
    /// plain namespace's tenant or a tenant that is gone).
    pub fn member_tenants(&self, handle: u64) -> Vec<TenantRef> {
        let state = self.lock();
        let Some(entry) = state.tenants.get(&handle) else {
            return Vec::new();
        };
        entry
            .members
            .iter()
            .map(|&member| state.tenant_ref(member))
            .collect()
    }

    /// Looks up a handle for BIND and counts one more connection of it on `thread`.
    pub fn bind(
        &self,
        thread: usize,
        handle: u64,
        own: &mut Vec<ControlMessage>,
    ) -> Option<Binding> {
        self.change(thread, own, |state| {
            let entry = state.tenants.get(&handle)?;
            let binding = Binding {
                tenant: entry.tenant_ref(handle),
                namespace_index: entry.namespace_index,
                read_only: entry.read_only,
                grant: entry.grant,
            };
            state.connect(handle, thread as u16).then_some(binding)
        })
    }

    /// Spreading tenants' connections (`[scaling] spread_tenants`): the thread connection
    /// `key`, just bound to `handle` on its thread, should move to among the threads in
    /// `active`, from the tenant's connections per thread with those on their way counted
    /// where they go (`reflex_qos::spread_target`). A move named is on its way from now until
    /// [`Self::connection_moved`] or [`Self::spread_abandoned`] for `key`.
    pub fn spread_target(&self, key: ConnectionKey, handle: u64, active: u64) -> Option<u16> {
        let mut state = self.lock();
        let entry = state.tenants.get(&handle)?;
        let namespace = state.namespaces.get(usize::from(entry.namespace_index))?;
        let mut counts = namespace.registry.connections(entry.id)?.to_vec();
        for on_its_way in state.spreading.iter().filter(|m| m.handle == handle) {
            let from = &mut counts[usize::from(on_its_way.key.thread)];
            *from = from.saturating_sub(1);
            counts[usize::from(on_its_way.to)] += 1;
        }
        let to = reflex_qos::spread_target(&counts, key.thread, active)?;
        state.spreading.push(SpreadMove { key, handle, to });
        Some(to)
    }

    /// A connection a spreading decision named stays where it is after all (it closed, or its
    /// peer ended, before it could move).
    pub fn spread_abandoned(&self, key: ConnectionKey) {
        self.lock().spreading.retain(|m| m.key != key);
    }

    /// Which tenant and namespace `handle` names, without counting a connection.
    pub fn peek_binding(&self, handle: u64) -> Option<Binding> {
        let state = self.lock();
        let entry = state.tenants.get(&handle)?;
        Some(Binding {
            tenant: entry.tenant_ref(handle),
            namespace_index: entry.namespace_index,
            read_only: entry.read_only,
            grant: entry.grant,
        })
    }

    /// Counts a connection of `handle` on `thread` and tells what the tenant may do; `None`
    /// when the tenant is gone.
    pub fn connect(
        &self,
        thread: usize,
        handle: u64,
        own: &mut Vec<ControlMessage>,
    ) -> Option<Connected> {
        self.change(thread, own, |state| {
            let entry = state.tenants.get(&handle)?;
            let connected = Connected {
                namespace_index: entry.namespace_index,
                grant: entry.grant,
            };
            state.connect(handle, thread as u16).then_some(connected)
        })
    }

    /// Sets the grants of configured tenants, by name: tenants registered already under one
    /// of these names (not over the wire) take it now, tenants registered later (a
    /// configuration reload) when they are. A connection learns its tenant's grant when it is
    /// first charged to it; when a grant changes, every thread is told (a
    /// [`ControlMessage::Grant`]), so connections charged already follow the new grant from
    /// their thread's next iteration. Returns how many tenants' grants changed.
    pub fn set_grants(&self, grants: BTreeMap<String, Grant>) -> usize {
        self.change_from_outside(|state| {
            let mut changed = Vec::new();
            for (handle, entry) in state.tenants.iter_mut() {
                if entry.dynamic {
                    continue;
                }
                let grant = grants.get(&entry.name).copied().unwrap_or_default();
                if entry.grant != grant {
                    entry.grant = grant;
                    changed.push((*handle, grant));
                }
            }
            for (handle, grant) in &changed {
                for thread in 0..state.threads {
                    state.outbox.push((
                        thread,
                        ControlMessage::Grant {
                            handle: *handle,
                            grant: *grant,
                        },
                    ));
                }
            }
            state.grants = grants;
            changed.len()
        })
    }

    /// Sets the RT_alone of configured tenants, by name, like [`Self::set_grants`]: tenants
    /// registered already under one of these names (not over the wire) take it now, tenants
    /// registered later when they are. Only names whose value differs from the previous
    /// call's change (a reload leaves an RT_alone the admin API set alone unless the file
    /// changed it); a name gone from `alone` learns its RT_alone again. Returns how many
    /// tenants changed.
    pub fn set_configured_alone(&self, alone: BTreeMap<String, u32>) -> usize {
        self.change_from_outside(|state| {
            let changed: Vec<(u64, Option<u32>)> = state
                .tenants
                .iter()
                .filter(|(_, entry)| !entry.dynamic && entry.member_of.is_none())
                .filter_map(|(handle, entry)| {
                    let wanted = alone.get(&entry.name).copied();
                    let before = state.alone.get(&entry.name).copied();
                    (wanted != before && entry.rt_alone_us != wanted).then_some((*handle, wanted))
                })
                .collect();
            for &(handle, rt_alone_us) in &changed {
                state.announce_alone(handle, rt_alone_us);
            }
            state.alone = alone;
            changed.len()
        })
    }

    /// Sets (or with `None` clears) the RT_alone of the tenant `handle` names, for every
    /// thread's fairness monitors from their next window (nothing if it is gone).
    pub fn set_alone(&self, handle: u64, rt_alone_us: Option<u32>) {
        self.change_from_outside(|state| state.announce_alone(handle, rt_alone_us));
    }

    /// The handle of tenant `name` on `namespace_id`, or the admin API's error.
    fn named_tenant(&self, namespace_id: u32, name: &str) -> Result<u64, AdminError> {
        self.find_tenant(namespace_id, name)
            .ok_or_else(|| AdminError::NoSuchTenant {
                namespace_id,
                name: name.to_string(),
            })
    }

    /// Sets (or with `None` clears) the RT_alone of tenant `name` on `namespace_id` for the
    /// admin API; the threads' fairness monitors use it from their next window.
    pub fn admin_set_alone(
        &self,
        namespace_id: u32,
        name: &str,
        rt_alone_us: Option<u32>,
    ) -> Result<TenantInfo, AdminError> {
        let handle = self.named_tenant(namespace_id, name)?;
        self.set_alone(handle, rt_alone_us);
        tracing::info!(handle, tenant = %name, namespace = namespace_id, ?rt_alone_us,
            "tenant's RT_alone set through the admin API");
        self.tenant(handle).ok_or_else(|| AdminError::NoSuchTenant {
            namespace_id,
            name: name.to_string(),
        })
    }

    /// A connection of each of `handles` on `thread` is gone (tenants that are gone
    /// already are skipped).
    pub fn disconnect(
        &self,
        thread: usize,
        handles: impl Iterator<Item = u64>,
        own: &mut Vec<ControlMessage>,
    ) {
        self.change(thread, own, |state| {
            for handle in handles {
                let Some(entry) = state.tenants.get(&handle) else {
                    continue;
                };
                let members = entry.members.clone();
                for handle in std::iter::once(handle).chain(members) {
                    let Some(entry) = state.tenants.get(&handle) else {
                        continue;
                    };
                    let (namespace_index, id) = (entry.namespace_index, entry.id);
                    if let Some(namespace) = state.namespace(namespace_index)
                        && let Err(error) = namespace.registry.disconnect(id, thread as u16)
                    {
                        tracing::error!(handle, %error, "disconnecting a tenant that has no connection here");
                    }
                }
            }
        });
    }

    /// A connection moved from thread `from` to thread `to` (thread scaling): each tenant of
    /// `handles` (and a composite's members) now counts it on `to` instead of `from`, so its
    /// reservation stays counted once and its rate share follows the connection; the tenants
    /// the connection registered follow it to its new key. Returns the handles that are gone
    /// (unregistered while the connection was between threads).
    pub fn connection_moved(
        &self,
        to: usize,
        from: usize,
        keys: (ConnectionKey, ConnectionKey),
        handles: impl Iterator<Item = u64>,
        own: &mut Vec<ControlMessage>,
    ) -> Vec<u64> {
        let (old_key, new_key) = keys;
        self.change(to, own, |state| {
            state.spreading.retain(|m| m.key != old_key);
            let mut gone = Vec::new();
            for handle in handles {
                let Some(entry) = state.tenants.get(&handle) else {
                    gone.push(handle);
                    continue;
                };
                let members = entry.members.clone();
                for handle in std::iter::once(handle).chain(members) {
                    let Some(entry) = state.tenants.get(&handle) else {
                        continue;
                    };
                    let (namespace_index, id) = (entry.namespace_index, entry.id);
                    if let Some(namespace) = state.namespace(namespace_index)
                        && let Err(error) =
                            namespace
                                .registry
                                .move_connection(id, from as u16, to as u16)
                    {
                        tracing::error!(handle, %error, "moving a connection the registry does not count");
                    }
                }
            }
            if let Some(count) = state.owned_by_connection.remove(&old_key) {
                state.owned_by_connection.insert(new_key, count);
                for entry in state.tenants.values_mut() {
                    if entry.owner == Some(old_key) {
                        entry.owner = Some(new_key);
                    }
                }
            }
            gone
        })
    }

    /// A scheduler event of `thread`: deficit episodes become at most one RENEGOTIATE
    /// notice per tenant episode, sent to every thread with connections of the tenant.
    /// `observed_iops_here` is the tenant's recent request rate on `thread`.
    pub fn scheduler_event(
        &self,
        thread: usize,
        namespace_index: u16,
        event: SchedulerEvent,
        observed_iops_here: u64,
        own: &mut Vec<ControlMessage>,
    ) {
        self.change(thread, own, |state| {
            let Some(namespace) = state.namespace(namespace_index) else {
                return;
            };
            let Some(Notice::Renegotiate { tenant, episode }) =
                namespace.registry.handle_event(thread as u16, event)
            else {
                return;
            };
            let Some(&handle) = namespace.handles.get(&tenant) else {
                return;
            };
            let connections = namespace
                .registry
                .connections(tenant)
                .map(<[u32]>::to_vec)
                .unwrap_or_default();
            let here = connections.get(thread).copied().unwrap_or(0).max(1);
            let total: u32 = connections.iter().sum();
            let (reserved_iops, reserved_tokens_per_sec) = match namespace.registry.spec(tenant) {
                Some(TenantSpec::LatencyCritical {
                    iops, read_percent, ..
                }) => {
                    let rate =
                        namespace
                            .registry
                            .costs()
                            .reservation(iops, read_percent, LoadMode::Mixed);
                    (iops, rate.as_tokens_per_sec_f64().round() as u64)
                }
                _ => (0, 0),
            };
            let body = RenegotiateBody {
                handle,
                episode,
                reserved_iops,
                reserved_tokens_per_sec,
                observed_iops: observed_iops_here.saturating_mul(u64::from(total.max(here)))
                    / u64::from(here),
                reason: RenegotiateReason::DeficitLimit,
                granted_tokens_per_sec: reserved_tokens_per_sec,
            };
            let name = state
                .tenants
                .get(&handle)
                .map_or_else(String::new, |entry| entry.name.clone());
            tracing::info!(
                handle,
                tenant = %name,
                episode,
                reserved_iops,
                observed_iops = body.observed_iops,
                "tenant reached its deficit limit: RENEGOTIATE notice"
            );
            state.send_notice(&connections, body);
        });
    }

    /// A thread's telemetry window of a namespace (`core::calibration`). When the device's
    /// calibration window has ended, the merged window is judged: a new rate scale is applied
    /// like any other change (rate updates to every thread), and LC tenants whose reservation
    /// no longer fits the scaled rate (or fits again) get a RENEGOTIATE notice.
    pub fn publish_window(
        &self,
        thread: usize,
        namespace_index: u16,
        window: &TelemetryWindow,
        now: Nanos,
        own: &mut Vec<ControlMessage>,
    ) {
        self.change(thread, own, |state| {
            let Some(namespace) = state.namespace(namespace_index) else {
                return;
            };
            let Some(calibration) = namespace.calibration.as_mut() else {
                return;
            };
            if !calibration.add(window, now) {
                return;
            }
            let decision = match calibration.close(
                now,
                &namespace.registry.plan(),
                namespace.registry.profile(),
            ) {
                Ok(decision) => decision,
                Err(error) => {
                    tracing::error!(%error, "self-calibration window refused");
                    return;
                }
            };
            let spare_before = namespace.registry.spare_share();
            if decision.spare_share != spare_before {
                match namespace.registry.set_spare_share(decision.spare_share) {
                    Ok(()) => tracing::debug!(
                        namespace = namespace.namespace_id,
                        spare_share_before = spare_before,
                        spare_share = decision.spare_share,
                        "self-calibration: best-effort share of unused reservations changed"
                    ),
                    Err(error) => tracing::error!(%error, "spare share refused"),
                }
            }
            let before = namespace.registry.rate_scale();
            if !matches!(
                decision.action,
                Action::Increased { .. } | Action::Decreased { .. } | Action::Restored { .. }
            ) || decision.scale == before
            {
                return;
            }
            let over_before = namespace.registry.lc_tenants_over();
            match namespace.registry.set_rate_scale(decision.scale) {
                Ok(_newly_over) => {}
                Err(error) => {
                    tracing::error!(%error, scale = decision.scale, "rate scale refused");
                    return;
                }
            };
            let plan = namespace.registry.plan();
            let last = calibration.info().last;
            tracing::info!(
                namespace = namespace.namespace_id,
                scale_before = before,
                scale = decision.scale,
                lc_read_service_p95_us = last.map(|o| o.lc_read_latency_us_p95),
                target_us = calibration.last_target_us(),
                device_tokens_per_sec = plan.device_tokens_per_sec[LoadMode::Mixed.index()]
                    .as_tokens_per_sec_f64()
                    .round(),
                lc_tenants_over = plan.lc_tenants_over,
                lc_queued_requests = last.and_then(|o| o.lc_queued_requests),
                action = ?decision.action,
                "self-calibration: device rate scaled"
            );
            let over_now = namespace.registry.lc_tenants_over();
            let recovered: Vec<TenantId> = over_before
                .iter()
                .filter(|tenant| !over_now.contains(tenant))
                .copied()
                .collect();
            // Every tenant still over hears its new grant, not only those newly over: a client
            // that follows notices must not keep sending at a share the device lost since.
            for (tenants, reason) in [
                (over_now, RenegotiateReason::DeviceSlower),
                (recovered, RenegotiateReason::DeviceRecovered),
            ] {
                for tenant in tenants {
                    state.notify_device_change(namespace_index, tenant, reason);
                }
            }
        });
    }

    /// Each calibrated namespace's calibration, by namespace id.
    pub fn calibration(&self) -> Vec<(u32, CalibrationInfo)> {
        let state = self.lock();
        state
            .namespaces
            .iter()
            .filter_map(|namespace| {
                let calibration = namespace.calibration.as_ref()?;
                Some((namespace.namespace_id, calibration.info()))
            })
            .collect()
    }

    // ----- Queries (operators, tests) ----------------------------------------------------------

    /// A tenant by handle.
    pub fn tenant(&self, handle: u64) -> Option<TenantInfo> {
        let mut state = self.lock();
        let entry = state.tenants.get(&handle)?.clone();
        let namespace = state.namespace(entry.namespace_index)?;
        let (deficit_episodes, in_deficit_episode) = namespace
            .registry
            .deficit_episodes(entry.id)
            .unwrap_or((0, false));
        Some(TenantInfo {
            handle,
            name: entry.name,
            namespace_id: namespace.namespace_id,
            spec: entry.spec,
            read_only: entry.read_only,
            dynamic: entry.dynamic,
            connections_per_thread: namespace
                .registry
                .connections(entry.id)
                .map(<[u32]>::to_vec)
                .unwrap_or_default(),
            deficit_episodes,
            in_deficit_episode,
            rt_alone_us: entry.rt_alone_us,
        })
    }

    /// Every tenant, by handle.
    pub fn tenants(&self) -> Vec<TenantInfo> {
        let handles: Vec<u64> = self.lock().tenants.keys().copied().collect();
        handles
            .into_iter()
            .filter_map(|handle| self.tenant(handle))
            .collect()
    }

    /// The current allocation of a namespace's device (`None`: no QoS there).
    pub fn plan(&self, namespace_index: u16) -> Option<Plan> {
        let mut state = self.lock();
        state
            .namespace(namespace_index)
            .filter(|namespace| namespace.has_profile)
            .map(|namespace| namespace.registry.plan())
    }

    /// The name of a tenant, for logs (including tenants that are gone: their handle).
    pub fn name(&self, handle: u64) -> String {
        self.lock()
            .tenants
            .get(&handle)
            .map_or_else(|| format!("handle {handle}"), |entry| entry.name.clone())
    }
}

/// Why the admin API's change of a tenant was not made (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("no namespace {0}")]
    NoSuchNamespace(u32),
    #[error("namespace {0} has no QoS profile: tenants cannot be added to it")]
    NoQos(u32),
    #[error("no tenant {name:?} on namespace {namespace_id}")]
    NoSuchTenant { namespace_id: u32, name: String },
    #[error("namespace {namespace_id} already has a tenant {name:?}")]
    Duplicate { namespace_id: u32, name: String },
    #[error("tenant {name:?} {reason}")]
    NotChangeable { name: String, reason: &'static str },
    /// Admission control's reason.
    #[error("refused by admission control: {0}")]
    Refused(String),
}

/// A tenant the admin API changed, and the plan of its namespace afterwards.
#[derive(Debug, Clone)]
pub struct AdminOutcome {
    pub tenant: TenantInfo,
    pub plan: Option<Plan>,
}

impl ControlPlane {
    /// Runs `change` on the state from outside the dataplane (the admin API's thread): every
    /// message it makes goes to the threads' mailboxes, and the threads are woken, so each
    /// applies the change before its next scheduling round.
    fn change_from_outside<R>(&self, change: impl FnOnce(&mut State) -> R) -> R {
        let mut state = self.lock();
        let result = change(&mut state);
        let mut none = Vec::new();
        let woken = self.distribute_to(&mut state, None, &mut none);
        assert!(none.is_empty(), "no thread is served directly from outside");
        drop(state);
        self.wake(&woken);
        result
    }

    /// The index of namespace `namespace_id` among the registries.
    /// Where a tenant named `name` may be created on `namespace_id` from outside (the admin
    /// API, a configuration reload): the namespace's slot, if it exists, has QoS, and has no
    /// tenant of that name yet.
    fn check_new_tenant(state: &State, namespace_id: u32, name: &str) -> Result<u16, AdminError> {
        let index = Self::namespace_index_of(state, namespace_id)
            .ok_or(AdminError::NoSuchNamespace(namespace_id))?;
        if !state.namespaces[usize::from(index)].has_profile {
            return Err(AdminError::NoQos(namespace_id));
        }
        if state
            .tenants
            .values()
            .any(|entry| entry.namespace_index == index && entry.name == name)
        {
            return Err(AdminError::Duplicate {
                namespace_id,
                name: name.to_string(),
            });
        }
        Ok(index)
    }

    fn namespace_index_of(state: &State, namespace_id: u32) -> Option<u16> {
        state
            .namespaces
            .iter()
            .position(|namespace| namespace.namespace_id == namespace_id && !namespace.removed)
            .map(|index| index as u16)
    }

    /// The tenant a TLS identity `name` is on namespace slot `namespace_index`: the
    /// configured (or admin-created) tenant of that name. Tenants registered over the wire
    /// never match: anyone could choose their names.
    pub fn identity_tenant(&self, namespace_index: u16, name: &str) -> Option<TenantRef> {
        let state = self.lock();
        state
            .tenants
            .iter()
            .find(|(_, entry)| {
                entry.namespace_index == namespace_index && !entry.dynamic && entry.name == name
            })
            .map(|(handle, entry)| entry.tenant_ref(*handle))
    }

    /// The handle of the tenant called `name` on `namespace_id`.
    pub fn find_tenant(&self, namespace_id: u32, name: &str) -> Option<u64> {
        let state = self.lock();
        let index = Self::namespace_index_of(&state, namespace_id)?;
        state
            .tenants
            .iter()
            .find(|(_, entry)| entry.namespace_index == index && entry.name == name)
            .map(|(handle, _)| *handle)
    }

    /// Whether the admin API created the tenant (and may remove it).
    pub fn is_managed(&self, handle: u64) -> bool {
        self.lock().managed.contains(&handle)
    }

    /// Admits a tenant named `name` on `namespace_id` for the admin API; it lives until
    /// [`Self::admin_remove`]. Refused (nothing changes) when the name is taken there, the
    /// namespace has no QoS profile, or admission control says no.
    pub fn admin_register(
        &self,
        namespace_id: u32,
        name: &str,
        spec: TenantSpec,
        read_only: bool,
    ) -> Result<AdminOutcome, AdminError> {
        let handle = self.change_from_outside(|state| {
            let index = Self::check_new_tenant(state, namespace_id, name)?;
            let handle = state
                .register(index, spec, name, read_only, false)
                .map_err(AdminError::Refused)?;
            state.managed.insert(handle);
            Ok(handle)
        })?;
        self.outcome(handle, namespace_id, name)
    }

    /// Changes a tenant's SLO (or class) for the admin API: admission runs again; on refusal
    /// the old SLO stays. The threads apply the new rates before their next scheduling round.
    pub fn admin_update(
        &self,
        namespace_id: u32,
        name: &str,
        spec: TenantSpec,
    ) -> Result<AdminOutcome, AdminError> {
        let handle = self.change_from_outside(|state| {
            let index = Self::namespace_index_of(state, namespace_id)
                .ok_or(AdminError::NoSuchNamespace(namespace_id))?;
            let (handle, id) = state
                .tenants
                .iter()
                .find(|(_, entry)| entry.namespace_index == index && entry.name == name)
                .map(|(handle, entry)| (*handle, entry.id))
                .ok_or_else(|| AdminError::NoSuchTenant {
                    namespace_id,
                    name: name.to_string(),
                })?;
            let namespace = &mut state.namespaces[usize::from(index)];
            if !namespace.has_profile {
                return Err(AdminError::NoQos(namespace_id));
            }
            if namespace.handles.get(&id) != Some(&handle) {
                return Err(AdminError::NoSuchTenant {
                    namespace_id,
                    name: name.to_string(),
                });
            }
            state
                .reregister(handle, spec)
                .map_err(AdminError::Refused)?;
            if let Some(entry) = state.tenants.get_mut(&handle) {
                entry.spec = spec;
            }
            tracing::info!(handle, tenant = %name, namespace = namespace_id, ?spec,
                "tenant's SLO changed through the admin API");
            Ok(handle)
        })?;
        self.outcome(handle, namespace_id, name)
    }

    /// Removes a tenant the admin API created, or one a client registered over the wire:
    /// its connections' I/O is refused (PERMISSION) from then on. Configured tenants and the
    /// namespace's default tenant stay (they are the configuration file's).
    pub fn admin_remove(&self, namespace_id: u32, name: &str) -> Result<TenantInfo, AdminError> {
        let handle = self.named_tenant(namespace_id, name)?;
        let info = self
            .tenant(handle)
            .ok_or_else(|| AdminError::NoSuchTenant {
                namespace_id,
                name: name.to_string(),
            })?;
        self.change_from_outside(|state| {
            let removable = state
                .tenants
                .get(&handle)
                .is_some_and(|entry| entry.dynamic)
                || state.managed.contains(&handle);
            if !removable {
                return Err(AdminError::NotChangeable {
                    name: name.to_string(),
                    reason: "comes from the configuration file: remove it there (and reload)",
                });
            }
            if state.remove_dynamic(handle) {
                Ok(())
            } else {
                Err(AdminError::NoSuchTenant {
                    namespace_id,
                    name: name.to_string(),
                })
            }
        })?;
        Ok(info)
    }

    fn outcome(
        &self,
        handle: u64,
        namespace_id: u32,
        name: &str,
    ) -> Result<AdminOutcome, AdminError> {
        let tenant = self
            .tenant(handle)
            .ok_or_else(|| AdminError::NoSuchTenant {
                namespace_id,
                name: name.to_string(),
            })?;
        let plan = {
            let state = self.lock();
            Self::namespace_index_of(&state, namespace_id).and_then(|index| {
                let namespace = &state.namespaces[usize::from(index)];
                namespace.has_profile.then(|| namespace.registry.plan())
            })
        };
        Ok(AdminOutcome { tenant, plan })
    }

    /// The registry's current scale of the device rate and whether the namespace has QoS.
    pub fn rate_scale(&self, namespace_index: u16) -> Option<f64> {
        let mut state = self.lock();
        state
            .namespace(namespace_index)
            .filter(|namespace| namespace.has_profile)
            .map(|namespace| namespace.registry.rate_scale())
    }
}

/// A namespace added at run time: its slot and the handle of its default tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddedNamespace {
    pub namespace_index: u16,
    pub default_tenant: TenantRef,
}

/// A namespace removed at run time: its slot and the tenants that were unbound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedNamespace {
    pub namespace_index: u16,
    pub unbound: Vec<String>,
}

impl ControlPlane {
    /// The namespaces and exports the threads serve from now on (start-up, before any thread
    /// runs). Without it namespaces cannot be added or removed at run time.
    pub fn set_catalog(&self, catalog: Catalog) {
        let mut state = self.lock();
        assert_eq!(catalog.namespaces.len(), state.namespaces.len());
        state.catalog = Some(catalog);
    }

    /// What the threads serve now.
    pub fn catalog(&self) -> Option<Catalog> {
        self.lock().catalog.clone()
    }

    /// The scheduler setup of namespace slot `namespace_index`.
    pub fn qos_setup(&self, namespace_index: u16) -> Option<NamespaceQosSetup> {
        self.lock()
            .qos_setups
            .get(usize::from(namespace_index))
            .cloned()
    }

    /// Adds a namespace in a new slot: its registry and default tenant, its NBD export, and
    /// the new catalog every thread adopts (each opens its device queue for the slot before
    /// it reads another request). Refused with nothing changed on a duplicate id, a full set,
    /// an export name that is taken, or a profile the registry refuses.
    pub fn add_namespace(
        &self,
        namespace: NewNamespace,
    ) -> Result<AddedNamespace, NamespaceChangeError> {
        self.change_from_outside(|state| {
            let catalog = state.catalog.clone().ok_or(NamespaceChangeError::Fixed)?;
            let namespaces = catalog.namespaces.with_added(
                namespace.id,
                namespace.device,
                namespace.read_only,
            )?;
            let namespace_index = (namespaces.len() - 1) as u16;
            let nbd_exports = match (&catalog.nbd_exports, namespace.export) {
                (Some(exports), Some(export)) => {
                    let export = if namespaces.is_read_only(namespace_index) {
                        export.read_only()
                    } else {
                        export
                    };
                    Some(Arc::new(exports.with_added(
                        export,
                        ExportBinding {
                            namespace_index,
                            tenant: TenantRef::NONE,
                            device_queue: None,
                        },
                    )?))
                }
                (exports, _) => exports.clone(),
            };
            if state.namespaces.len() != usize::from(namespace_index) {
                return Err(NamespaceChangeError::Qos {
                    namespace_id: namespace.id,
                    reason: "the control plane's slots are out of step".into(),
                });
            }
            let setup = state
                .add_namespace_state(
                    &NamespaceControl {
                        namespace_id: namespace.id,
                        profile: namespace.profile,
                        tenants: Vec::new(),
                    },
                    None,
                )
                .map_err(|error| {
                    // Nothing of the namespace stays behind.
                    if state.namespaces.len() > usize::from(namespace_index) {
                        state.namespaces.truncate(usize::from(namespace_index));
                    }
                    NamespaceChangeError::Qos {
                        namespace_id: namespace.id,
                        reason: error.to_string(),
                    }
                })?;
            let default_tenant = setup.default_tenant;
            state.qos_setups.push(setup);
            state.catalog = Some(Catalog {
                namespaces: Arc::new(namespaces),
                nbd_exports,
            });
            state.announce = true;
            tracing::info!(namespace = namespace.id, namespace_index, "namespace added");
            Ok(AddedNamespace {
                namespace_index,
                default_tenant,
            })
        })
    }

    /// Removes namespace `namespace_id`: refused while tenants other than its default are
    /// bound to it or connections use it, unless `force` (then its tenants are unbound and
    /// their connections' I/O refused). From the new catalog on, requests naming it are
    /// refused as naming no namespace; requests already admitted finish on its device, which
    /// closes once every thread has drained the slot ([`Self::namespace_drained`]).
    pub fn remove_namespace(
        &self,
        namespace_id: u32,
        force: bool,
    ) -> Result<RemovedNamespace, NamespaceChangeError> {
        self.change_from_outside(|state| {
            let catalog = state.catalog.clone().ok_or(NamespaceChangeError::Fixed)?;
            let namespace_index = catalog
                .namespaces
                .index_of(namespace_id)
                .ok_or(NamespaceChangeError::NoSuchNamespace(namespace_id))?;
            if catalog.namespaces.composite(namespace_index).is_some() {
                return Err(NamespaceChangeError::Composite(namespace_id));
            }
            if let Some(composite_id) = catalog.namespaces.composites_over(namespace_index).next() {
                return Err(NamespaceChangeError::Member {
                    namespace_id,
                    composite_id,
                });
            }
            let handles: Vec<u64> = state
                .tenants
                .iter()
                .filter(|(_, entry)| entry.namespace_index == namespace_index)
                .map(|(handle, _)| *handle)
                .collect();
            let names: Vec<String> = handles
                .iter()
                .filter_map(|handle| state.tenants.get(handle))
                .filter(|entry| entry.name != "(default)")
                .map(|entry| entry.name.clone())
                .collect();
            let connections: u32 = {
                let namespace = &state.namespaces[usize::from(namespace_index)];
                handles
                    .iter()
                    .filter_map(|handle| state.tenants.get(handle))
                    .filter_map(|entry| namespace.registry.connections(entry.id))
                    .flat_map(|per_thread| per_thread.iter().copied())
                    .sum()
            };
            if !force && (!names.is_empty() || connections > 0) {
                return Err(NamespaceChangeError::InUse {
                    namespace_id,
                    tenants: names.len(),
                    names: names.join(", "),
                    connections,
                });
            }
            for handle in handles {
                state.forget_tenant(handle);
            }
            let namespace = &mut state.namespaces[usize::from(namespace_index)];
            namespace.removed = true;
            namespace.calibration = None;
            let nbd_exports = catalog
                .nbd_exports
                .as_ref()
                .map(|exports| Arc::new(exports.without_namespace(namespace_index)));
            state.catalog = Some(Catalog {
                namespaces: Arc::new(
                    catalog
                        .namespaces
                        .with_state(namespace_index, SlotState::Removing),
                ),
                nbd_exports,
            });
            let all_threads = if state.threads >= 64 {
                u64::MAX
            } else {
                (1u64 << state.threads) - 1
            };
            state.removing.insert(namespace_index, all_threads);
            state.announce = true;
            tracing::info!(
                namespace = namespace_id,
                namespace_index,
                force,
                unbound = ?names,
                "namespace removed; its device closes once every thread has drained it"
            );
            Ok(RemovedNamespace {
                namespace_index,
                unbound: names,
            })
        })
    }

    /// `thread` holds no request of slot `namespace_index` any more and has closed its device
    /// queue: once every thread has, the slot is gone and the catalog no longer holds its
    /// device.
    pub fn namespace_drained(
        &self,
        thread: usize,
        namespace_index: u16,
        own: &mut Vec<ControlMessage>,
    ) {
        self.change(thread, own, |state| {
            let Some(waiting) = state.removing.get_mut(&namespace_index) else {
                return;
            };
            *waiting &= !(1u64 << thread);
            if *waiting != 0 {
                return;
            }
            state.removing.remove(&namespace_index);
            if let Some(catalog) = state.catalog.as_mut() {
                catalog.namespaces = Arc::new(
                    catalog
                        .namespaces
                        .with_state(namespace_index, SlotState::Gone),
                );
                state.announce = true;
            }
            tracing::info!(
                namespace_index,
                "namespace drained on every thread: device released"
            );
        });
    }

    /// The tenant `handle` as the dataplane addresses it ([`TenantRef::NONE`] when unknown).
    pub fn tenant_ref(&self, handle: u64) -> TenantRef {
        self.lock().tenant_ref(handle)
    }

    /// Charges NBD export `name`'s new sessions to `tenant` on `device_queue` from now on (a
    /// configuration reload moved its binding; sessions already open keep theirs). Returns
    /// whether anything changed.
    pub fn rebind_export(&self, name: &str, tenant: TenantRef, device_queue: Option<u16>) -> bool {
        self.change_from_outside(|state| {
            let Some(catalog) = state.catalog.as_mut() else {
                return false;
            };
            let Some(exports) = catalog
                .nbd_exports
                .as_ref()
                .and_then(|exports| exports.with_binding(name, tenant, device_queue))
            else {
                return false;
            };
            catalog.nbd_exports = Some(Arc::new(exports));
            state.announce = true;
            true
        })
    }

    /// Namespace slots some thread has not drained yet.
    pub fn namespaces_removing(&self) -> usize {
        self.lock().removing.len()
    }

    /// Binds configured tenant `name` to `namespace_id` (a configuration reload): admitted
    /// like a tenant of the configuration file at start. Refused with nothing changed when the
    /// namespace has no QoS, the name is taken there, or admission says no.
    pub fn bind_configured(
        &self,
        namespace_id: u32,
        name: &str,
        spec: TenantSpec,
    ) -> Result<u64, AdminError> {
        self.change_from_outside(|state| {
            let index = Self::check_new_tenant(state, namespace_id, name)?;
            let handle = state
                .register(index, spec, name, false, false)
                .map_err(AdminError::Refused)?;
            if let Some(setup) = state.qos_setups.get_mut(usize::from(index)) {
                let tenant = state
                    .tenants
                    .get(&handle)
                    .map_or(TenantRef::NONE, |entry| entry.tenant_ref(handle));
                setup.tenants.push((name.to_string(), tenant));
            }
            Ok(handle)
        })
    }

    /// Unbinds configured tenant `name` from `namespace_id` (its binding left the
    /// configuration): its connections' I/O is refused (PERMISSION), as after the admin API's
    /// tenant delete.
    pub fn unbind_configured(&self, namespace_id: u32, name: &str) -> Result<(), AdminError> {
        self.change_from_outside(|state| {
            let index = Self::namespace_index_of(state, namespace_id)
                .ok_or(AdminError::NoSuchNamespace(namespace_id))?;
            let handle = state
                .tenants
                .iter()
                .find(|(_, entry)| {
                    entry.namespace_index == index && entry.name == name && !entry.dynamic
                })
                .map(|(handle, _)| *handle)
                .ok_or_else(|| AdminError::NoSuchTenant {
                    namespace_id,
                    name: name.to_string(),
                })?;
            if state.remove_tenant(handle) {
                if let Some(setup) = state.qos_setups.get_mut(usize::from(index)) {
                    setup.tenants.retain(|(known, _)| known != name);
                }
                Ok(())
            } else {
                Err(AdminError::NoSuchTenant {
                    namespace_id,
                    name: name.to_string(),
                })
            }
        })
    }
}

impl State {
    fn namespace(&mut self, namespace_index: u16) -> Option<&mut NamespaceState> {
        self.namespaces.get_mut(usize::from(namespace_index))
    }

    fn tenant_ref(&self, handle: u64) -> TenantRef {
        match self.tenants.get(&handle) {
            Some(entry) => entry.tenant_ref(handle),
            None => TenantRef::NONE,
        }
    }

    /// A RENEGOTIATE notice to every connection of LC tenant `tenant`: the device's scaled
    /// rate no longer fits its reservation (or does again).
    fn notify_device_change(
        &mut self,
        namespace_index: u16,
        tenant: TenantId,
        reason: RenegotiateReason,
    ) {
        let Some(namespace) = self.namespace(namespace_index) else {
            return;
        };
        let Some(&handle) = namespace.handles.get(&tenant) else {
            return;
        };
        let Some(TenantSpec::LatencyCritical {
            iops, read_percent, ..
        }) = namespace.registry.spec(tenant)
        else {
            return;
        };
        let reserved = namespace
            .registry
            .costs()
            .reservation(iops, read_percent, LoadMode::Mixed)
            .as_tokens_per_sec_f64();
        // Tenants that still fit keep their whole reservation; those over share what is left
        // in proportion to their reservations.
        let factor = if namespace.registry.lc_tenants_over().contains(&tenant) {
            namespace.registry.over_granted_share()[LoadMode::Mixed.index()]
        } else {
            1.0
        };
        let granted = (reserved * factor).round() as u64;
        match reason {
            RenegotiateReason::DeviceSlower => {
                if let Some(&told) = namespace.notified_grants.get(&tenant) {
                    let change = (granted as f64 - told as f64).abs() / (told.max(1) as f64);
                    if change <= NOTICE_GRANT_CHANGE_MIN {
                        return;
                    }
                }
                namespace.notified_grants.insert(tenant, granted);
            }
            _ => {
                namespace.notified_grants.remove(&tenant);
            }
        }
        let connections = namespace
            .registry
            .connections(tenant)
            .map(<[u32]>::to_vec)
            .unwrap_or_default();
        let (episode, _) = namespace
            .registry
            .deficit_episodes(tenant)
            .unwrap_or((0, false));
        let body = RenegotiateBody {
            handle,
            episode,
            reserved_iops: iops,
            reserved_tokens_per_sec: reserved.round() as u64,
            observed_iops: 0,
            reason,
            granted_tokens_per_sec: granted,
        };
        let name = self
            .tenants
            .get(&handle)
            .map_or_else(String::new, |entry| entry.name.clone());
        match reason {
            RenegotiateReason::DeviceSlower => tracing::warn!(
                handle,
                tenant = %name,
                reserved_tokens_per_sec = body.reserved_tokens_per_sec,
                granted_tokens_per_sec = body.granted_tokens_per_sec,
                "the device is slower than its profile: the LC reservation no longer fits; \
                 RENEGOTIATE notice"
            ),
            _ => tracing::info!(
                handle,
                tenant = %name,
                ?reason,
                "the LC reservation fits the device again: RENEGOTIATE notice"
            ),
        }
        self.send_notice(&connections, body);
    }

    /// Queues `body` for every thread with connections of the tenant.
    fn send_notice(&mut self, connections_per_thread: &[u32], body: RenegotiateBody) {
        // A member device's notice about a composite namespace's tenant names that tenant:
        // its connections are charged to it (the figures stay the member device's).
        let handle = self
            .tenants
            .get(&body.handle)
            .and_then(|entry| entry.member_of)
            .unwrap_or(body.handle);
        let body = RenegotiateBody { handle, ..body };
        for (thread, &count) in connections_per_thread.iter().enumerate() {
            if count > 0 {
                self.outbox
                    .push((thread as u16, ControlMessage::Notice { body }));
            }
        }
    }

    /// Admits a tenant; returns its new handle or the refusal's reason.
    fn register(
        &mut self,
        namespace_index: u16,
        spec: TenantSpec,
        name: &str,
        read_only: bool,
        dynamic: bool,
    ) -> Result<u64, String> {
        let members = self.register_members(namespace_index, spec, name, read_only)?;
        let mut handle = self.handles.next();
        while self.tenants.contains_key(&handle) {
            handle = self.handles.next();
        }
        for member in &members {
            if let Some(entry) = self.tenants.get_mut(member) {
                entry.member_of = Some(handle);
            }
        }
        let Some(namespace) = self.namespace(namespace_index) else {
            return Err("no QoS on this namespace".into());
        };
        // A composite's own registry only counts connections: its members judged the SLO.
        let own_spec = if namespace.composite.is_some() {
            TenantSpec::BestEffort
        } else {
            spec
        };
        let id = match namespace.registry.register(own_spec) {
            Ok(id) => id,
            Err(error) => {
                for member in members {
                    self.remove_tenant(member);
                }
                return Err(error.to_string());
            }
        };
        namespace.handles.insert(id, handle);
        let namespace_id = namespace.namespace_id;
        let name = if name.is_empty() {
            format!("tenant {handle:016x}")
        } else {
            name.to_string()
        };
        tracing::info!(
            handle,
            tenant = %name,
            namespace = namespace_id,
            ?spec,
            "tenant admitted"
        );
        self.tenants.insert(
            handle,
            TenantEntry {
                grant: if dynamic {
                    Grant::ALL
                } else {
                    self.grants.get(&name).copied().unwrap_or_default()
                },
                namespace_index,
                id,
                name,
                spec,
                read_only,
                dynamic,
                owner: None,
                source: None,
                orphaned_at: None,
                members,
                member_of: None,
                rt_alone_us: None,
            },
        );
        if !dynamic && let Some(&rt_alone_us) = self.alone.get(self.tenants[&handle].name.as_str())
        {
            self.announce_alone(handle, Some(rt_alone_us));
        }
        Ok(handle)
    }

    /// Records `handle`'s RT_alone and tells every thread's fairness monitors, on its
    /// namespace or, for a composite namespace's tenant, on each member's.
    fn announce_alone(&mut self, handle: u64, rt_alone_us: Option<u32>) {
        let Some(entry) = self.tenants.get_mut(&handle) else {
            return;
        };
        entry.rt_alone_us = rt_alone_us;
        let mut targets = vec![(entry.namespace_index, entry.id.0)];
        let members = entry.members.clone();
        for member in members {
            if let Some(member) = self.tenants.get_mut(&member) {
                member.rt_alone_us = rt_alone_us;
                targets.push((member.namespace_index, member.id.0));
            }
        }
        for (namespace_index, tenant) in targets {
            for thread in 0..self.threads {
                self.outbox.push((
                    thread,
                    ControlMessage::Alone {
                        namespace_index,
                        tenant,
                        rt_alone_us,
                    },
                ));
            }
        }
    }

    /// A new SLO for a registered tenant: admission runs again on its namespace, or for a
    /// composite namespace's tenant on every member (a refusal by one puts the members
    /// already changed back). The entry's spec is the caller's to update.
    fn reregister(&mut self, handle: u64, spec: TenantSpec) -> Result<(), String> {
        let Some(entry) = self.tenants.get(&handle) else {
            return Err("no such tenant".into());
        };
        let (namespace_index, id, old_spec, members) = (
            entry.namespace_index,
            entry.id,
            entry.spec,
            entry.members.clone(),
        );
        let Some(namespace) = self.namespace(namespace_index) else {
            return Err("no such namespace".into());
        };
        let Some((_, layout)) = namespace.composite.clone() else {
            return namespace
                .registry
                .reregister(id, spec)
                .map_err(|error| error.to_string());
        };
        let count = members.len();
        let (new, old) = (
            member_spec(spec, layout, count),
            member_spec(old_spec, layout, count),
        );
        for (position, &member) in members.iter().enumerate() {
            if let Err(reason) = self.reregister(member, new) {
                for &done in &members[..position] {
                    let _ = self.reregister(done, old);
                }
                let member_id = self
                    .tenants
                    .get(&member)
                    .and_then(|entry| self.namespaces.get(usize::from(entry.namespace_index)))
                    .map_or(0, |namespace| namespace.namespace_id);
                return Err(format!("member namespace {member_id}: {reason}"));
            }
            if let Some(entry) = self.tenants.get_mut(&member) {
                entry.spec = new;
            }
        }
        Ok(())
    }

    /// A composite namespace's tenant is first admitted on every member, each judged against
    /// that member's device ([`member_spec`]); a refusal by one member undoes the others and
    /// names the member. Returns the member tenants' handles (none for a plain namespace).
    fn register_members(
        &mut self,
        namespace_index: u16,
        spec: TenantSpec,
        name: &str,
        read_only: bool,
    ) -> Result<Vec<u64>, String> {
        let Some(NamespaceState {
            composite: Some((members, layout)),
            namespace_id,
            ..
        }) = self.namespaces.get(usize::from(namespace_index))
        else {
            return Ok(Vec::new());
        };
        let (members, layout, composite_id) = (members.clone(), *layout, *namespace_id);
        let member_spec = member_spec(spec, layout, members.len());
        let base = if name.is_empty() { "tenant" } else { name };
        let mut handles = Vec::new();
        for member in members {
            let member_name = format!("{base}/ns{composite_id}");
            match self.register(member, member_spec, &member_name, read_only, false) {
                Ok(handle) => handles.push(handle),
                Err(reason) => {
                    for handle in handles {
                        self.remove_tenant(handle);
                    }
                    let member_id = self
                        .namespaces
                        .get(usize::from(member))
                        .map_or(0, |state| state.namespace_id);
                    return Err(format!("member namespace {member_id}: {reason}"));
                }
            }
        }
        Ok(handles)
    }

    /// REGISTER of a new tenant by a connection, within the per-connection and per-source
    /// bounds; the connection owns it.
    fn register_owned(
        &mut self,
        namespace_index: u16,
        spec: TenantSpec,
        read_only: bool,
        requester: Requester,
    ) -> ControlAnswer {
        let limits = self.limits;
        let by_connection = self
            .owned_by_connection
            .get(&requester.connection)
            .copied()
            .unwrap_or(0);
        if by_connection >= limits.per_connection_max {
            return ControlAnswer::refused(&format!(
                "this connection owns {by_connection} tenants already, the most one may \
                 (unregister one first)"
            ));
        }
        if let Some(source) = requester.source {
            let by_source = self.owned_by_source.get(&source).copied().unwrap_or(0);
            if by_source >= limits.per_source_max {
                return ControlAnswer::refused(&format!(
                    "connections from {source} own {by_source} tenants already, the most one \
                     address may"
                ));
            }
        }
        match self.register(namespace_index, spec, "", read_only, true) {
            Ok(handle) => {
                if let Some(entry) = self.tenants.get_mut(&handle) {
                    entry.owner = Some(requester.connection);
                    entry.source = requester.source;
                }
                *self
                    .owned_by_connection
                    .entry(requester.connection)
                    .or_insert(0) += 1;
                if let Some(source) = requester.source {
                    *self.owned_by_source.entry(source).or_insert(0) += 1;
                }
                ControlAnswer {
                    status: Status::Ok,
                    body: ControlBody::Handle(handle),
                }
            }
            Err(reason) => ControlAnswer::refused(&reason),
        }
    }

    /// Removes a dynamic tenant: from its registry, the owner counts, the orphans, and
    /// every thread (a Revoke message). Returns false if the registry did not know it.
    fn remove_dynamic(&mut self, handle: u64) -> bool {
        let Some(entry) = self.tenants.get(&handle) else {
            return false;
        };
        assert!(
            entry.dynamic || self.managed.contains(&handle),
            "only tenants registered over the wire or through the admin API are removed"
        );
        self.remove_tenant(handle)
    }

    /// The registry, calibration and default tenant of a namespace in the next slot (and its
    /// configured tenants, admitted in order); its scheduler setup for the threads.
    fn add_namespace_state(
        &mut self,
        namespace: &NamespaceControl,
        composite: Option<&Composite>,
    ) -> Result<NamespaceQosSetup, ControlError> {
        let namespace_index = self.namespaces.len() as u16;
        let composite = composite.map(|composite| {
            let members: Vec<u16> = composite
                .members()
                .iter()
                .map(|member| member.namespace_index)
                .collect();
            (members, composite.layout())
        });
        if composite.is_some() && namespace.profile.is_some() {
            return Err(ControlError::Qos {
                namespace_id: namespace.namespace_id,
                reason: "a composite namespace has no profile of its own: its members' apply"
                    .into(),
            });
        }
        // A composite namespace takes tenants when every member does (has a profile).
        let has_profile = match &composite {
            Some((members, _)) => members.iter().all(|&member| {
                self.namespaces
                    .get(usize::from(member))
                    .is_some_and(|state| state.has_profile)
            }),
            None => namespace.profile.is_some(),
        };
        let profile = namespace.profile.clone().unwrap_or_else(unlimited_profile);
        let registry = TenantRegistry::new(profile, self.qos_config.clone(), self.threads)
            .map_err(|e| ControlError::Qos {
                namespace_id: namespace.namespace_id,
                reason: e.to_string(),
            })?;
        let calibrating = has_profile
            && composite.is_none()
            && self.qos_enabled
            && self.qos_config.calibration.enabled;
        let calibration = if calibrating {
            let calibration =
                DeviceCalibration::new(self.qos_config.calibration.clone(), Nanos::ZERO).map_err(
                    |e| ControlError::Qos {
                        namespace_id: namespace.namespace_id,
                        reason: e.to_string(),
                    },
                )?;
            Some(calibration)
        } else {
            None
        };
        if !has_profile && !namespace.tenants.is_empty() {
            let reason = if composite.is_some() {
                "tenants are bound to it but not every member has a QoS profile"
            } else {
                "tenants are bound to it but it has no QoS profile"
            };
            return Err(ControlError::Qos {
                namespace_id: namespace.namespace_id,
                reason: reason.into(),
            });
        }
        self.namespaces.push(NamespaceState {
            namespace_id: namespace.namespace_id,
            removed: false,
            has_profile,
            registry,
            calibration,
            handles: BTreeMap::new(),
            notified_grants: BTreeMap::new(),
            composite,
        });
        let mut tenants = Vec::new();
        for (name, spec) in &namespace.tenants {
            let handle = self
                .register(namespace_index, *spec, name, false, false)
                .map_err(|reason| ControlError::Refused {
                    namespace_id: namespace.namespace_id,
                    name: name.clone(),
                    reason,
                })?;
            tenants.push((name.clone(), self.tenant_ref(handle)));
        }
        let default_handle = self
            .register(
                namespace_index,
                TenantSpec::BestEffort,
                "(default)",
                false,
                false,
            )
            .map_err(|reason| ControlError::Refused {
                namespace_id: namespace.namespace_id,
                name: "(default)".into(),
                reason,
            })?;
        Ok(NamespaceQosSetup {
            policy: crate::core::policy_for(has_profile, self.qos_enabled),
            shared: Arc::new(DeviceShared::new(self.qos_config.read_only_window())),
            default_tenant: self.tenant_ref(default_handle),
            tenants,
        })
    }

    /// Removes any tenant (configured, default, or dynamic) and revokes it on every thread.
    fn remove_tenant(&mut self, handle: u64) -> bool {
        let Some(entry) = self.tenants.get(&handle) else {
            return false;
        };
        self.managed.remove(&handle);
        let (namespace_index, id, owner, source) =
            (entry.namespace_index, entry.id, entry.owner, entry.source);
        let Some(namespace) = self.namespace(namespace_index) else {
            return false;
        };
        if let Err(error) = namespace.registry.unregister(id) {
            tracing::error!(handle, %error, "registry refused to unregister a known tenant");
            return false;
        }
        namespace.handles.remove(&id);
        namespace.notified_grants.remove(&id);
        let members = self
            .tenants
            .remove(&handle)
            .map(|entry| entry.members)
            .unwrap_or_default();
        for member in members {
            self.remove_tenant(member);
        }
        self.orphans.remove(&handle);
        if let Some(owner) = owner {
            decrement(&mut self.owned_by_connection, &owner);
        }
        if let Some(source) = source {
            decrement(&mut self.owned_by_source, &source);
        }
        for thread in 0..self.threads {
            self.outbox
                .push((thread, ControlMessage::Revoke { handle }));
        }
        tracing::info!(handle, "tenant unregistered");
        true
    }

    /// Forgets a tenant of a namespace being removed (its registry goes with the namespace)
    /// and revokes it on every thread: its connections' I/O is refused from then on.
    fn forget_tenant(&mut self, handle: u64) {
        let Some(entry) = self.tenants.remove(&handle) else {
            return;
        };
        self.managed.remove(&handle);
        self.orphans.remove(&handle);
        if let Some(owner) = entry.owner {
            decrement(&mut self.owned_by_connection, &owner);
        }
        if let Some(source) = entry.source {
            decrement(&mut self.owned_by_source, &source);
        }
        for thread in 0..self.threads {
            self.outbox
                .push((thread, ControlMessage::Revoke { handle }));
        }
        tracing::info!(handle, tenant = %entry.name, "tenant unbound: its namespace is removed");
    }

    fn connect(&mut self, handle: u64, thread: u16) -> bool {
        let Some(entry) = self.tenants.get(&handle) else {
            return false;
        };
        // A composite's tenant has its connections on every member: each member's share of
        // the tenant follows them to the threads, as for a tenant of that member.
        for member in entry.members.clone() {
            if !self.connect(member, thread) {
                return false;
            }
        }
        let Some(entry) = self.tenants.get(&handle) else {
            return false;
        };
        let (namespace_index, id) = (entry.namespace_index, entry.id);
        let Some(namespace) = self.namespace(namespace_index) else {
            return false;
        };
        match namespace.registry.connect(id, thread) {
            Ok(()) => true,
            Err(error) => {
                tracing::error!(handle, %error, "cannot count a connection of a known tenant");
                false
            }
        }
    }
}

/// What a composite namespace's tenant asks of each member: a stripe spreads a tenant's I/O
/// evenly over its members, so each gets an even share of the IOPS (rounded up); a
/// concatenation gives no such spread (a tenant may send all of it to one member), so each
/// member is asked for the whole reservation. Best effort stays best effort.
pub fn member_spec(spec: TenantSpec, layout: CompositeLayout, members: usize) -> TenantSpec {
    match (spec, layout) {
        (
            TenantSpec::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            },
            CompositeLayout::Stripe { .. },
        ) => TenantSpec::LatencyCritical {
            latency_us_p95,
            iops: iops.div_ceil(members.max(1) as u64),
            read_percent,
        },
        (spec, _) => spec,
    }
}

/// The profile of a namespace without one: a rate no device reaches, so its first-in,
/// first-out scheduler never holds a request back for tokens.
fn unlimited_profile() -> DeviceProfile {
    DeviceProfile {
        name: "unlimited (no profile)".into(),
        write_cost: 1.0,
        read_only_read_cost: 1.0,
        token_limits: vec![TokenLimit {
            latency_us_p95: 1_000_000,
            tokens_per_sec: 1e9,
            reads_per_sec_read_only: 1e9,
        }],
    }
}

/// Counts one fewer under `key`, forgetting keys that reach zero.
fn decrement<K: Ord>(counts: &mut BTreeMap<K, u32>, key: &K) {
    if let Some(count) = counts.get_mut(key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(key);
        }
    }
}
