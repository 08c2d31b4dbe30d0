//! The ReFlex dataplane as a sans-IO state machine: one [`Dataplane`] per thread holds the
//! connections, requests, buffer arena, protocol front ends and per-namespace QoS schedulers,
//! and is driven by a driver that moves bytes: io_uring or epoll in `reflexd`
//! (`reflex-server`), a virtual network and the emulated device in the simulator
//! (`reflex-sim`). Both run this same code, so what the simulator shows is what the server
//! does.
//!
//! Module map: `core` (the state machine: [`Dataplane`] and its typed [`Op`]s), `frontend`
//! (native, original ReFlex and NBD protocol glue over `reflex_proto`), `steps` (requests that
//! take several device operations: large, unaligned, zeroing), `gate` (the ordering of
//! read-modify-writes, shared by the threads), `control` (tenants, admission and the messages
//! to the threads' schedulers), `buffers` (page allocation in the arena), `memory` (the arena
//! itself: with `unsafe`, as has the one call in `core/kv_owner.rs` that uses a run another
//! thread lent), `namespaces`, `composite` (a namespace striped or
//! concatenated over others: the address mapping; QoS stays per member device), `access`
//! (listeners' allow-lists, tenants' grants, refusals).
//!
//! Architecture invariants: no socket, no clock, no thread and no io_uring here (time is a
//! parameter; the crate does not link the ring code); bad input from the network gets an
//! error status or closes only its own connection, never panics; every limit is a named
//! constant or a field of [`Limits`].

#![deny(unsafe_code)]

pub mod access;
pub mod buffers;
pub mod composite;
pub mod control;
mod core;
pub mod frontend;
pub mod gate;
pub mod live;
#[allow(unsafe_code)]
mod memory;
pub mod namespaces;
pub mod self_calibration;
pub mod steps;
pub mod telemetry;

pub use crate::core::{
    AcceptRefused, BATCH_MAX, CONNECTION_SLACK, ConnectionId, CoreStats,
    DEVICE_IN_FLIGHT_PER_THREAD_MAX, DRAIN_TIMEOUT_DEFAULT, Dataplane, DataplaneSetup,
    DeviceCommand, DeviceOpId, DeviceOpKind, GENERATION_MASK, HOUSEKEEPING_INTERVAL, KvMessage,
    KvNext, KvRequestRef, KvSetup, Limits, MIGRATED_TOKEN, MigratedRead, MigrationMessage,
    MoveCause, MovedConnection, NOTICES_PENDING_MAX, Op, PskError, PskKeys, RECV_BUFFERS_SPARE_MAX,
    REQUEST_STATE_COUNT, RequestState, SEND_SEGMENTS_MAX, SetupError, TelemetryWindow, TenantStats,
    TlsCurrent, TlsKeys, TlsSetup, exchange_queue_capacity, policy_for,
};
pub use crate::memory::LentRun;
