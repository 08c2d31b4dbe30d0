//! Tenants on one dataplane: whom each request is charged to, what each tenant did here, the
//! control requests of native connections (REGISTER, UNREGISTER, BIND, REPORT), and the messages and
//! scheduler events exchanged with the control plane (`crate::control`).
//!
//! Every I/O is charged to a tenant: the one the connection BINDs to, else the NBD export's or
//! original port's configured tenant, else the namespace's default best-effort tenant. A
//! connection is counted in the control plane's registry for each tenant it charged
//! (`Connection::charged`), so each thread's share of a tenant follows its connections.
//! Control messages (rate updates, revocations, RENEGOTIATE notices) are applied at most
//! [`MESSAGES_PER_ITERATION_MAX`] per iteration after one atomic check; control requests and
//! a connection's first I/O to a tenant take the control plane's lock, off the I/O path.

use std::collections::BTreeMap;

use reflex_qos::{Admitted, Nanos, SchedulerEvent, TenantSpec};

use super::Dataplane;
use super::connection::{Bound, Charge};
use crate::access::Refusal;
use crate::control::{
    ConnectionKey, ControlAnswer, ControlMessage, ControlPlane, MESSAGES_PER_ITERATION_MAX,
    Requester, TenantRef,
};
use crate::frontend::{Answer, ControlRequest, Frontend, IoKind, IoRequest};
use reflex_proto::kv::Status as KvStatus;
use reflex_proto::native::ReportBody;
use reflex_proto::native::Status as NativeStatus;

/// RENEGOTIATE notices a connection holds while it cannot send them (window full); beyond
/// it the oldest is dropped (counted in `CoreStats::notices_dropped`).
pub const NOTICES_PENDING_MAX: usize = 4;

/// Fewest reads a client's REPORT must cover to count: below it, its "p95" is one of a
/// handful of reads.
pub const CLIENT_REPORT_READS_MIN: u32 = 20;

/// One tenant's work on one dataplane thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantStats {
    pub handle: u64,
    pub namespace_id: u32,
    /// Device operations the scheduler admitted (a multi-step request counts each step).
    pub requests: u64,
    pub bytes: u64,
    /// Tokens charged, in millitokens.
    pub millitokens: i64,
    /// Deficit episodes that started on this thread.
    pub deficit_episodes: u64,
    /// Requests received for it (its demand).
    pub arrivals: u64,
    /// Time its admitted requests waited in the scheduler, summed, and the longest wait.
    pub scheduler_wait_ns: u64,
    pub scheduler_wait_ns_max: u64,
    /// Device time (submission to completion) of its requests, summed.
    pub device_ns: u64,
}

impl TenantStats {
    /// Adds `other`'s counts (the maximum wait: the larger one).
    pub fn add(&mut self, other: &TenantStats) {
        self.requests += other.requests;
        self.bytes += other.bytes;
        self.millitokens += other.millitokens;
        self.deficit_episodes += other.deficit_episodes;
        self.arrivals += other.arrivals;
        self.scheduler_wait_ns += other.scheduler_wait_ns;
        self.scheduler_wait_ns_max = self.scheduler_wait_ns_max.max(other.scheduler_wait_ns_max);
        self.device_ns += other.device_ns;
    }
}

/// This thread's accounting of one tenant id of a namespace.
#[derive(Debug, Clone, Default)]
pub(super) struct TenantAccount {
    pub(super) stats: TenantStats,
    meter: DemandMeter,
    /// Live figures (`crate::live`): device operations by kind, read latency, and the
    /// deficit episode going on here, if any, with the time spent in finished ones.
    pub(super) reads: u64,
    pub(super) read_bytes: u64,
    pub(super) writes: u64,
    pub(super) write_bytes: u64,
    pub(super) read_latency: crate::telemetry::LatencyHistogram,
    pub(super) deficit_since: Option<Nanos>,
    pub(super) deficit_ns: u64,
    /// Requests refused by access control, by [`Refusal::index`].
    pub(super) refusals: [u64; Refusal::COUNT],
}

/// Why [`Dataplane::charge`] refused a request: an answer decided before any tenant was
/// resolved, or an access-control refusal of `tenant` (counted and logged).
enum Refused {
    Answer(Answer),
    Access {
        refusal: Refusal,
        tenant: TenantRef,
        namespace_index: u16,
    },
}

impl TenantAccount {
    pub(super) fn admitted(&mut self, request: &Admitted, wait_ns: u64) {
        self.stats.requests += 1;
        self.stats.bytes += u64::from(request.size_bytes);
        self.stats.millitokens += request.cost.0;
        self.stats.scheduler_wait_ns += wait_ns;
        self.stats.scheduler_wait_ns_max = self.stats.scheduler_wait_ns_max.max(wait_ns);
        match request.kind {
            reflex_qos::IoKind::Read => {
                self.reads += 1;
                self.read_bytes += u64::from(request.size_bytes);
            }
            reflex_qos::IoKind::Write => {
                self.writes += 1;
                self.write_bytes += u64::from(request.size_bytes);
            }
        }
    }
}

/// The request rate a RENEGOTIATE notice reports: arrivals over the current and the previous
/// window of [`DEMAND_WINDOW`], measured over at least [`DEMAND_SPAN_MIN`].
#[derive(Debug, Clone, Copy, Default)]
struct DemandMeter {
    current_start: Nanos,
    current_arrivals: u64,
    previous_arrivals: u64,
    previous_ns: u64,
}

const DEMAND_WINDOW: Nanos = Nanos(1_000_000_000);
const DEMAND_SPAN_MIN: Nanos = Nanos(10_000_000);

impl DemandMeter {
    fn starting(now: Nanos) -> DemandMeter {
        DemandMeter {
            current_start: now,
            ..DemandMeter::default()
        }
    }

    fn arrival(&mut self, now: Nanos) {
        let elapsed = now.saturating_since(self.current_start);
        if elapsed >= DEMAND_WINDOW {
            self.previous_arrivals = self.current_arrivals;
            self.previous_ns = elapsed.0;
            self.current_start = now;
            self.current_arrivals = 0;
        }
        self.current_arrivals += 1;
    }

    fn iops(&self, now: Nanos) -> u64 {
        let span_ns =
            (self.previous_ns + now.saturating_since(self.current_start).0).max(DEMAND_SPAN_MIN.0);
        let arrivals = self.previous_arrivals + self.current_arrivals;
        (u128::from(arrivals) * 1_000_000_000 / u128::from(span_ns)) as u64
    }
}

/// One namespace's scheduler and tenant accounts on this thread.
pub(super) struct NamespaceQos {
    pub(super) scheduler: reflex_qos::Scheduler,
    /// The fairness stage between the scheduler and the device (off unless configured).
    pub(super) fair: reflex_qos::FairQueue,
    /// Inter-core migration (`migration`; off unless configured) and the device's shared
    /// state, where the threads publish their loads.
    pub(super) migrator: reflex_qos::Migrator,
    pub(super) shared: std::sync::Arc<reflex_qos::DeviceShared>,
    /// Scratch: every thread's load when a plan is made.
    pub(super) loads: Vec<reflex_qos::ThreadLoad>,
    pub(super) default_tenant: TenantRef,
    pub(super) namespace_id: u32,
    /// By tenant id; grown when this thread first charges a tenant (control path).
    pub(super) accounts: Vec<TenantAccount>,
}

impl Dataplane {
    /// Scheduler events: room in a full tenant queue (retry the blocked requests next
    /// iteration), and deficit episodes (to the control plane, which sends RENEGOTIATE).
    pub(super) fn handle_scheduler_events(&mut self, now: Nanos) {
        for namespace_index in 0..self.qos.len() {
            loop {
                let namespace = &mut self.qos[namespace_index];
                let Some(event) = namespace.scheduler.poll_event() else {
                    break;
                };
                let observed_iops = match event {
                    SchedulerEvent::QueueRoom { .. } => {
                        self.queue_room = true;
                        continue;
                    }
                    SchedulerEvent::DeficitLimitReached { tenant } => {
                        match namespace.accounts.get_mut(tenant.0 as usize) {
                            Some(account) => {
                                account.stats.deficit_episodes += 1;
                                account.deficit_since.get_or_insert(now);
                                account.meter.iops(now)
                            }
                            None => 0,
                        }
                    }
                    SchedulerEvent::DeficitRecovered { tenant } => {
                        if let Some(account) = namespace.accounts.get_mut(tenant.0 as usize)
                            && let Some(since) = account.deficit_since.take()
                        {
                            account.deficit_ns += now.saturating_since(since).0;
                        }
                        0
                    }
                };
                self.with_control(now, |control, thread, own| {
                    control.scheduler_event(
                        thread,
                        namespace_index as u16,
                        event,
                        observed_iops,
                        own,
                    );
                });
            }
        }
    }

    /// Calls the control plane for this thread and applies the messages it returns for this
    /// thread, in order, before anything else happens here.
    pub(super) fn with_control<R>(
        &mut self,
        now: Nanos,
        call: impl FnOnce(&ControlPlane, usize, &mut Vec<ControlMessage>) -> R,
    ) -> R {
        let mut messages = std::mem::take(&mut self.messages);
        messages.clear();
        let result = call(&self.control, self.thread_index, &mut messages);
        for message in messages.drain(..) {
            self.apply_message(message, now);
        }
        self.messages = messages;
        result
    }

    /// Applies up to [`MESSAGES_PER_ITERATION_MAX`] messages waiting in this thread's mailbox.
    pub(super) fn apply_control_messages(&mut self, now: Nanos) {
        let mut messages = std::mem::take(&mut self.messages);
        messages.clear();
        self.control
            .take_messages(self.thread_index, MESSAGES_PER_ITERATION_MAX, &mut messages);
        for message in messages.drain(..) {
            self.apply_message(message, now);
        }
        self.messages = messages;
    }

    fn apply_message(&mut self, message: ControlMessage, now: Nanos) {
        self.stats.control_messages += 1;
        match message {
            ControlMessage::Rates {
                namespace_index,
                update,
            } => {
                tracing::debug!(
                    thread = self.thread_index,
                    namespace_index,
                    ?update,
                    "rate update"
                );
                match self.qos.get_mut(usize::from(namespace_index)) {
                    Some(namespace) => namespace.scheduler.apply(update, now),
                    None => tracing::error!(
                        thread = self.thread_index,
                        namespace_index,
                        "rate update for a namespace slot this thread does not know"
                    ),
                }
            }
            ControlMessage::Namespaces => self.adopt_catalog(now),
            ControlMessage::Alone {
                namespace_index,
                tenant,
                rt_alone_us,
            } => match self.qos.get_mut(usize::from(namespace_index)) {
                Some(namespace) => namespace.fair.set_alone(
                    reflex_qos::FlowId(u64::from(tenant)),
                    rt_alone_us.map(f64::from),
                ),
                None => tracing::error!(
                    thread = self.thread_index,
                    namespace_index,
                    "RT_alone for a namespace slot this thread does not know"
                ),
            },
            ControlMessage::Revoke { handle } => {
                self.member_tenants.remove(&handle);
                for connection in self.connections.iter_mut() {
                    if let Some(bound) = connection.bound.as_mut()
                        && bound.tenant.handle == handle
                    {
                        bound.revoked = true;
                    }
                    // The registry forgot the tenant: nothing to disconnect later.
                    connection
                        .charged
                        .retain(|charge| charge.tenant.handle != handle);
                }
            }
            ControlMessage::Grant { handle, grant } => {
                for connection in self.connections.iter_mut() {
                    if let Some(bound) = connection.bound.as_mut()
                        && bound.tenant.handle == handle
                    {
                        bound.grant = grant;
                    }
                    for charge in connection.charged.iter_mut() {
                        if charge.tenant.handle == handle {
                            charge.grant = grant;
                        }
                    }
                }
            }
            ControlMessage::Notice { body } => {
                let draining = self.phase != super::Phase::Running;
                for index in 0..self.connections.len() {
                    let connection = &mut self.connections[index];
                    let charged = connection
                        .charged
                        .iter()
                        .any(|charge| charge.tenant.handle == body.handle);
                    if !connection.is_open()
                        || draining
                        || !matches!(connection.frontend, Frontend::Native)
                        || !charged
                    {
                        continue;
                    }
                    if connection.notices.len() >= NOTICES_PENDING_MAX {
                        connection.notices.pop_front();
                        self.stats.notices_dropped += 1;
                    }
                    connection.notices.push_back(body);
                    self.mark_parse(index as u32);
                }
            }
        }
    }

    pub(super) fn set_qos_participating(&mut self, participating: bool) {
        if self.qos_participating == participating {
            return;
        }
        self.qos_participating = participating;
        for namespace in &mut self.qos {
            namespace.scheduler.set_participating(participating);
        }
    }

    /// Resolves the tenant of an I/O request and checks the connection may do it: a BIND
    /// limits the connection to its tenant's namespace (and to reads, for a read-only
    /// tenant), and every tenant's grant (`crate::access::Grant`) limits what its requests
    /// may do. The tenant is the bound one, else the protocol's (NBD export, original port,
    /// NVMe/TCP host), else the namespace's default; the connection is counted for it the
    /// first time. A refusal is counted for the tenant and logged (rate-limited).
    pub(super) fn charge(
        &mut self,
        connection_index: u32,
        io: IoRequest,
        now: Nanos,
    ) -> Result<IoRequest, Answer> {
        self.charge_checked(connection_index, io, now)
            .map_err(|refused| match refused {
                Refused::Answer(answer) => answer,
                Refused::Access {
                    refusal,
                    tenant,
                    namespace_index,
                } => {
                    self.record_refusal(
                        connection_index,
                        io,
                        tenant,
                        namespace_index,
                        refusal,
                        now,
                    );
                    Answer::Permission
                }
            })
    }

    /// Counts a refusal for its tenant and logs it with the peer's address and the tenant
    /// (at most [`crate::access::REFUSAL_LOG_BURST`] lines at once per thread, then one a
    /// second, each saying how many were not logged).
    fn record_refusal(
        &mut self,
        connection_index: u32,
        io: IoRequest,
        tenant: TenantRef,
        namespace_index: u16,
        refusal: Refusal,
        now: Nanos,
    ) {
        if let Some(account) = self
            .qos
            .get_mut(usize::from(namespace_index))
            .and_then(|namespace| namespace.accounts.get_mut(tenant.id as usize))
            && account.stats.handle == tenant.handle
        {
            account.refusals[refusal.index()] += 1;
        }
        let Some(suppressed) = self.refusal_log.admit(now) else {
            return;
        };
        let name = self.control.name(tenant.handle);
        let connection = &self.connections[connection_index as usize];
        let listener = &self.listeners[connection.listener as usize].access.name;
        tracing::warn!(
            thread = self.thread_index,
            peer = ?connection.source,
            listener = %listener,
            tenant = %name,
            namespace = self.namespaces.id(io.namespace_index),
            kind = ?io.kind,
            offset_bytes = io.offset_bytes,
            length_bytes = io.length_bytes,
            %refusal,
            refused_unlogged = suppressed,
            "request refused"
        );
    }

    fn charge_checked(
        &mut self,
        connection_index: u32,
        mut io: IoRequest,
        now: Nanos,
    ) -> Result<IoRequest, Refused> {
        let namespace_index = io.namespace_index;
        if !self.namespaces.is_live(namespace_index)
            || self.qos.len() <= usize::from(namespace_index)
        {
            // Removed at run time (an NBD export or original port still names its slot).
            return Err(Refused::Answer(Answer::Native(
                reflex_proto::native::Status::NoSuchNamespace,
            )));
        }
        let connection = &self.connections[connection_index as usize];
        let writes = match io.kind {
            IoKind::Write { .. } | IoKind::Trim { .. } | IoKind::WriteZeroes { .. } => true,
            IoKind::Kv { opcode, .. } => crate::frontend::kv_writes(opcode),
            _ => false,
        };
        let range = match io.kind {
            // A KV request names a key, not a byte range: a grant's range does not apply.
            IoKind::Flush | IoKind::Kv { .. } => None,
            _ => Some((io.offset_bytes, u64::from(io.length_bytes))),
        };
        if let Some(bound) = connection.bound {
            let refusal = if bound.revoked {
                Some(Refusal::Revoked)
            } else if bound.namespace_index != namespace_index {
                Some(Refusal::Namespace)
            } else if bound.read_only && writes {
                Some(Refusal::ReadOnly)
            } else {
                bound.grant.check(writes, range).err()
            };
            if let Some(refusal) = refusal {
                return Err(Refused::Access {
                    refusal,
                    tenant: bound.tenant,
                    namespace_index: bound.namespace_index,
                });
            }
        }
        // A TLS client certificate names the connection's tenant: it is charged to no other.
        let identity = if connection
            .tls
            .as_ref()
            .is_some_and(|tls| tls.peer_name.is_some())
        {
            match self.identity_tenant(connection_index, namespace_index, now) {
                Some(tenant) => Some(tenant),
                None => {
                    // The certificate's tenant has nothing on this namespace: counted for
                    // the tenant the request would have been charged to.
                    let connection = &self.connections[connection_index as usize];
                    let tenant = match connection.bound {
                        Some(bound) => bound.tenant,
                        None if !io.tenant.is_none() => io.tenant,
                        None => self.qos[usize::from(namespace_index)].default_tenant,
                    };
                    return Err(Refused::Access {
                        refusal: Refusal::Identity,
                        tenant,
                        namespace_index,
                    });
                }
            }
        } else {
            None
        };
        let connection = &self.connections[connection_index as usize];
        let namespace = &self.qos[usize::from(namespace_index)];
        let tenant = match connection.bound {
            Some(bound) => bound.tenant,
            None if !io.tenant.is_none() => io.tenant,
            None => identity.unwrap_or(namespace.default_tenant),
        };
        if let Some(identity) = identity
            && identity.handle != tenant.handle
        {
            // Counted for the certificate's tenant: the connection asked for another's.
            return Err(Refused::Access {
                refusal: Refusal::Identity,
                tenant: identity,
                namespace_index,
            });
        }
        let counted = connection
            .charged
            .iter()
            .find(|charge| charge.tenant.handle == tenant.handle)
            .map(|charge| (charge.namespace_index, charge.grant));
        let (tenant_namespace_index, grant) = match counted {
            Some(counted) => counted,
            None => {
                let Some(connected) = self.with_control(now, |control, thread, own| {
                    control.connect(thread, tenant.handle, own)
                }) else {
                    return Err(Refused::Answer(Answer::Permission));
                };
                self.connections[connection_index as usize]
                    .charged
                    .push(Charge {
                        namespace_index: connected.namespace_index,
                        tenant,
                        grant: connected.grant,
                    });
                self.ensure_account(connected.namespace_index, tenant, now);
                if self
                    .namespaces
                    .composite(connected.namespace_index)
                    .is_some()
                {
                    self.learn_member_tenants(connected.namespace_index, tenant.handle, now);
                }
                (connected.namespace_index, connected.grant)
            }
        };
        // A protocol's tenant belongs to the namespace its export, port or host names; a
        // request for another namespace is not the tenant's to make.
        let refusal = if tenant_namespace_index != namespace_index {
            Some(Refusal::Namespace)
        } else {
            grant.check(writes, range).err()
        };
        if let Some(refusal) = refusal {
            return Err(Refused::Access {
                refusal,
                tenant,
                namespace_index: tenant_namespace_index,
            });
        }
        if let Some(account) = self.qos[usize::from(namespace_index)]
            .accounts
            .get_mut(tenant.id as usize)
        {
            account.stats.arrivals += 1;
            account.meter.arrival(now);
        }
        io.tenant = tenant;
        Ok(io)
    }

    /// Makes sure this thread accounts for `tenant` (its id may have served another tenant
    /// before: that one's figures are kept by handle).
    pub(super) fn ensure_account(&mut self, namespace_index: u16, tenant: TenantRef, now: Nanos) {
        let namespace = &mut self.qos[usize::from(namespace_index)];
        let id = tenant.id as usize;
        if namespace.accounts.len() <= id {
            namespace.accounts.resize(id + 1, TenantAccount::default());
        }
        let account = &mut namespace.accounts[id];
        if account.stats.handle == tenant.handle {
            return;
        }
        if account.stats.handle != 0 {
            let retired = self
                .retired_accounts
                .entry(account.stats.handle)
                .or_insert_with(|| TenantStats {
                    handle: account.stats.handle,
                    namespace_id: account.stats.namespace_id,
                    ..TenantStats::default()
                });
            retired.add(&account.stats);
        }
        *account = TenantAccount {
            stats: TenantStats {
                handle: tenant.handle,
                namespace_id: namespace.namespace_id,
                ..TenantStats::default()
            },
            meter: DemandMeter::starting(now),
            ..TenantAccount::default()
        };
    }

    /// The tenant the connection's TLS identity is on a namespace (cached per connection);
    /// `None`: it has none there.
    fn identity_tenant(
        &mut self,
        connection_index: u32,
        namespace_index: u16,
        now: Nanos,
    ) -> Option<TenantRef> {
        let link = self.connections[connection_index as usize].tls.as_ref()?;
        if let Some(&(_, tenant)) = link
            .identity_tenants
            .iter()
            .find(|(index, _)| *index == namespace_index)
        {
            return tenant;
        }
        let name = link.peer_name.clone()?;
        let registered = self.with_control(now, |control, _, _| {
            control.identity_tenant(namespace_index, &name)
        });
        // A namespace without QoS keeps no tenants: the configuration says whom it serves.
        let namespace = &self.qos[usize::from(namespace_index)];
        let tenant = registered.or_else(|| {
            let identities = self.tls.as_ref()?.keys.current().identities;
            identities
                .get(&name)?
                .contains(&namespace.namespace_id)
                .then_some(namespace.default_tenant)
        });
        if let Some(link) = self.connections[connection_index as usize].tls.as_mut() {
            link.identity_tenants.push((namespace_index, tenant));
        }
        tenant
    }

    /// A control request of a native connection (REGISTER, UNREGISTER, BIND, REPORT).
    pub(super) fn control_request(
        &mut self,
        connection_index: u32,
        request: ControlRequest,
        now: Nanos,
    ) -> ControlAnswer {
        let identified = self.connections[connection_index as usize]
            .tls
            .as_ref()
            .is_some_and(|tls| tls.peer_name.is_some());
        if identified {
            // Its certificate chose its tenant: it registers none and binds to no other.
            return match request {
                ControlRequest::Bind { handle } => {
                    self.bind_identified(connection_index, handle, now)
                }
                ControlRequest::Report(report) => self.client_report(connection_index, report),
                ControlRequest::Register(_) | ControlRequest::Unregister { .. } => {
                    ControlAnswer::permission()
                }
            };
        }
        match request {
            ControlRequest::Register(body) => {
                let namespace_index = self.namespaces.index_of(body.namespace_id);
                let requester = self.requester(connection_index);
                let answer = self.with_control(now, |control, thread, own| {
                    control.register(thread, namespace_index, &body, requester, own)
                });
                if answer.is_ok() && body.handle == TenantRef::NONE.handle {
                    self.connections[connection_index as usize].owns_tenants = true;
                }
                answer
            }
            ControlRequest::Unregister { handle } => {
                let requester = self.requester(connection_index);
                self.with_control(now, |control, thread, own| {
                    control.unregister(thread, handle, requester, own)
                })
            }
            ControlRequest::Bind { handle } => self.bind(connection_index, handle, now),
            ControlRequest::Report(report) => self.client_report(connection_index, report),
        }
    }

    /// REPORT: what the client of the connection's latency-critical tenant measured end to
    /// end over its last interval, and the requests it holds due and unsent. The p95's excess
    /// over the tenant's SLO and the backlog go into the device's telemetry window, where
    /// self-calibration learns the share of the SLO spent outside the server and whether the
    /// tenant slowed down when a squeeze told it to (of every member device, for a composite
    /// namespace). It is advice, not a command: from a connection not bound to a live LC
    /// tenant it is answered OK and ignored, and a p95 of too few reads is not counted.
    fn client_report(&mut self, connection_index: u32, report: ReportBody) -> ControlAnswer {
        let Some(bound) = self.connections[connection_index as usize].bound else {
            return ControlAnswer::ok();
        };
        if bound.revoked {
            return ControlAnswer::ok();
        }
        let slo_us = match self
            .control
            .tenant(bound.tenant.handle)
            .map(|info| info.spec)
        {
            Some(TenantSpec::LatencyCritical { latency_us_p95, .. }) => latency_us_p95,
            _ => return ControlAnswer::ok(),
        };
        let excess_us = (report.reads >= CLIENT_REPORT_READS_MIN)
            .then(|| i64::from(report.read_p95_us) - i64::try_from(slo_us).unwrap_or(i64::MAX));
        // A composite namespace calibrates nothing itself: its tenant's reads are measured on
        // the members they land on, so what its client saw end to end is every member's
        // evidence (each member's p95 is part of it).
        let mut note = |namespace_index: u16| {
            if let Some(telemetry) = self.telemetry.get_mut(usize::from(namespace_index)) {
                if let Some(excess_us) = excess_us {
                    telemetry.window.note_client_excess(excess_us);
                }
                telemetry
                    .window
                    .note_client_backlog(u64::from(report.backlog));
            }
        };
        match self.namespaces.composite(bound.namespace_index) {
            Some(composite) => composite
                .members()
                .iter()
                .for_each(|member| note(member.namespace_index)),
            None => note(bound.namespace_index),
        }
        ControlAnswer::ok()
    }

    /// The connection as the control plane knows it.
    pub(super) fn requester(&self, connection_index: u32) -> Requester {
        let connection = &self.connections[connection_index as usize];
        Requester {
            connection: ConnectionKey {
                thread: self.thread_index as u16,
                index: connection_index,
                generation: connection.generation,
            },
            source: connection.source,
        }
    }

    /// The connection closed: the tenants it registered become orphans.
    pub(super) fn release_owned_tenants(&mut self, connection_index: u32) {
        let connection = &mut self.connections[connection_index as usize];
        if !std::mem::take(&mut connection.owns_tenants) {
            return;
        }
        let key = self.requester(connection_index).connection;
        let now = self.last_now;
        self.with_control(now, |control, thread, own| {
            control.connection_closed(thread, key, now, own)
        });
    }

    /// Orphaned tenants past their grace period are unregistered (housekeeping).
    pub(super) fn reap_orphaned_tenants(&mut self, now: Nanos) {
        if self.control.has_orphans() {
            self.with_control(now, |control, thread, own| {
                control.reap_orphans(thread, now, own)
            });
        }
    }

    /// BIND: the connection's I/O is charged to `handle` from now on (0: back to the
    /// defaults). It stops counting for every other tenant it was charged to.
    /// BIND on a connection with a TLS identity: only to its own tenant (or back to it, 0).
    fn bind_identified(&mut self, connection_index: u32, handle: u64, now: Nanos) -> ControlAnswer {
        if handle != TenantRef::NONE.handle {
            let Some(binding) =
                self.with_control(now, |control, _, _| control.peek_binding(handle))
            else {
                return ControlAnswer::invalid();
            };
            let own = self.identity_tenant(connection_index, binding.namespace_index, now);
            if own.is_none_or(|own| own.handle != handle) {
                return ControlAnswer::permission();
            }
        }
        self.bind(connection_index, handle, now)
    }

    fn bind(&mut self, connection_index: u32, handle: u64, now: Nanos) -> ControlAnswer {
        let connection = &mut self.connections[connection_index as usize];
        if handle == TenantRef::NONE.handle {
            if let Some(bound) = connection.bound.take()
                && let Some(position) = connection
                    .charged
                    .iter()
                    .position(|charge| charge.tenant.handle == bound.tenant.handle)
            {
                connection.charged.swap_remove(position);
                self.with_control(now, |control, thread, own| {
                    control.disconnect(thread, std::iter::once(bound.tenant.handle), own);
                });
            }
            return ControlAnswer::ok();
        }
        if let Some(bound) = connection.bound
            && bound.tenant.handle == handle
            && !bound.revoked
        {
            return ControlAnswer::ok();
        }
        let Some(binding) = self.with_control(now, |control, thread, own| {
            control.bind(thread, handle, own)
        }) else {
            return ControlAnswer::invalid();
        };
        let mut charged = self.release_charges(connection_index);
        charged.push(Charge {
            namespace_index: binding.namespace_index,
            tenant: binding.tenant,
            grant: binding.grant,
        });
        let connection = &mut self.connections[connection_index as usize];
        connection.charged = charged;
        connection.bound = Some(Bound {
            tenant: binding.tenant,
            namespace_index: binding.namespace_index,
            read_only: binding.read_only,
            grant: binding.grant,
            revoked: false,
        });
        self.ensure_account(binding.namespace_index, binding.tenant, now);
        if self.namespaces.composite(binding.namespace_index).is_some() {
            self.learn_member_tenants(binding.namespace_index, binding.tenant.handle, now);
        }
        self.spread_bound(connection_index, handle);
        ControlAnswer::ok()
    }

    /// KV BIND: like a native BIND (same bookkeeping, revocation, per-thread counts), but
    /// only to a tenant of the table's namespace; a refused BIND keeps the old binding.
    pub(super) fn kv_bind(&mut self, connection_index: u32, handle: u64, now: Nanos) -> Answer {
        let Frontend::Kv {
            namespace_index, ..
        } = self.connections[connection_index as usize].frontend
        else {
            return Answer::Kv(KvStatus::Invalid);
        };
        if handle != TenantRef::NONE.handle {
            let binding = self.with_control(now, |control, _, _| control.peek_binding(handle));
            if binding.is_none_or(|binding| binding.namespace_index != namespace_index) {
                return Answer::Kv(KvStatus::NoTenant);
            }
        }
        let answer = self.control_request(connection_index, ControlRequest::Bind { handle }, now);
        match answer.status {
            NativeStatus::Ok => Answer::Ok,
            NativeStatus::Permission => Answer::Permission,
            // Removed between the check and the BIND.
            _ => Answer::Kv(KvStatus::NoTenant),
        }
    }

    /// Tells the control plane the connection no longer counts for the tenants it was charged
    /// to, and returns its (now empty) charge list, capacity kept for reuse.
    pub(super) fn release_charges(&mut self, connection_index: u32) -> Vec<Charge> {
        let mut charged = std::mem::take(&mut self.connections[connection_index as usize].charged);
        if !charged.is_empty() {
            let mut messages = std::mem::take(&mut self.messages);
            messages.clear();
            self.control.disconnect(
                self.thread_index,
                charged.iter().map(|charge| charge.tenant.handle),
                &mut messages,
            );
            // Messages for this thread from a disconnect are rate updates: applied at the
            // iteration's time like every other message.
            let now = self.last_now;
            for message in messages.drain(..) {
                self.apply_message(message, now);
            }
            self.messages = messages;
        }
        charged.clear();
        charged
    }

    /// What each tenant did on this thread, by handle.
    pub fn tenant_stats(&self) -> Vec<TenantStats> {
        let mut by_handle: BTreeMap<u64, TenantStats> = self.retired_accounts.clone();
        for namespace in &self.qos {
            for account in &namespace.accounts {
                if account.stats.handle == 0 {
                    continue;
                }
                by_handle
                    .entry(account.stats.handle)
                    .or_insert_with(|| TenantStats {
                        handle: account.stats.handle,
                        namespace_id: account.stats.namespace_id,
                        ..TenantStats::default()
                    })
                    .add(&account.stats);
            }
        }
        by_handle.into_values().collect()
    }
}
