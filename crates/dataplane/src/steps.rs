//! How one validated request becomes a sequence of device operations, and what its answer is.
//!
//! Why: most requests are one device operation, but NBD asks for several kinds that are not.
//!
//! - **Large requests.** A buffer run holds at most [`crate::buffers::RUN_SIZE_MAX`] (1 MiB),
//!   but an NBD client that did not negotiate block sizes may READ or WRITE 32 MiB. Such a
//!   request is cut into *parts* of at most one run ([`Layout::part`]), done one after the
//!   other in the same run: a READ reads part *k*, sends it, then reads part *k + 1*; a WRITE
//!   receives part *k*'s payload into the run, writes it, then receives the next. One run per
//!   request at a time keeps memory bounded whatever the request's length.
//! - **Unaligned requests.** Devices take whole sectors (512 bytes); NBD clients that did not
//!   agree to a minimum block size may address single bytes. A READ reads the enclosing
//!   sectors and sends only the bytes asked for. A WRITE that starts or ends inside a sector
//!   reads that *edge* sector into the run's scratch page first ([`IoStep::EdgeRead`]) and
//!   copies around its payload the bytes it does not own ([`Layout::edge`]), then writes whole
//!   sectors: read-modify-write. A `WRITE_ZEROES` with unaligned edges zeroes them the same
//!   way (read the edge sector, zero the request's bytes, write it back) and handles its
//!   aligned middle as usual; an unaligned `TRIM` discards only its aligned middle (a trim is
//!   a hint, so the edges are left alone).
//! - **`WRITE_ZEROES`** is a discard, or zeroes written from a zeroed buffer run, possibly in
//!   several chunks (its length is not bounded by the maximum payload), and it falls back to
//!   writing when the device turns out not to discard. With `FAST_ZERO` it must never fall
//!   back to writing: it fails at once with `ENOTSUP` instead.
//! - **`TRIM`** is only a hint, so a device without discard makes it succeed, not fail. FUA on
//!   `TRIM` or `WRITE_ZEROES` means a device flush after the operation.
//!
//! These decisions are plain functions of the request's [`Layout`], the step that just
//! finished and its result, so they are tested here without a ring; the dataplane only
//! submits the step they name (every step passes through the scheduler like any request),
//! moves the payload, merges edges and sends parts. Concurrent read-modify-writes touching
//! the same sector are ordered by [`crate::gate`].
//!
//! Invariants: a request is in exactly one step at a time; parts are done in order and never
//! overlap; `ZeroFill` progress only grows and never passes the aligned middle; an answer is
//! produced exactly once, by [`first_step`] or [`after_step`].

use reflex_flash::FlashError;
use reflex_proto::nbd::Errno;

use crate::frontend::{Answer, IoKind};

/// Bytes of the scratch page at the end of a read-modify-write WRITE's run, where an edge
/// sector is read before its bytes are merged around the payload.
pub const SCRATCH_BYTES: u32 = 4096;

/// An unaligned end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    /// The sector holding the request's first byte (when that byte is not sector-aligned;
    /// also the tail when the request starts and ends in the same sector).
    Head,
    /// The sector holding the request's last byte (when its end is not sector-aligned and
    /// that sector is not the head's).
    Tail,
}

/// The device operation a request is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoStep {
    /// FLUSH; or the discard of a TRIM's or WRITE_ZEROES' aligned middle.
    Primary,
    /// READ: read part `part` into the run. WRITE: write part `part` from the run (its
    /// payload received and its edges merged).
    Transfer { part: u32 },
    /// Read an edge sector: into the scratch page (WRITE), or the run (WRITE_ZEROES).
    EdgeRead { edge: Edge },
    /// WRITE_ZEROES: write the edge sector back with the request's bytes zeroed.
    EdgeWrite { edge: Edge },
    /// Writing zeroes over the aligned middle from the request's zeroed run; `written_bytes`
    /// done so far.
    ZeroFill { written_bytes: u32 },
    /// A device flush making an earlier step durable (FUA on a discard or zero fill).
    FlushAfter,
}

/// How a request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Submit this step.
    Submit(IoStep),
    /// WRITE: receive the payload of part 0 into the run, then submit this step.
    Receive(IoStep),
    /// Nothing to do on the device: answer at once.
    Answer(Answer),
}

/// What follows a finished step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Continue(IoStep),
    /// WRITE: receive the payload of the next part, then submit this step.
    Receive(IoStep),
    /// READ: send part `part` (not the last one), then read the next.
    Send {
        part: u32,
    },
    Done(Answer),
}

/// One part of a READ or WRITE: a run's worth of sectors, and where the request's own bytes
/// lie in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// The sectors the device transfers.
    pub device_offset_bytes: u64,
    pub device_bytes: u32,
    /// Where the request's bytes lie in the run, and where they lie in the export.
    pub data_start: u32,
    pub data_bytes: u32,
    pub data_offset_bytes: u64,
}

/// An edge sector: where it is, and which of its bytes the request covers (`owned_start ..
/// owned_end`); the others keep their old contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EdgeSector {
    pub sector_offset_bytes: u64,
    pub owned_start: u32,
    pub owned_end: u32,
}

/// Where a request lies on a device of `sector_bytes` sectors, and how it is cut into parts
/// of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    offset_bytes: u64,
    length_bytes: u32,
    sector_bytes: u32,
    /// Device bytes per part: the run, less the scratch page for a read-modify-write.
    part_bytes: u32,
    /// Derived once (the hot path asks for them several times per step): the enclosing
    /// sectors and the number of parts.
    aligned_start: u64,
    aligned_end: u64,
    part_count: u32,
}

impl Layout {
    /// The layout of a `kind` request of `length_bytes` (non-zero) at `offset_bytes`, on
    /// sectors of `sector_bytes` (a power of two ≤ [`SCRATCH_BYTES`]) with runs of at most
    /// `run_bytes_max` (a multiple of [`SCRATCH_BYTES`], at least two of them).
    pub fn new(
        kind: IoKind,
        offset_bytes: u64,
        length_bytes: u32,
        sector_bytes: u32,
        run_bytes_max: u32,
    ) -> Layout {
        assert!(sector_bytes.is_power_of_two() && sector_bytes <= SCRATCH_BYTES);
        assert!(run_bytes_max.is_multiple_of(SCRATCH_BYTES) && run_bytes_max >= 2 * SCRATCH_BYTES);
        let mask = u64::from(sector_bytes) - 1;
        let end_bytes = offset_bytes + u64::from(length_bytes);
        let mut layout = Layout {
            offset_bytes,
            length_bytes,
            sector_bytes,
            part_bytes: run_bytes_max,
            aligned_start: offset_bytes & !mask,
            aligned_end: (end_bytes + mask) & !mask,
            part_count: 0,
        };
        if matches!(kind, IoKind::Write { .. }) && layout.has_edges() {
            layout.part_bytes = run_bytes_max - SCRATCH_BYTES;
        }
        let span = layout.aligned_end - layout.aligned_start;
        layout.part_count = if span <= u64::from(layout.part_bytes) {
            1
        } else {
            span.div_ceil(u64::from(layout.part_bytes)) as u32
        };
        layout
    }

    fn end_bytes(&self) -> u64 {
        self.offset_bytes + u64::from(self.length_bytes)
    }

    fn mask(&self) -> u64 {
        u64::from(self.sector_bytes) - 1
    }

    /// The first byte of the sector holding the request's first byte.
    pub fn aligned_start(&self) -> u64 {
        self.aligned_start
    }

    /// The end of the sector holding the request's last byte.
    pub fn aligned_end(&self) -> u64 {
        self.aligned_end
    }

    /// The sectors the request covers whole (where TRIM and WRITE_ZEROES act as usual):
    /// `[inner_start, inner_start + inner_bytes)`, possibly empty.
    pub fn inner_start(&self) -> u64 {
        (self.offset_bytes + self.mask()) & !self.mask()
    }

    pub fn inner_bytes(&self) -> u32 {
        let inner_end = self.end_bytes() & !self.mask();
        inner_end.saturating_sub(self.inner_start()) as u32
    }

    /// The edge sectors a request has: the head when its start is unaligned, the tail when
    /// its end is unaligned and lies in another sector than an unaligned start.
    pub fn has_edge(&self, edge: Edge) -> bool {
        let start_unaligned = self.offset_bytes & self.mask() != 0;
        let end_unaligned = self.end_bytes() & self.mask() != 0;
        match edge {
            Edge::Head => start_unaligned,
            Edge::Tail => {
                end_unaligned
                    && !(start_unaligned
                        && self.aligned_end() - self.aligned_start()
                            == u64::from(self.sector_bytes))
            }
        }
    }

    pub fn has_edges(&self) -> bool {
        self.has_edge(Edge::Head) || self.has_edge(Edge::Tail)
    }

    /// An edge sector of the request (which must have it).
    pub fn edge(&self, edge: Edge) -> EdgeSector {
        assert!(self.has_edge(edge), "{edge:?} edge of an aligned request");
        let sector = u64::from(self.sector_bytes);
        let sector_offset_bytes = match edge {
            Edge::Head => self.aligned_start(),
            Edge::Tail => self.aligned_end() - sector,
        };
        let owned = |at: u64| {
            (at.clamp(sector_offset_bytes, sector_offset_bytes + sector) - sector_offset_bytes)
                as u32
        };
        EdgeSector {
            sector_offset_bytes,
            owned_start: owned(self.offset_bytes),
            owned_end: owned(self.end_bytes()),
        }
    }

    /// Parts of a READ or WRITE.
    pub fn part_count(&self) -> u32 {
        self.part_count
    }

    pub fn part(&self, index: u32) -> Part {
        assert!(
            index < self.part_count,
            "part {index} of {}",
            self.part_count
        );
        if self.part_count == 1 {
            // The common case: one part covering the enclosing sectors.
            return Part {
                device_offset_bytes: self.aligned_start,
                device_bytes: (self.aligned_end - self.aligned_start) as u32,
                data_start: (self.offset_bytes - self.aligned_start) as u32,
                data_bytes: self.length_bytes,
                data_offset_bytes: self.offset_bytes,
            };
        }
        let start = self.aligned_start + u64::from(index) * u64::from(self.part_bytes);
        let device_end = (start + u64::from(self.part_bytes)).min(self.aligned_end);
        let data_from = self.offset_bytes.max(start);
        let data_to = self.end_bytes().min(device_end);
        assert!(data_from < data_to, "a part without data");
        Part {
            device_offset_bytes: start,
            device_bytes: (device_end - start) as u32,
            data_start: (data_from - start) as u32,
            data_bytes: (data_to - data_from) as u32,
            data_offset_bytes: data_from,
        }
    }

    /// The part an edge sector lies in.
    pub fn edge_part(&self, edge: Edge) -> u32 {
        match edge {
            Edge::Head => 0,
            Edge::Tail => self.part_count() - 1,
        }
    }

    /// Where the scratch page of a read-modify-write WRITE lies in its run.
    pub fn scratch_start(&self) -> u32 {
        let span = (self.aligned_end() - self.aligned_start()).min(u64::from(self.part_bytes));
        (span as u32).next_multiple_of(SCRATCH_BYTES)
    }

    /// Bytes of buffer run the request needs: a part for READ; a part and the scratch page
    /// for WRITE (when it has edges); for WRITE_ZEROES the zero source (at most
    /// `run_bytes_max`, written repeatedly) or at least an edge sector; none otherwise.
    pub fn run_bytes(&self, kind: IoKind) -> usize {
        let span = (self.aligned_end() - self.aligned_start()).min(u64::from(self.part_bytes));
        match kind {
            IoKind::Read => span as usize,
            IoKind::Write { .. } if self.has_edges() => {
                (self.scratch_start() + SCRATCH_BYTES) as usize
            }
            IoKind::Write { .. } => span as usize,
            IoKind::WriteZeroes { .. } => {
                let middle = self.inner_bytes().min(self.part_bytes);
                let edges = if self.has_edges() {
                    self.sector_bytes
                } else {
                    0
                };
                middle.max(edges) as usize
            }
            IoKind::Flush | IoKind::Trim { .. } | IoKind::BlockStatus { .. } => 0,
            IoKind::Kv { .. } => panic!("KV requests size their runs in core/kv.rs"),
        }
    }

    /// The step that follows receiving part `part`'s payload.
    fn after_payload(&self, part: u32) -> IoStep {
        if part == self.edge_part(Edge::Head) && self.has_edge(Edge::Head) {
            IoStep::EdgeRead { edge: Edge::Head }
        } else if part == self.edge_part(Edge::Tail) && self.has_edge(Edge::Tail) {
            IoStep::EdgeRead { edge: Edge::Tail }
        } else {
            IoStep::Transfer { part }
        }
    }

    /// The part a WRITE receives the payload for while it is at `step` (the step that
    /// follows the payload).
    pub fn receiving_part(&self, step: IoStep) -> u32 {
        match step {
            IoStep::Transfer { part } => part,
            IoStep::EdgeRead { edge } => self.edge_part(edge),
            other => panic!("no payload before {other:?}"),
        }
    }
}

/// The step after an aligned middle (TRIM, WRITE_ZEROES): a flush for FUA, or the answer.
fn finished(kind: IoKind) -> Next {
    let fua = match kind {
        IoKind::Trim { fua, .. } | IoKind::WriteZeroes { fua, .. } => fua,
        _ => false,
    };
    if fua {
        Next::Continue(IoStep::FlushAfter)
    } else {
        Next::Done(Answer::Ok)
    }
}

/// WRITE_ZEROES after its edges: its aligned middle (a discard, or zeroes written), or the end.
fn zero_middle(kind: IoKind, layout: &Layout, discards: bool) -> Next {
    let IoKind::WriteZeroes { no_hole, .. } = kind else {
        panic!("zeroing the middle of {kind:?}");
    };
    if layout.inner_bytes() == 0 {
        finished(kind)
    } else if no_hole || !discards {
        Next::Continue(IoStep::ZeroFill { written_bytes: 0 })
    } else {
        Next::Continue(IoStep::Primary)
    }
}

/// The first step. `discards`: whether the device is believed to discard (it said so, and has
/// not refused a discard since).
pub fn first_step(kind: IoKind, layout: &Layout, discards: bool) -> Start {
    match kind {
        IoKind::Read => Start::Submit(IoStep::Transfer { part: 0 }),
        IoKind::Write { .. } => Start::Receive(layout.after_payload(0)),
        IoKind::Flush => Start::Submit(IoStep::Primary),
        // A hint: nothing to discard (only partial sectors), or a device that cannot.
        IoKind::Trim { hint: true, .. } if layout.inner_bytes() == 0 || !discards => {
            Start::Answer(Answer::Ok)
        }
        IoKind::Trim { .. } => Start::Submit(IoStep::Primary),
        IoKind::WriteZeroes {
            no_hole,
            fast: true,
            ..
        } if no_hole || !discards || layout.has_edges() => {
            // Zeroing would need writes: a fast zero fails at once, changing nothing.
            Start::Answer(Answer::Nbd(Errno::NotSup))
        }
        IoKind::BlockStatus { .. } => panic!("block status is answered without device steps"),
        IoKind::Kv { .. } => panic!("KV requests take their steps from the table (core/kv.rs)"),
        IoKind::WriteZeroes { .. } => {
            for edge in [Edge::Head, Edge::Tail] {
                if layout.has_edge(edge) {
                    return Start::Submit(IoStep::EdgeRead { edge });
                }
            }
            match zero_middle(kind, layout, discards) {
                Next::Continue(step) => Start::Submit(step),
                other => panic!("an aligned WRITE_ZEROES without a middle: {other:?}"),
            }
        }
    }
}

/// Bytes the next zero-fill write covers.
pub fn zero_chunk_bytes(length_bytes: u32, written_bytes: u32, run_bytes: usize) -> u32 {
    assert!(written_bytes < length_bytes, "zero fill past its end");
    assert!(run_bytes > 0);
    let remaining = length_bytes - written_bytes;
    remaining.min(u32::try_from(run_bytes).unwrap_or(u32::MAX))
}

/// What follows `step` of a request of `kind` laid out as `layout` (its zero run holds
/// `run_bytes`), given the device's `result`. `discards` as for [`first_step`].
pub fn after_step(
    kind: IoKind,
    layout: &Layout,
    step: IoStep,
    run_bytes: usize,
    discards: bool,
    result: &Result<u32, FlashError>,
) -> Next {
    let short = Next::Done(Answer::DeviceError { errno: libc::EIO });
    let bytes = match (step, result) {
        (IoStep::Primary, Err(FlashError::Unsupported)) => {
            return match kind {
                // A discard is a hint: nothing changed, nothing to make durable.
                IoKind::Trim { hint: true, .. } => Next::Done(Answer::Ok),
                // A fast zero never falls back to writing.
                IoKind::WriteZeroes { fast: true, .. } => Next::Done(Answer::Nbd(Errno::NotSup)),
                IoKind::WriteZeroes { .. } => Next::Continue(IoStep::ZeroFill { written_bytes: 0 }),
                _ => Next::Done(Answer::Unsupported),
            };
        }
        (_, Err(error)) => return Next::Done(Answer::from_device(error)),
        (_, Ok(bytes)) => *bytes,
    };
    let sector_bytes = layout.sector_bytes;
    match step {
        IoStep::Transfer { part } => {
            // A short transfer: never send (or acknowledge) the unfilled part.
            if bytes != layout.part(part).device_bytes {
                return short;
            }
            let more = part + 1 < layout.part_count();
            match kind {
                IoKind::Read if more => Next::Send { part },
                IoKind::Write { .. } if more => Next::Receive(layout.after_payload(part + 1)),
                IoKind::Read | IoKind::Write { .. } => Next::Done(Answer::Ok),
                other => panic!("a transfer step for {other:?}"),
            }
        }
        IoStep::EdgeRead { edge } => {
            if bytes != sector_bytes {
                return short;
            }
            match (kind, edge) {
                (IoKind::Write { .. }, Edge::Head)
                    if layout.has_edge(Edge::Tail) && layout.edge_part(Edge::Tail) == 0 =>
                {
                    Next::Continue(IoStep::EdgeRead { edge: Edge::Tail })
                }
                (IoKind::Write { .. }, edge) => Next::Continue(IoStep::Transfer {
                    part: layout.edge_part(edge),
                }),
                (IoKind::WriteZeroes { .. }, edge) => Next::Continue(IoStep::EdgeWrite { edge }),
                (other, _) => panic!("an edge read for {other:?}"),
            }
        }
        IoStep::EdgeWrite { edge } => {
            if bytes != sector_bytes {
                return short;
            }
            if edge == Edge::Head && layout.has_edge(Edge::Tail) {
                Next::Continue(IoStep::EdgeRead { edge: Edge::Tail })
            } else {
                zero_middle(kind, layout, discards)
            }
        }
        IoStep::Primary => match kind {
            IoKind::Flush => Next::Done(Answer::Ok),
            IoKind::Trim { .. } | IoKind::WriteZeroes { .. } => finished(kind),
            other => panic!("a primary step for {other:?}"),
        },
        IoStep::ZeroFill { written_bytes } => {
            let length_bytes = layout.inner_bytes();
            let chunk = zero_chunk_bytes(length_bytes, written_bytes, run_bytes);
            if bytes != chunk {
                return short;
            }
            let written_bytes = written_bytes + chunk;
            if written_bytes < length_bytes {
                Next::Continue(IoStep::ZeroFill { written_bytes })
            } else {
                finished(kind)
            }
        }
        IoStep::FlushAfter => Next::Done(Answer::Ok),
    }
}

/// What the device does for a step, and which bytes of the request's run it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read {
        offset_bytes: u64,
        length_bytes: u32,
        buffer_start: u32,
    },
    Write {
        offset_bytes: u64,
        length_bytes: u32,
        buffer_start: u32,
        fua: bool,
    },
    Flush,
    Discard {
        offset_bytes: u64,
        length_bytes: u32,
    },
}

/// The device operation of `step` (the request's zero run holds `run_bytes`).
pub fn operation(kind: IoKind, layout: &Layout, step: IoStep, run_bytes: usize) -> Operation {
    let sector = layout.sector_bytes;
    match (step, kind) {
        (IoStep::Transfer { part }, IoKind::Read) => {
            let part = layout.part(part);
            Operation::Read {
                offset_bytes: part.device_offset_bytes,
                length_bytes: part.device_bytes,
                buffer_start: 0,
            }
        }
        (IoStep::Transfer { part }, IoKind::Write { fua }) => {
            let part = layout.part(part);
            Operation::Write {
                offset_bytes: part.device_offset_bytes,
                length_bytes: part.device_bytes,
                buffer_start: 0,
                fua,
            }
        }
        (IoStep::EdgeRead { edge }, _) => Operation::Read {
            offset_bytes: layout.edge(edge).sector_offset_bytes,
            length_bytes: sector,
            buffer_start: edge_buffer_start(kind, layout),
        },
        (IoStep::EdgeWrite { edge }, _) => Operation::Write {
            offset_bytes: layout.edge(edge).sector_offset_bytes,
            length_bytes: sector,
            buffer_start: edge_buffer_start(kind, layout),
            fua: false,
        },
        (IoStep::Primary, IoKind::Flush) | (IoStep::FlushAfter, _) => Operation::Flush,
        (IoStep::Primary, IoKind::Trim { .. } | IoKind::WriteZeroes { .. }) => Operation::Discard {
            offset_bytes: layout.inner_start(),
            length_bytes: layout.inner_bytes(),
        },
        (IoStep::ZeroFill { written_bytes }, _) => Operation::Write {
            offset_bytes: layout.inner_start() + u64::from(written_bytes),
            length_bytes: zero_chunk_bytes(layout.inner_bytes(), written_bytes, run_bytes),
            buffer_start: 0,
            fua: false,
        },
        (step, kind) => panic!("no operation for {step:?} of {kind:?}"),
    }
}

/// Where an edge sector is read in the run: the scratch page of a WRITE (its part holds the
/// payload), the start of a WRITE_ZEROES' run.
fn edge_buffer_start(kind: IoKind, layout: &Layout) -> u32 {
    match kind {
        IoKind::Write { .. } => layout.scratch_start(),
        _ => 0,
    }
}

/// WRITE: after the edge sector was read into the scratch page, copies the bytes of it the
/// request does not own into the run around the payload, so the part holds whole sectors.
/// `run` is the request's run from its start.
pub fn merge_edge(layout: &Layout, edge: Edge, run: &mut [u8]) {
    let sector = layout.edge(edge);
    let sector_bytes = layout.sector_bytes as usize;
    let part = layout.part(layout.edge_part(edge));
    let at = (sector.sector_offset_bytes - part.device_offset_bytes) as usize;
    let scratch = layout.scratch_start() as usize;
    assert!(
        at + sector_bytes <= scratch,
        "the edge sector lies in its part"
    );
    let (owned_start, owned_end) = (sector.owned_start as usize, sector.owned_end as usize);
    run.copy_within(scratch..scratch + owned_start, at);
    run.copy_within(scratch + owned_end..scratch + sector_bytes, at + owned_end);
}

/// WRITE_ZEROES: after the edge sector was read into the start of the run, zeroes the bytes
/// the request owns.
pub fn zero_edge(layout: &Layout, edge: Edge, run: &mut [u8]) {
    let sector = layout.edge(edge);
    run[sector.owned_start as usize..sector.owned_end as usize].fill(0);
}

/// Whether `result` of `step` shows that the device does not discard (so later requests skip
/// straight to the fallback).
pub fn reveals_no_discard(kind: IoKind, step: IoStep, result: &Result<u32, FlashError>) -> bool {
    step == IoStep::Primary
        && matches!(kind, IoKind::Trim { .. } | IoKind::WriteZeroes { .. })
        && matches!(result, Err(FlashError::Unsupported))
}

#[cfg(test)]
mod tests;
