//! The request slots of a dataplane: what each request is doing ([`Work`]) and where it is in
//! its life ([`RequestState`], changed only through [`Dataplane::transition`], which asserts
//! the move and counts it).
//!
//! Lifecycle: `Free → (NeedBuffer →) [Receiving →] [Overlapping →] [Blocked →] Queued →
//! Submitted → Completed ⇄ Sending → Free`. `NeedBuffer` waits for a buffer run; `Receiving`
//! takes a WRITE payload straight into its run; `Overlapping` waits at the write gate for an
//! overlapping read-modify-write (`crate::gate`); `Forwarded` is a key-value request whose
//! table step runs on the table's thread; `Blocked` waits for room in a full tenant
//! queue; a request with several device steps goes `Submitted → Queued` between them, a large
//! WRITE `Submitted → Receiving` for its next part's payload, and a large READ `Sending →
//! Queued` once a part is sent; `Orphaned` is a request whose device operation outlived its
//! deadline: its error answer went out in another slot, and it is freed when the device
//! finally returns its buffer. Immediate answers go straight to `Completed`. A request of a
//! closing connection is freed as soon as no operation uses it.

use reflex_qos::Nanos;

use super::composite::Placed;
use super::{Dataplane, LOANS_RETURNED_TOGETHER_MAX};
use crate::buffers::PageRun;
use crate::buffers::RUN_SIZE_MAX;
use crate::frontend::IoKind;
use crate::frontend::{
    Action, IoRequest, RESPONSE_HEADER_SIZE_MAX, RESPONSE_TRAILER_SIZE_MAX, Tag,
};
use crate::gate::Hold;
use crate::steps::{IoStep, Layout, Operation};

/// "No request" in the intrusive lists (send queues).
pub(super) const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RequestState {
    Free = 0,
    NeedBuffer = 1,
    Receiving = 2,
    Queued = 3,
    Submitted = 4,
    Completed = 5,
    Sending = 6,
    /// Waiting for room in its tenant's queue of the QoS scheduler.
    Blocked = 7,
    /// Answered already (timed out on the device); waits for the device to give its buffer
    /// back.
    Orphaned = 8,
    /// Waiting at the write gate for an earlier write over the same sectors.
    Overlapping = 9,
    /// A key-value request whose table step runs on the thread that owns the table
    /// (`core/kv_owner.rs`): that thread uses its run until it answers.
    Forwarded = 10,
}

pub const REQUEST_STATE_COUNT: usize = 11;

/// Every state, in discriminant order (for the transition table).
const STATES: [RequestState; REQUEST_STATE_COUNT] = [
    RequestState::Free,
    RequestState::NeedBuffer,
    RequestState::Receiving,
    RequestState::Queued,
    RequestState::Submitted,
    RequestState::Completed,
    RequestState::Sending,
    RequestState::Blocked,
    RequestState::Orphaned,
    RequestState::Overlapping,
    RequestState::Forwarded,
];

const _: () = {
    let mut index = 0;
    while index < REQUEST_STATE_COUNT {
        assert!(STATES[index] as usize == index);
        index += 1;
    }
};

/// `LEGAL[from] & (1 << to)`: the moves [`RequestState::legal`] allows, as one bit test on
/// the hot path.
const LEGAL: [u16; REQUEST_STATE_COUNT] = {
    let mut table = [0u16; REQUEST_STATE_COUNT];
    let mut from = 0;
    while from < REQUEST_STATE_COUNT {
        let mut to = 0;
        while to < REQUEST_STATE_COUNT {
            if STATES[from].legal(STATES[to]) {
                table[from] |= 1 << to;
            }
            to += 1;
        }
        from += 1;
    }
    table
};

impl RequestState {
    /// Whether a request may move from `self` to `to` (a table lookup of [`Self::legal`]).
    pub(super) fn can_become(self, to: RequestState) -> bool {
        LEGAL[self as usize] & (1 << to as usize) != 0
    }

    /// Legal moves; freeing early is legal only when no operation uses the request.
    pub(super) const fn legal(self, to: RequestState) -> bool {
        use RequestState::*;
        matches!(
            (self, to),
            (
                Free,
                NeedBuffer | Receiving | Overlapping | Queued | Blocked | Completed | Forwarded
            ) | (
                NeedBuffer,
                Receiving | Overlapping | Queued | Blocked | Completed | Forwarded | Free
            ) | (
                Receiving,
                Overlapping | Queued | Blocked | Completed | Forwarded | Free
            ) | (Overlapping, Queued | Blocked | Completed | Free)
                | (Forwarded, Queued | Blocked | Completed | Orphaned | Free)
                | (Blocked, Queued | Completed | Free)
                | (Queued, Submitted | Completed | Free)
                | (
                    Submitted,
                    Completed | Queued | Blocked | Receiving | Orphaned | Forwarded | Free
                )
                | (Orphaned, Free)
                | (Completed, Sending | Free)
                | (Sending, Completed | Queued | Blocked | Free)
        )
    }
}

/// What a request does, with exactly the data that work needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Work {
    /// A free slot.
    Idle,
    /// Decoded, not started: waits for what it needs (a request slot had room, a buffer run
    /// may not).
    Start(Action),
    /// Device I/O at `step`; `run` holds READ or WRITE data (one part of it, for a large
    /// request), the zero-fill source, or an edge sector.
    Io {
        io: IoRequest,
        run: Option<PageRun>,
        step: IoStep,
        /// WRITE payload bytes of the part being received, in the run so far.
        received_bytes: u32,
    },
    /// A part of a large READ, not its last, being sent: the encoded header (if any) in
    /// [`Request::header`], then `body_bytes` of `run` from `body_start`. Once it is out the
    /// request reads part `part + 1`. `exclusive`: nothing else may be sent on the connection
    /// until the READ's last part (its simple reply's data must not be interrupted).
    Part {
        io: IoRequest,
        run: PageRun,
        part: u32,
        body_start: u32,
        body_bytes: u32,
        exclusive: bool,
    },
    /// The answer: the encoded header in [`Request::header`], then `body_bytes` of `run` from
    /// `body_start` (READ data, a HELLO or control body, handshake output, a block status).
    /// A run with no body bytes is only waiting to be freed.
    Response {
        run: Option<PageRun>,
        body_start: u32,
        body_bytes: u32,
    },
}

impl Work {
    /// The buffer run the request owns, if any.
    pub(super) fn run(&self) -> Option<PageRun> {
        match *self {
            Work::Io { run, .. } | Work::Response { run, .. } => run,
            Work::Part { run, .. } => Some(run),
            Work::Idle | Work::Start(_) => None,
        }
    }

    /// The body sent after the header: its run, first byte and length.
    pub(super) fn body(&self) -> Option<(PageRun, u32, u32)> {
        match *self {
            Work::Response {
                run: Some(run),
                body_start,
                body_bytes,
            }
            | Work::Part {
                run,
                body_start,
                body_bytes,
                ..
            } if body_bytes > 0 => Some((run, body_start, body_bytes)),
            _ => None,
        }
    }
}

/// A request's place at its namespace's write gate (`crate::gate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GatePlace {
    /// Not a write, or not yet at the gate, or done with it.
    Outside,
    /// Waiting; `None`: the gate's table was full, ask again from scratch.
    Waiting(Option<Hold>),
    /// Allowed to write until it releases.
    Holding(Hold),
}

pub(super) struct Request {
    pub(super) state: RequestState,
    pub(super) generation: u32,
    pub(super) connection_index: u32,
    pub(super) tag: Tag,
    pub(super) work: Work,
    /// How an I/O request lies on its device's sectors (set when it starts; the hot path
    /// reads it several times per step).
    pub(super) layout: Layout,
    /// The device operation of the current step (set with the step).
    pub(super) operation: Operation,
    pub(super) gate: GatePlace,
    pub(super) header: [u8; RESPONSE_HEADER_SIZE_MAX],
    pub(super) header_len: u8,
    /// Bytes sent after the body (NVMe/TCP: a read's data digest and response capsule).
    pub(super) trailer: [u8; RESPONSE_TRAILER_SIZE_MAX],
    pub(super) trailer_len: u8,
    /// Next request in the connection's send queue.
    pub(super) next: u32,
    /// When the request arrived (its first byte was parsed), when its current step entered a
    /// scheduler, and when that step went to the device.
    pub(super) arrived_at: Nanos,
    /// A READ whose answer is measured once it has been sent: its namespace and whether its
    /// tenant is latency-critical (`docs/QOS.md`, online self-calibration).
    pub(super) measured_read: Option<(u16, bool)>,
    /// The tenant id (in its namespace) a measured READ is charged to (live figures).
    pub(super) measured_tenant: u32,
    /// Where the device operation in flight went ([`Dataplane::placed`] when it was
    /// submitted: its namespace, for live figures and the completion; its piece and
    /// operation, which the completion and the driver's buffer lookup read again).
    pub(super) submitted: Placed,
    /// A composite namespace's request: what of the current step's device operation earlier
    /// pieces did (bytes; members for a flush), and the member tenant id its current piece
    /// is charged to (`composite`).
    pub(super) piece_done: u32,
    pub(super) piece_tenant: u32,
    /// The tenant whose place at the device the fairness stage counts for this request's
    /// device operation (`None`: it did not come through the stage).
    pub(super) fair_flow: Option<u32>,
    /// The thread serving this request's device operation (inter-core migration, `migration`).
    pub(super) migrated_to: Option<u16>,
    pub(super) queued_at: Nanos,
    pub(super) submitted_at: Nanos,
}

impl Request {
    pub(super) fn empty() -> Request {
        Request {
            state: RequestState::Free,
            generation: 0,
            connection_index: NONE,
            tag: Tag::None,
            work: Work::Idle,
            layout: Layout::new(IoKind::Read, 0, 512, 512, RUN_SIZE_MAX as u32),
            operation: Operation::Flush,
            gate: GatePlace::Outside,
            header: [0; RESPONSE_HEADER_SIZE_MAX],
            header_len: 0,
            trailer: [0; RESPONSE_TRAILER_SIZE_MAX],
            trailer_len: 0,
            next: NONE,
            arrived_at: Nanos::ZERO,
            measured_read: None,
            measured_tenant: 0,
            submitted: Placed {
                namespace_index: 0,
                member: None,
                operation: Operation::Flush,
            },
            piece_done: 0,
            piece_tenant: 0,
            fair_flow: None,
            migrated_to: None,
            queued_at: Nanos::ZERO,
            submitted_at: Nanos::ZERO,
        }
    }

    /// The non-empty slices its response takes in a gathered send: header, body, trailer.
    pub(super) fn response_segments(&self) -> usize {
        usize::from(self.header_len > 0)
            + usize::from(self.work.body().is_some())
            + usize::from(self.trailer_len > 0)
    }

    /// Bytes of the response: header, body and trailer.
    pub(super) fn response_len(&self) -> usize {
        let body_bytes = self.work.body().map_or(0, |(_, _, bytes)| bytes as usize);
        usize::from(self.header_len) + body_bytes + usize::from(self.trailer_len)
    }

    /// The I/O of a request that does device work; panics otherwise (a dataplane bug).
    pub(super) fn io(&self) -> IoRequest {
        match self.work {
            Work::Io { io, .. } | Work::Part { io, .. } => io,
            other => panic!("request without I/O: {other:?}"),
        }
    }
}

/// The generation after `generation` (28 bits, so drivers can pack it with an index).
pub const GENERATION_MASK: u32 = (1 << 28) - 1;

pub(super) fn next_generation(generation: u32) -> u32 {
    generation.wrapping_add(1) & GENERATION_MASK
}

impl Dataplane {
    pub(super) fn transition(&mut self, index: u32, to: RequestState) {
        let request = &mut self.requests[index as usize];
        let from = request.state;
        assert!(
            from.can_become(to),
            "request {index}: illegal {from:?} -> {to:?}"
        );
        request.state = to;
        self.stats.requests_per_state[from as usize] -= 1;
        self.stats.requests_per_state[to as usize] += 1;
        self.stats.transitions += 1;
    }

    /// Takes a free slot for a request of `connection_index`; the caller checked that one is
    /// free and that the connection's window has room.
    pub(super) fn allocate_request(
        &mut self,
        connection_index: u32,
        tag: Tag,
        action: Action,
        now: Nanos,
    ) -> u32 {
        let Some(index) = self.free_requests.pop() else {
            panic!("allocate_request without a free slot (callers check)");
        };
        let request = &mut self.requests[index as usize];
        assert_eq!(request.state, RequestState::Free);
        assert_eq!(request.work, Work::Idle);
        assert_eq!(request.gate, GatePlace::Outside);
        request.connection_index = connection_index;
        request.tag = tag;
        request.work = Work::Start(action);
        request.header_len = 0;
        request.trailer_len = 0;
        request.next = NONE;
        request.arrived_at = now;
        request.measured_read = None;
        let connection = &mut self.connections[connection_index as usize];
        connection.outstanding += 1;
        assert!(connection.outstanding <= self.limits.window);
        index
    }

    /// Gives the device back the loans of the requests freed since the last call: their
    /// lines first, then the returns, so that their cache misses overlap.
    pub(super) fn return_loans(&mut self) {
        for lent in &self.loans_to_return {
            lent.prefetch_return();
        }
        self.loans_to_return.clear();
    }

    /// Frees a request no operation uses: its run goes back to the arena, its window place to
    /// its connection.
    pub(super) fn free_request(&mut self, index: u32) {
        let orphaned = self.requests[index as usize].state == RequestState::Orphaned;
        assert_eq!(
            self.requests[index as usize].migrated_to, None,
            "freeing a request another thread is serving"
        );
        // No operation uses the request any more: whatever it wrote is done.
        self.leave_gate(index);
        self.kv_forget(index);
        self.transition(index, RequestState::Free);
        let request = &mut self.requests[index as usize];
        request.generation = next_generation(request.generation);
        let run = request.work.run();
        request.work = Work::Idle;
        let connection_index = request.connection_index;
        request.connection_index = NONE;
        if let Some(run) = run {
            self.release_run(connection_index, run, orphaned);
        }
        // Its answer is sent (or never will be): the device may have the loan back.
        if let Some(lent) = self.lent[index as usize].take() {
            if self.loans_to_return.len() == LOANS_RETURNED_TOGETHER_MAX {
                self.return_loans();
            }
            self.loans_to_return.push(lent);
        }
        self.free_requests.push(index);
        self.resources_freed = true;
        if orphaned {
            // Its connection gave the window place back when the request was orphaned.
            return;
        }
        let connection = &mut self.connections[connection_index as usize];
        assert!(connection.outstanding > 0);
        connection.outstanding -= 1;
        if connection.stream_owner == index {
            // A large READ's last part went out (or the connection is closing): others may
            // send again.
            connection.stream_owner = NONE;
            if connection.send_head != NONE {
                self.mark_send(connection_index);
            }
        }
        let connection = &self.connections[connection_index as usize];
        if connection.is_open() {
            // The window may have opened, or the connection may now be idle.
            self.mark_parse(connection_index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transition_table_is_the_rule() {
        for from in STATES {
            for to in STATES {
                assert_eq!(from.can_become(to), from.legal(to), "{from:?} -> {to:?}");
            }
        }
        use RequestState::*;
        assert!(Free.can_become(Queued));
        assert!(Queued.can_become(Submitted));
        assert!(Submitted.can_become(Orphaned));
        assert!(!Submitted.can_become(Sending));
        assert!(!Free.can_become(Free));
        assert!(!Free.can_become(Submitted));
        assert!(!Orphaned.can_become(Completed));
    }
}
