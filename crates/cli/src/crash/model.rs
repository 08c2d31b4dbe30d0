//! What each block may hold after a crash: the checker's model.
//!
//! Inputs are the writers' logs of one cycle. Every event carries a tick from one shared
//! atomic counter, taken when the harness *observes* it: a write's tick when it was handed to
//! the connection, its acknowledgement's when the reply was taken, a FLUSH's when it was handed
//! to the connection. The counter is linearisable, so a write whose acknowledgement tick is
//! below a FLUSH's submission tick was acknowledged before that FLUSH was sent, hence before
//! the server received it.
//!
//! Durability rule (docs/PROTOCOL.md §1.6, docs/NBD.md "Flush and multiple connections"): a
//! write is durable when it was acknowledged with FUA, or when it was acknowledged and some
//! FLUSH of the namespace, on any connection and any protocol, was submitted after that
//! acknowledgement and completed. The original ReFlex protocol has neither FLUSH nor FUA: its
//! writes become durable only through a FLUSH on another protocol.
//!
//! Per block, the writes of the cycle in submission order are W1..Wk (all from the writer that
//! owns the block, which never has two writes of one block in flight). If some Wd is durable
//! (take the last one), the block must hold Wd or a later Wj: later writes were sent and may
//! have landed, acknowledged or not. If none is, it must hold its content from before the
//! cycle (the baseline, made durable by the FLUSH after the previous verification) or any Wj.
//! Anything else is a failure: an older write (stale: a durable write was lost), a write of
//! another block (misplaced), a block of another run (foreign), a write id never sent to this
//! block (unexpected), a torn block or garbage.

use std::collections::BTreeMap;

use serde::Serialize;

use super::block::{BLOCK_SIZE_BYTES, BlockHeader, Decoded, WriteId};

/// One write as its writer saw it.
#[derive(Debug, Clone, Copy)]
pub struct WriteRecord {
    pub id: WriteId,
    pub first_block: u64,
    pub block_count: u32,
    pub fua: bool,
    pub submit_tick: u64,
    /// The tick of its successful acknowledgement; `None` if it was in flight when the server
    /// died or the server answered with an error.
    pub ack_tick: Option<u64>,
}

/// One FLUSH as its writer saw it.
#[derive(Debug, Clone, Copy)]
pub struct FlushRecord {
    pub submit_tick: u64,
    /// The tick of its successful completion.
    pub done_tick: Option<u64>,
}

/// A writer's events of one cycle, writes in submission order.
#[derive(Debug, Default, Clone)]
pub struct WriterLog {
    pub writes: Vec<WriteRecord>,
    pub flushes: Vec<FlushRecord>,
}

/// Content a block may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Content {
    /// Never written (older than every write).
    Zero,
    Write(WriteId),
}

impl std::fmt::Display for Content {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Content::Zero => write!(f, "zeroes"),
            Content::Write(id) => write!(f, "write {id}"),
        }
    }
}

/// Which promise a block is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// A write of the cycle was durable: that write or a later one.
    Durable,
    /// Written in the cycle, nothing durable: the baseline or any write of the cycle.
    Unflushed,
    /// Not written in the cycle: exactly the baseline.
    Unchanged,
}

impl Category {
    pub const fn name(self) -> &'static str {
        match self {
            Category::Durable => "durable",
            Category::Unflushed => "unflushed",
            Category::Unchanged => "unchanged",
        }
    }
}

/// Why a block failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// An older content than the oldest allowed: a durable write (or the baseline) is lost.
    Stale,
    /// A write id this block was never sent, or newer than any sent to it.
    Unexpected,
    /// A whole block written for another block number.
    Misplaced,
    /// A whole block of another run (another seed).
    Foreign,
    /// Magic present, CRC wrong: parts of different writes, or damaged bytes.
    Torn,
    /// Neither zero nor a crash-test block.
    Garbage,
}

impl FailureKind {
    pub const fn name(self) -> &'static str {
        match self {
            FailureKind::Stale => "stale",
            FailureKind::Unexpected => "unexpected",
            FailureKind::Misplaced => "misplaced",
            FailureKind::Foreign => "foreign",
            FailureKind::Torn => "torn",
            FailureKind::Garbage => "garbage",
        }
    }
}

/// One block that does not hold what the model allows.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub block: u64,
    pub offset_bytes: u64,
    pub category: Category,
    pub kind: FailureKind,
    /// The allowed contents, e.g. "write cycle 3 writer 1 #40 or later (2 sent)".
    pub expected: String,
    pub found: String,
}

#[derive(Debug, Clone, Copy)]
struct CycleWrite {
    id: WriteId,
    durable: bool,
}

#[derive(Debug, Clone, Default)]
struct BlockState {
    /// Durable content from before the cycle; `None` once a failure left it unknown.
    baseline: Option<Content>,
    /// This cycle's writes of the block, in submission order.
    writes: Vec<CycleWrite>,
}

/// What one cycle's logs amount to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CycleOutcome {
    pub writes: u64,
    pub blocks_written: u64,
    pub writes_acknowledged: u64,
    pub writes_durable: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub flushes_completed: u64,
}

/// Counts of one verification pass.
#[derive(Debug, Clone, Default)]
pub struct Verification {
    /// Blocks checked, by category (including failed ones).
    pub checked: BTreeMap<Category, u64>,
    pub failures: Vec<Failure>,
}

impl Verification {
    pub fn checked(&self, category: Category) -> u64 {
        self.checked.get(&category).copied().unwrap_or(0)
    }
}

/// The model of a whole namespace.
pub struct Model {
    run_tag: u64,
    blocks: Vec<BlockState>,
}

impl Model {
    /// A namespace of `block_count` blocks that starts all zero.
    pub fn new(run_tag: u64, block_count: u64) -> Model {
        let state = BlockState {
            baseline: Some(Content::Zero),
            writes: Vec::new(),
        };
        Model {
            run_tag,
            blocks: vec![state; usize::try_from(block_count).expect("block count fits memory")],
        }
    }

    pub fn block_count(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Adds one cycle's logs (one per writer) and decides which writes are durable.
    pub fn record_cycle(&mut self, logs: &[WriterLog]) -> Vec<CycleOutcome> {
        for state in &self.blocks {
            assert!(
                state.writes.is_empty(),
                "the previous cycle was not settled"
            );
        }
        // A write is covered by a FLUSH submitted after its acknowledgement: the latest
        // completed FLUSH covers everything any earlier one does.
        let last_flush_submit_tick = logs
            .iter()
            .flat_map(|log| &log.flushes)
            .filter(|flush| flush.done_tick.is_some())
            .map(|flush| flush.submit_tick)
            .max();
        let mut outcomes = Vec::with_capacity(logs.len());
        for log in logs {
            let mut outcome = CycleOutcome {
                flushes: log.flushes.len() as u64,
                flushes_completed: log.flushes.iter().filter(|f| f.done_tick.is_some()).count()
                    as u64,
                ..CycleOutcome::default()
            };
            let mut previous_submit_tick = 0;
            for write in &log.writes {
                assert!(write.submit_tick > previous_submit_tick, "writes in order");
                previous_submit_tick = write.submit_tick;
                let durable = match write.ack_tick {
                    None => false,
                    Some(ack_tick) => {
                        assert!(ack_tick > write.submit_tick);
                        write.fua || last_flush_submit_tick.is_some_and(|tick| tick > ack_tick)
                    }
                };
                outcome.writes += 1;
                outcome.blocks_written += u64::from(write.block_count);
                outcome.writes_acknowledged += u64::from(write.ack_tick.is_some());
                outcome.writes_durable += u64::from(durable);
                outcome.fua_writes += u64::from(write.fua);
                for block in write.first_block..write.first_block + u64::from(write.block_count) {
                    let state = &mut self.blocks[usize::try_from(block).expect("block index")];
                    if let Some(last) = state.writes.last() {
                        // One owner per block, in submission order.
                        assert_eq!(last.id.writer_index(), write.id.writer_index());
                        assert!(last.id < write.id);
                    }
                    state.writes.push(CycleWrite {
                        id: write.id,
                        durable,
                    });
                }
            }
            outcomes.push(outcome);
        }
        outcomes
    }

    /// Blocks whose promise is [`Category::Durable`] now: negative controls damage one.
    pub fn durable_blocks(&self) -> impl Iterator<Item = (u64, WriteId)> + '_ {
        self.blocks.iter().enumerate().filter_map(|(block, state)| {
            let durable = state.writes.iter().rev().find(|write| write.durable)?;
            Some((block as u64, durable.id))
        })
    }

    /// The content of `block` before this cycle.
    pub fn baseline(&self, block: u64) -> Option<Content> {
        self.blocks[block as usize].baseline
    }

    /// Checks one block read back; on success returns the content found, which becomes the
    /// block's baseline in [`Model::settle`].
    pub fn check(
        &self,
        block: u64,
        bytes: &[u8],
        verification: &mut Verification,
    ) -> Option<Content> {
        let state = &self.blocks[usize::try_from(block).expect("block index")];
        let last_durable = state.writes.iter().rposition(|write| write.durable);
        let category = match (last_durable, state.writes.is_empty()) {
            (Some(_), _) => Category::Durable,
            (None, false) => Category::Unflushed,
            (None, true) => Category::Unchanged,
        };
        *verification.checked.entry(category).or_default() += 1;
        let allowed_writes = &state.writes[last_durable.unwrap_or(0)..];
        let allowed_baseline = if last_durable.is_some() {
            None
        } else {
            state.baseline
        };
        let oldest_allowed =
            allowed_baseline.or(allowed_writes.first().map(|w| Content::Write(w.id)));
        let is_allowed = |content: Content| {
            allowed_baseline == Some(content)
                || allowed_writes
                    .iter()
                    .any(|write| Content::Write(write.id) == content)
        };
        let decoded = super::block::decode(bytes);
        let found = match decoded {
            Decoded::Zero => Ok(Content::Zero),
            Decoded::Whole(header) => self.content_of(block, &header),
            Decoded::Torn => Err(FailureKind::Torn),
            Decoded::Garbage => Err(FailureKind::Garbage),
        };
        let kind = match found {
            Ok(content) if is_allowed(content) => return Some(content),
            Ok(content) => match oldest_allowed {
                Some(oldest) if content < oldest => FailureKind::Stale,
                _ => FailureKind::Unexpected,
            },
            Err(kind) => kind,
        };
        verification.failures.push(Failure {
            block,
            offset_bytes: block * BLOCK_SIZE_BYTES as u64,
            category,
            kind,
            expected: describe_allowed(allowed_baseline, allowed_writes),
            found: describe_found(&decoded),
        });
        None
    }

    fn content_of(&self, block: u64, header: &BlockHeader) -> Result<Content, FailureKind> {
        if header.run_tag != self.run_tag {
            return Err(FailureKind::Foreign);
        }
        if header.block != block {
            return Err(FailureKind::Misplaced);
        }
        Ok(Content::Write(header.write_id))
    }

    /// Ends the cycle for `block`: what was found (or `None` after a failure) is its new
    /// baseline. The harness FLUSHes after verifying, which makes it durable.
    pub fn settle(&mut self, block: u64, found: Option<Content>) {
        let state = &mut self.blocks[usize::try_from(block).expect("block index")];
        state.baseline = found;
        state.writes.clear();
    }

    /// The tag every block of this run carries.
    pub fn run_tag(&self) -> u64 {
        self.run_tag
    }
}

fn describe_allowed(baseline: Option<Content>, writes: &[CycleWrite]) -> String {
    let mut parts: Vec<String> = baseline.iter().map(ToString::to_string).collect();
    parts.extend(writes.iter().map(|write| {
        let durable = if write.durable { " (durable)" } else { "" };
        format!("write {}{durable}", write.id)
    }));
    if parts.is_empty() {
        "nothing known (an earlier failure)".to_string()
    } else {
        parts.join(" or ")
    }
}

fn describe_found(decoded: &Decoded) -> String {
    match decoded {
        Decoded::Zero => "zeroes".to_string(),
        Decoded::Whole(header) => format!(
            "write {} for block {} over {}{} (run tag {:#x})",
            header.write_id,
            header.block,
            header.protocol.name(),
            if header.fua { " with FUA" } else { "" },
            header.run_tag
        ),
        Decoded::Torn => "a torn block (magic present, CRC wrong)".to_string(),
        Decoded::Garbage => "garbage (no crash-test block)".to_string(),
    }
}

/// Protocol counters of a whole run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProtocolTotals {
    pub writes: u64,
    pub blocks_written: u64,
    pub writes_acknowledged: u64,
    pub writes_durable: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub flushes_completed: u64,
}

impl ProtocolTotals {
    pub fn add(&mut self, outcome: &CycleOutcome) {
        self.writes += outcome.writes;
        self.blocks_written += outcome.blocks_written;
        self.writes_acknowledged += outcome.writes_acknowledged;
        self.writes_durable += outcome.writes_durable;
        self.fua_writes += outcome.fua_writes;
        self.flushes += outcome.flushes;
        self.flushes_completed += outcome.flushes_completed;
    }
}

#[cfg(test)]
mod tests {
    use super::super::block::{BLOCK_SIZE_BYTES, Protocol, encode};
    use super::*;

    const TAG: u64 = 0xabc;

    fn bytes_of(block: u64, id: WriteId) -> Vec<u8> {
        let mut bytes = vec![0u8; BLOCK_SIZE_BYTES];
        encode(
            &BlockHeader {
                run_tag: TAG,
                block,
                write_id: id,
                protocol: Protocol::Native,
                fua: false,
            },
            &mut bytes,
        );
        bytes
    }

    fn write(sequence: u64, block: u64, submit: u64, ack: Option<u64>, fua: bool) -> WriteRecord {
        WriteRecord {
            id: WriteId::new(1, 0, sequence),
            first_block: block,
            block_count: 1,
            fua,
            submit_tick: submit,
            ack_tick: ack,
        }
    }

    /// Checks `found` against a model of one cycle's `log` on a 4-block namespace whose
    /// blocks start as `Content::Zero`.
    fn check(log: WriterLog, block: u64, found: &[u8]) -> Result<Content, FailureKind> {
        let mut model = Model::new(TAG, 4);
        model.record_cycle(&[log]);
        let mut verification = Verification::default();
        match model.check(block, found, &mut verification) {
            Some(content) => Ok(content),
            None => Err(verification.failures[0].kind),
        }
    }

    fn id(sequence: u64) -> WriteId {
        WriteId::new(1, 0, sequence)
    }

    #[test]
    fn a_flush_covers_writes_acknowledged_before_it_was_sent() {
        // W0 acked at 2, flush sent at 3 and done: W0 durable. W1 acked at 5 after the
        // flush was sent: not durable; W2 in flight at the kill.
        let log = WriterLog {
            writes: vec![
                write(0, 0, 1, Some(2), false),
                write(1, 0, 4, Some(5), false),
                write(2, 0, 6, None, false),
            ],
            flushes: vec![FlushRecord {
                submit_tick: 3,
                done_tick: Some(7),
            }],
        };
        for sequence in 0..3 {
            assert_eq!(
                check(log.clone(), 0, &bytes_of(0, id(sequence))),
                Ok(Content::Write(id(sequence)))
            );
        }
        // The block's content from before the cycle is lost once W0 is durable.
        assert_eq!(
            check(log, 0, &[0u8; BLOCK_SIZE_BYTES]),
            Err(FailureKind::Stale)
        );
    }

    #[test]
    fn without_a_completed_flush_the_old_content_or_any_write_is_allowed() {
        let log = WriterLog {
            writes: vec![write(0, 1, 1, Some(2), false), write(1, 1, 3, None, true)],
            // Sent after the ack, never completed: covers nothing.
            flushes: vec![FlushRecord {
                submit_tick: 4,
                done_tick: None,
            }],
        };
        assert_eq!(
            check(log.clone(), 1, &[0u8; BLOCK_SIZE_BYTES]),
            Ok(Content::Zero)
        );
        assert_eq!(
            check(log.clone(), 1, &bytes_of(1, id(1))),
            Ok(Content::Write(id(1)))
        );
        // Never sent to this block.
        assert_eq!(
            check(log.clone(), 1, &bytes_of(1, id(9))),
            Err(FailureKind::Unexpected)
        );
        assert_eq!(
            check(log.clone(), 1, &bytes_of(2, id(0))),
            Err(FailureKind::Misplaced)
        );
        let mut torn = bytes_of(1, id(0));
        torn[2048..].copy_from_slice(&bytes_of(1, id(1))[2048..]);
        assert_eq!(check(log.clone(), 1, &torn), Err(FailureKind::Torn));
        assert_eq!(
            check(log, 1, &[0x5a; BLOCK_SIZE_BYTES]),
            Err(FailureKind::Garbage)
        );
    }

    #[test]
    fn fua_is_durable_alone_and_a_flush_sent_before_the_ack_covers_nothing() {
        let log = WriterLog {
            writes: vec![
                write(0, 2, 1, Some(4), true),
                write(1, 3, 2, Some(5), false),
            ],
            flushes: vec![FlushRecord {
                submit_tick: 3,
                done_tick: Some(6),
            }],
        };
        let mut model = Model::new(TAG, 4);
        let outcomes = model.record_cycle(std::slice::from_ref(&log));
        assert_eq!(outcomes[0].writes_durable, 1);
        assert_eq!(model.durable_blocks().collect::<Vec<_>>(), vec![(2, id(0))]);
        assert_eq!(
            check(log.clone(), 2, &[0u8; BLOCK_SIZE_BYTES]),
            Err(FailureKind::Stale)
        );
        assert_eq!(check(log, 3, &[0u8; BLOCK_SIZE_BYTES]), Ok(Content::Zero));
    }

    #[test]
    fn an_unwritten_block_keeps_its_baseline_across_cycles() {
        let mut model = Model::new(TAG, 2);
        model.record_cycle(&[WriterLog {
            writes: vec![write(0, 0, 1, Some(2), true)],
            flushes: Vec::new(),
        }]);
        let mut verification = Verification::default();
        let found = model.check(0, &bytes_of(0, id(0)), &mut verification);
        model.settle(0, found);
        let found = model.check(1, &[0u8; BLOCK_SIZE_BYTES], &mut verification);
        model.settle(1, found);
        assert!(verification.failures.is_empty());
        assert_eq!(verification.checked(Category::Durable), 1);
        assert_eq!(verification.checked(Category::Unchanged), 1);

        // Next cycle writes nothing: block 0 must still hold W0, zeroes are a loss.
        model.record_cycle(&[WriterLog::default()]);
        let mut verification = Verification::default();
        assert_eq!(
            model.check(0, &bytes_of(0, id(0)), &mut verification),
            Some(Content::Write(id(0)))
        );
        assert_eq!(
            model.check(0, &[0u8; BLOCK_SIZE_BYTES], &mut verification),
            None
        );
        assert_eq!(verification.failures[0].kind, FailureKind::Stale);
        assert_eq!(verification.failures[0].category, Category::Unchanged);
    }
}
