//! Requests to composite namespaces (`crate::composite`): each device operation of a step is
//! done as *pieces*, one per member it touches, one after the other. A piece is enqueued in
//! its member's scheduler, charged to the tenant's member tenant there, and submitted to that
//! member's device queue; so QoS, token accounting and device metrics stay per device.
//!
//! Why one piece at a time: a request slot has one device operation in flight, which keeps
//! the request lifecycle, orphaning on timeout and buffer ownership as they are. A request
//! crossing a stripe boundary takes two scheduler turns and two device latencies instead of
//! one (stripes are large next to requests, so few do); different requests run on different
//! members at once.
//!
//! The step's answer is decided once, from the combined result: the first failing piece
//! ends the step with its error (later pieces are not sent), a short piece ends it as a
//! short transfer. Plain namespaces pay one branch (`NamespaceSet::composite`).

use reflex_flash::FlashError;

use super::Dataplane;
use crate::composite::Composite;
use crate::steps::Operation;

/// Where a request's current piece goes: the device of its namespace, or for a composite
/// namespace the member its next piece lands on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placed {
    pub(super) namespace_index: u16,
    /// The member's position, for a composite namespace's request.
    pub(super) member: Option<usize>,
    pub(super) operation: Operation,
}

/// What follows a finished piece.
pub(super) enum Progress {
    /// Another piece of the same step: enqueue it.
    Next,
    /// The step's device work is over, with this combined result.
    Done(Result<u32, FlashError>),
}

impl Dataplane {
    /// The piece of a submitted request's device operation in flight, as
    /// [`Self::begin_device_operation`] placed it (nothing moves a request's step or piece
    /// while its operation is at the device; checked in debug builds).
    pub(super) fn submitted_placed(&self, index: u32) -> Placed {
        let placed = self.requests[index as usize].submitted;
        debug_assert_eq!(placed, self.placed(index));
        placed
    }

    /// The current piece of the request's current step. Inlined: a plain namespace's is
    /// the step's operation, found with one branch.
    #[inline]
    pub(super) fn placed(&self, index: u32) -> Placed {
        let namespace_index = self.requests[index as usize].io().namespace_index;
        let operation = self.operation(index);
        match self.namespaces.composite(namespace_index) {
            None => Placed {
                namespace_index,
                member: None,
                operation,
            },
            Some(composite) => self.composite_piece(index, composite, operation),
        }
    }

    /// [`Self::placed`] for a composite namespace: the member the next piece lands on.
    #[inline(never)]
    fn composite_piece(&self, index: u32, composite: &Composite, operation: Operation) -> Placed {
        let done = self.requests[index as usize].piece_done;
        let (piece, operation) = match operation {
            Operation::Flush => {
                let member = (done as usize).min(composite.members().len() - 1);
                let namespace_index = composite.members()[member].namespace_index;
                return Placed {
                    namespace_index,
                    member: Some(member),
                    operation,
                };
            }
            Operation::Read {
                offset_bytes,
                length_bytes,
                buffer_start,
            } => {
                let piece = composite.piece(offset_bytes + u64::from(done), length_bytes - done);
                let operation = Operation::Read {
                    offset_bytes: piece.device_offset_bytes,
                    length_bytes: piece.length_bytes,
                    buffer_start: buffer_start + done,
                };
                (piece, operation)
            }
            Operation::Write {
                offset_bytes,
                length_bytes,
                buffer_start,
                fua,
            } => {
                let piece = composite.piece(offset_bytes + u64::from(done), length_bytes - done);
                let operation = Operation::Write {
                    offset_bytes: piece.device_offset_bytes,
                    length_bytes: piece.length_bytes,
                    buffer_start: buffer_start + done,
                    fua,
                };
                (piece, operation)
            }
            Operation::Discard {
                offset_bytes,
                length_bytes,
            } => {
                let piece = composite.piece(offset_bytes + u64::from(done), length_bytes - done);
                let operation = Operation::Discard {
                    offset_bytes: piece.device_offset_bytes,
                    length_bytes: piece.length_bytes,
                };
                (piece, operation)
            }
        };
        Placed {
            namespace_index: piece.namespace_index,
            member: Some(piece.member),
            operation,
        }
    }

    /// A piece finished with `result`: whether another piece of the step follows, or the
    /// step's combined result. A plain namespace's operation is its step's only piece.
    pub(super) fn piece_finished(
        &mut self,
        index: u32,
        placed: Placed,
        result: Result<u32, FlashError>,
    ) -> Progress {
        if placed.member.is_none() {
            return Progress::Done(result);
        }
        let request = &self.requests[index as usize];
        let done = request.piece_done;
        let Ok(bytes) = result else {
            // The first error wins: the rest of the step is not sent.
            return Progress::Done(result);
        };
        let members = self
            .namespaces
            .composite(request.io().namespace_index)
            .map_or(0, |composite| composite.members().len() as u32);
        let (advanced, total, combined) = match (request.operation, placed.operation) {
            (Operation::Flush, _) => (done + 1, members, Ok(bytes)),
            // A discard may report no bytes: the piece is done when it succeeds.
            (
                Operation::Discard { length_bytes, .. },
                Operation::Discard {
                    length_bytes: piece_bytes,
                    ..
                },
            ) => (done + piece_bytes, length_bytes, Ok(bytes)),
            (
                Operation::Read { length_bytes, .. } | Operation::Write { length_bytes, .. },
                Operation::Read {
                    length_bytes: piece_bytes,
                    ..
                }
                | Operation::Write {
                    length_bytes: piece_bytes,
                    ..
                },
            ) => {
                if bytes != piece_bytes || piece_bytes == 0 {
                    // A short piece: the step reports what was transferred in all.
                    return Progress::Done(Ok(done + bytes));
                }
                (done + bytes, length_bytes, Ok(done + bytes))
            }
            (step, piece) => panic!("piece {piece:?} of a step {step:?}"),
        };
        if advanced < total {
            self.requests[index as usize].piece_done = advanced;
            return Progress::Next;
        }
        Progress::Done(combined)
    }

    /// The tenant id a composite namespace's tenant has on the member at `member`
    /// (`None`: this thread has not learnt it, or the tenant is gone).
    pub(super) fn member_tenant(&self, handle: u64, member: usize) -> Option<u32> {
        self.member_tenants
            .get(&handle)
            .and_then(|ids| ids.get(member))
            .copied()
    }

    /// Learns a composite namespace's tenant's member tenants (the first time a connection
    /// of this thread charges it; off the I/O path) and accounts for them per member.
    pub(super) fn learn_member_tenants(
        &mut self,
        namespace_index: u16,
        handle: u64,
        now: reflex_qos::Nanos,
    ) {
        let Some(composite) = self.namespaces.composite(namespace_index) else {
            return;
        };
        let member_indices: Vec<u16> = composite
            .members()
            .iter()
            .map(|member| member.namespace_index)
            .collect();
        let members = self.control.member_tenants(handle);
        if members.len() != member_indices.len() {
            return; // Gone meanwhile: its requests are refused as the tenant's are.
        }
        for (&member_index, &tenant) in member_indices.iter().zip(&members) {
            self.ensure_account(member_index, tenant, now);
        }
        self.member_tenants
            .insert(handle, members.iter().map(|tenant| tenant.id).collect());
    }
}
