//! What the dataplane asks its driver to do ([`Op`]) and the names the driver uses to report
//! back ([`ConnectionId`], [`DeviceOpId`]).
//!
//! Why typed operations: the driver (io_uring in reflexd, epoll where io_uring is missing, a
//! virtual network in the simulator) only moves bytes. It never decides what to read, what to
//! send or what to submit to a device; it asks the dataplane for the memory an operation uses
//! ([`super::Dataplane::receive_space`], [`super::Dataplane::send_segments`],
//! [`super::Dataplane::device_op`]) and reports each result with one `handle_*` call.

/// A connection slot and its generation: a report for a slot that was closed and reused since
/// the operation was issued carries the old generation and is caught by an assertion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionId {
    pub index: u32,
    pub generation: u32,
}

/// A device operation: a request's current step, or the flush of a namespace at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceOpId {
    Request {
        index: u32,
        generation: u32,
    },
    ShutdownFlush {
        namespace_index: u16,
    },
    /// A read another thread migrated here (`Dataplane::migrated_read` names its home and
    /// buffer): a slot of this thread's table of migrated reads.
    Migrated {
        slot: u32,
        generation: u32,
    },
}

/// One operation for the driver, in the order the dataplane wants them issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Accept one connection on listener `listener` (at most one in flight per listener);
    /// report it with [`super::Dataplane::handle_accept`].
    Accept { listener: u32 },
    /// Stop listening: cancel the accept in flight, if any, and close the socket once it
    /// has come back (still reported through `handle_accept`).
    CloseListener { listener: u32 },
    /// Receive into [`super::Dataplane::receive_space`]; report with
    /// [`super::Dataplane::handle_recv`].
    Recv { connection: ConnectionId },
    /// Send [`super::Dataplane::send_segments`] (one gathered send); report with
    /// [`super::Dataplane::handle_sent`].
    Send { connection: ConnectionId },
    /// Wait until the connection has bytes to read (an idle connection parked without a
    /// receive buffer); report with [`super::Dataplane::handle_readable`].
    WaitReadable { connection: ConnectionId },
    /// Cancel the connection's receive in flight; it still completes (with an error or
    /// data) through `handle_recv`.
    CancelRecv { connection: ConnectionId },
    /// Cancel the connection's readiness wait; it still completes through
    /// `handle_readable`.
    CancelWait { connection: ConnectionId },
    /// Cancel the connection's send in flight; it still completes through `handle_sent`.
    CancelSend { connection: ConnectionId },
    /// Nothing uses the connection any more: close its socket. Its slot is reused only after
    /// this operation was taken from [`super::Dataplane::poll_op`], so a driver that keeps one
    /// socket per slot closes the old socket before a new connection gets the slot.
    Close { connection: ConnectionId },
    /// Thread scaling: the connection moves to thread `to`. Take its state with
    /// [`super::Dataplane::take_moved`] and send it with the socket (not closed) to that
    /// thread's driver, which passes it to [`super::Dataplane::adopt`]. Nothing of it is in
    /// flight; its slot is reused after this operation, as after a `Close`.
    Handoff { connection: ConnectionId, to: u16 },
    /// A device operation; its memory through [`super::Dataplane::device_op`], its result
    /// through [`super::Dataplane::handle_device`].
    Device(DeviceCommand),
    /// A namespace slot was added: open this thread's queue of its device
    /// ([`super::Dataplane::namespaces`]) before the slot's first [`Op::Device`].
    OpenDevice { namespace_index: u16 },
    /// A namespace slot is being removed and nothing of this thread uses it any more: drop
    /// this thread's queue of its device (no operation of it is in flight).
    CloseDevice { namespace_index: u16 },
    /// Read the connection's smoothed network round-trip time now and report it with
    /// [`super::Dataplane::handle_rtt`] (latency-critical traffic's network share, for
    /// self-calibration).
    SampleRtt { connection: ConnectionId },
}

/// A device operation on a namespace's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCommand {
    pub id: DeviceOpId,
    pub namespace_index: u16,
    /// The device submission queue (priority class) for devices that arbitrate.
    pub queue: u16,
    pub kind: DeviceOpKind,
}

impl DeviceCommand {
    /// Where a READ that may be answered with a loan of device memory reads (offset, length):
    /// `Some` only for this thread's own request (a read migrated here lands in its home's
    /// run) whose command allows it.
    pub fn lendable_read(&self) -> Option<(u64, u32)> {
        match (self.id, self.kind) {
            (
                DeviceOpId::Request { .. },
                DeviceOpKind::Read {
                    offset_bytes,
                    length_bytes,
                    lend: true,
                },
            ) => Some((offset_bytes, length_bytes)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOpKind {
    Read {
        offset_bytes: u64,
        length_bytes: u32,
        /// The data may be lent instead of read into the request's run (a whole READ answered
        /// from one device read, its data sent as it is): a driver whose device lends
        /// ([`reflex_flash::DeviceQueue::lend`]) hands the loan to
        /// [`crate::Dataplane::handle_device_lent`] instead of submitting the read.
        lend: bool,
    },
    Write {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset_bytes: u64,
        length_bytes: u32,
    },
}

/// Why a connection the driver accepted was not taken (the driver closes the socket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AcceptRefused {
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the connection table is full")]
    TableFull,
    #[error("the listener's share of the connection table is full")]
    ListenerFull,
    #[error("too many connections from this address")]
    SourceFull,
    /// The listener's allow-list does not name the peer's address (or the driver does not
    /// know the address).
    #[error("the peer's address is not on the listener's allow-list")]
    NotAllowed,
}

impl AcceptRefused {
    pub const ALL: [AcceptRefused; 5] = [
        AcceptRefused::ShuttingDown,
        AcceptRefused::TableFull,
        AcceptRefused::ListenerFull,
        AcceptRefused::SourceFull,
        AcceptRefused::NotAllowed,
    ];
    pub const COUNT: usize = AcceptRefused::ALL.len();

    pub fn index(self) -> usize {
        self as usize
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            AcceptRefused::ShuttingDown => "shutting_down",
            AcceptRefused::TableFull => "table_full",
            AcceptRefused::ListenerFull => "listener_full",
            AcceptRefused::SourceFull => "source_full",
            AcceptRefused::NotAllowed => "not_allowed",
        }
    }
}
