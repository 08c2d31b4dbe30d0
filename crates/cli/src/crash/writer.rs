//! The writers of one cycle: one thread per connection, each owning a disjoint range of
//! blocks, pipelining patterned writes (plain, FUA) and FLUSHes over its protocol until the
//! server dies under it, and logging what it saw for the model.
//!
//! Why one owner per block: two writes of one block in flight at once may land in either order,
//! which would make "the latest write" meaningless. A writer never sends a write that overlaps
//! one of its writes still in flight, so per block the submission order is the order on disk.
//! FLUSHes need no owner: one on any connection covers every write acknowledged before it
//! (the model applies them across writers and protocols).
//!
//! Each writer draws its choices (blocks, sizes, FUA, FLUSH) from its own PRNG seeded from the
//! run's seed, the cycle and its index; what timing does with them is not reproducible.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_client::{ClientError, ClientOptions, PipelinedClient};
use reflex_proto::nbd::TransmissionFlags;

use super::block::{BLOCK_SIZE_BYTES, BlockHeader, Protocol, SEQUENCE_MAX, WriteId, encode};
use super::model::{FlushRecord, WriteRecord, WriterLog};
use super::original::OriginalCore;
use crate::bench::nbd::connect as nbd_connect;
use crate::bench::nbd_core::NbdCore;

/// Longest a connection waits for the server without any byte moving: after a SIGKILL the
/// kernel closes the sockets at once, so this only bounds a hung server.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest write, in blocks.
pub const WRITE_BLOCKS_MAX: u32 = 4;
/// Tries to find blocks not overlapping a write in flight before sending nothing more this
/// round.
const PICK_TRIES_MAX: u32 = 8;
/// The namespace every protocol addresses (the harness configures exactly one).
pub const NAMESPACE_ID: u32 = 1;

/// Shared between the writers and the thread that kills the server.
#[derive(Debug, Default)]
pub struct Shared {
    /// The event counter: every tick of the model comes from here.
    pub clock: AtomicU64,
    /// Blocks of acknowledged writes this cycle (the kill waits for enough of them).
    pub acknowledged_blocks: AtomicU64,
    /// Requests sent and not answered, across writers.
    pub in_flight: AtomicU64,
    /// Set after the kill (or the cycle's deadline): send nothing more.
    pub stop: AtomicBool,
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// What one writer does in a cycle.
#[derive(Debug, Clone)]
pub struct WriterPlan {
    pub writer_index: usize,
    pub protocol: Protocol,
    pub address: SocketAddr,
    pub cycle: u64,
    pub run_tag: u64,
    pub seed: u64,
    /// The blocks it owns: `first_block..first_block + region_blocks`.
    pub first_block: u64,
    pub region_blocks: u64,
    pub queue_depth: usize,
    /// It sends at most this many blocks (the kill normally comes first).
    pub blocks_max: u64,
    /// Chance of FUA on a write and of a FLUSH instead of a write, in percent.
    pub fua_percent: u32,
    pub flush_percent: u32,
    /// It sends nothing after this instant.
    pub deadline: Instant,
}

/// How a writer's cycle ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriterEnd {
    /// The server went away (the kill): the expected end.
    ServerGone(String),
    /// Told to stop, or out of blocks or time, with every request answered.
    Finished,
}

/// A writer's log and how it ended.
#[derive(Debug)]
pub struct WriterReport {
    pub log: WriterLog,
    pub end: WriterEnd,
    /// Writes or FLUSHes the server answered with an error (not counted as acknowledged).
    pub errors: u64,
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Free,
    Write { record_index: usize },
    Flush { record_index: usize },
}

/// Runs one writer until the server dies or it has nothing left to do. Fails only when it
/// cannot connect or the server breaks the protocol.
pub fn run(plan: &WriterPlan, shared: &Shared) -> Result<WriterReport> {
    assert!(plan.region_blocks >= u64::from(WRITE_BLOCKS_MAX));
    assert!(plan.queue_depth >= 1);
    let mut link = Link::connect(plan)?;
    let mut writer = Writer {
        plan,
        shared,
        rng: Xoshiro256PlusPlus::seed_from_u64(
            plan.seed
                ^ plan.cycle.rotate_left(32)
                ^ (plan.writer_index as u64).wrapping_mul(0x9E37),
        ),
        slots: vec![Slot::Free; plan.queue_depth],
        log: WriterLog::default(),
        errors: 0,
        blocks_sent: 0,
        sequence: 0,
        payload: vec![0u8; WRITE_BLOCKS_MAX as usize * BLOCK_SIZE_BYTES],
    };
    let mut done = Vec::with_capacity(plan.queue_depth);
    let end = loop {
        let stopping = shared.stop.load(Ordering::SeqCst)
            || writer.blocks_sent >= plan.blocks_max
            || Instant::now() >= plan.deadline;
        if !stopping {
            writer.fill_queue(&mut link)?;
        }
        if writer.slots.iter().all(|slot| matches!(slot, Slot::Free)) {
            // With every slot free no pick can overlap, so something was sent unless stopping.
            assert!(stopping, "writer {} sent nothing", plan.writer_index);
            break WriterEnd::Finished;
        }
        done.clear();
        let exchanged = link.exchange(&mut done);
        writer.settle(&done);
        match exchanged {
            Ok(()) => {}
            Err(LinkEnd::Gone(how)) => {
                // Requests still in slots stay unacknowledged: they may or may not have landed.
                let unanswered = writer
                    .slots
                    .iter()
                    .filter(|slot| !matches!(slot, Slot::Free))
                    .count() as u64;
                shared.in_flight.fetch_sub(unanswered, Ordering::SeqCst);
                break WriterEnd::ServerGone(how);
            }
            Err(LinkEnd::Broken(why)) => bail!(
                "writer {} ({}): the server broke the protocol: {why}",
                plan.writer_index,
                plan.protocol.name()
            ),
        }
    };
    Ok(WriterReport {
        log: writer.log,
        end,
        errors: writer.errors,
    })
}

/// One writer's state within a cycle.
struct Writer<'a> {
    plan: &'a WriterPlan,
    shared: &'a Shared,
    rng: Xoshiro256PlusPlus,
    /// Indexed by request slot (the request id, cookie or handle on the wire).
    slots: Vec<Slot>,
    log: WriterLog,
    errors: u64,
    blocks_sent: u64,
    sequence: u64,
    /// The payload of one write, encoded before it is copied into the connection's buffer.
    payload: Vec<u8>,
}

impl Writer<'_> {
    /// Sends a request on every free slot: a FLUSH (at most one in flight) or a write.
    fn fill_queue(&mut self, link: &mut Link) -> Result<()> {
        let plan = self.plan;
        for slot_index in 0..self.slots.len() {
            if !matches!(self.slots[slot_index], Slot::Free) {
                continue;
            }
            let flush_in_flight = self
                .slots
                .iter()
                .any(|slot| matches!(slot, Slot::Flush { .. }));
            if plan.protocol.has_flush()
                && !flush_in_flight
                && percent(&mut self.rng, plan.flush_percent)
            {
                self.log.flushes.push(FlushRecord {
                    submit_tick: self.shared.tick(),
                    done_tick: None,
                });
                link.submit_flush(slot_index)?;
                self.slots[slot_index] = Slot::Flush {
                    record_index: self.log.flushes.len() - 1,
                };
                self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            if !self.submit_write(link, slot_index)? || self.blocks_sent >= plan.blocks_max {
                break;
            }
        }
        Ok(())
    }

    /// Sends a write on `slot_index`; false when every pick overlapped a write in flight.
    fn submit_write(&mut self, link: &mut Link, slot_index: usize) -> Result<bool> {
        let plan = self.plan;
        let Some((first_block, block_count)) =
            pick_blocks(&mut self.rng, plan, &self.slots, &self.log)
        else {
            return Ok(false);
        };
        let fua = plan.protocol.has_flush() && percent(&mut self.rng, plan.fua_percent);
        assert!(self.sequence <= SEQUENCE_MAX);
        let id = WriteId::new(plan.cycle, plan.writer_index, self.sequence);
        self.sequence += 1;
        let data = &mut self.payload[..block_count as usize * BLOCK_SIZE_BYTES];
        for (index, block_bytes) in data.chunks_exact_mut(BLOCK_SIZE_BYTES).enumerate() {
            let header = BlockHeader {
                run_tag: plan.run_tag,
                block: first_block + index as u64,
                write_id: id,
                protocol: plan.protocol,
                fua,
            };
            encode(&header, block_bytes);
        }
        // The tick before the request exists anywhere but here.
        self.log.writes.push(WriteRecord {
            id,
            first_block,
            block_count,
            fua,
            submit_tick: self.shared.tick(),
            ack_tick: None,
        });
        link.submit_write(slot_index, first_block * BLOCK_SIZE_BYTES as u64, data, fua)?;
        self.slots[slot_index] = Slot::Write {
            record_index: self.log.writes.len() - 1,
        };
        self.blocks_sent += u64::from(block_count);
        self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    /// Records the answers in `done`, (slot, success), each with a tick taken after it was
    /// received.
    fn settle(&mut self, done: &[(usize, bool)]) {
        for &(slot_index, ok) in done {
            let slot = std::mem::replace(&mut self.slots[slot_index], Slot::Free);
            self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            if !ok {
                self.errors += 1;
                continue;
            }
            let tick = self.shared.tick();
            match slot {
                Slot::Write { record_index } => {
                    let record = &mut self.log.writes[record_index];
                    record.ack_tick = Some(tick);
                    self.shared
                        .acknowledged_blocks
                        .fetch_add(u64::from(record.block_count), Ordering::SeqCst);
                }
                Slot::Flush { record_index } => {
                    self.log.flushes[record_index].done_tick = Some(tick);
                }
                Slot::Free => unreachable!("an answer for a free slot passed the core's checks"),
            }
        }
    }
}

fn percent(rng: &mut Xoshiro256PlusPlus, chance_percent: u32) -> bool {
    below(rng, 100) < u64::from(chance_percent)
}

/// Uniform in `0..bound`.
pub fn below(rng: &mut impl Rng, bound: u64) -> u64 {
    assert!(bound > 0);
    ((u128::from(rng.next_u64()) * u128::from(bound)) >> 64) as u64
}

/// A run of 1..=WRITE_BLOCKS_MAX blocks in the writer's region that overlaps no write in
/// flight; `None` after [`PICK_TRIES_MAX`] overlapping picks.
fn pick_blocks(
    rng: &mut Xoshiro256PlusPlus,
    plan: &WriterPlan,
    slots: &[Slot],
    log: &WriterLog,
) -> Option<(u64, u32)> {
    for _ in 0..PICK_TRIES_MAX {
        let block_count = 1 + below(rng, u64::from(WRITE_BLOCKS_MAX)) as u32;
        let first_block =
            plan.first_block + below(rng, plan.region_blocks - u64::from(block_count) + 1);
        let end_block = first_block + u64::from(block_count);
        let overlaps = slots.iter().any(|slot| match slot {
            Slot::Write { record_index } => {
                let other = &log.writes[*record_index];
                first_block < other.first_block + u64::from(other.block_count)
                    && other.first_block < end_block
            }
            _ => false,
        });
        if !overlaps {
            return Some((first_block, block_count));
        }
    }
    None
}

/// One connection of any of the three protocols, driven blocking.
enum Link {
    /// Boxed: the pipelined client is several times larger than the other links.
    Native(Box<PipelinedClient>),
    Nbd {
        stream: TcpStream,
        core: NbdCore,
    },
    Original {
        stream: TcpStream,
        core: OriginalCore,
    },
}

impl Link {
    fn connect(plan: &WriterPlan) -> Result<Link> {
        let io_size_bytes = WRITE_BLOCKS_MAX * BLOCK_SIZE_BYTES as u32;
        match plan.protocol {
            Protocol::Native => {
                let options = ClientOptions {
                    timeout: Some(IO_TIMEOUT),
                    io_priority: None,
                    reconnect: None,
                    tls: None,
                };
                let client = PipelinedClient::connect_with(plan.address, &options)
                    .with_context(|| format!("native connection to {}", plan.address))?;
                if (client.window() as usize) < plan.queue_depth {
                    bail!(
                        "the server's window ({}) is below the queue depth ({})",
                        client.window(),
                        plan.queue_depth
                    );
                }
                Ok(Link::Native(Box::new(client)))
            }
            Protocol::Nbd => {
                let (stream, mut core, export) = nbd_connect(plan.address, "ns1")?;
                let needed = TransmissionFlags::SEND_FLUSH.union(TransmissionFlags::SEND_FUA);
                if !export.flags.contains(needed) {
                    bail!("the NBD export does not offer FLUSH and FUA");
                }
                core.reserve(plan.queue_depth, io_size_bytes);
                stream.set_read_timeout(Some(IO_TIMEOUT))?;
                stream.set_write_timeout(Some(IO_TIMEOUT))?;
                Ok(Link::Nbd { stream, core })
            }
            Protocol::Original => {
                let stream = TcpStream::connect_timeout(&plan.address, IO_TIMEOUT)
                    .with_context(|| format!("original-protocol connection to {}", plan.address))?;
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(IO_TIMEOUT))?;
                stream.set_write_timeout(Some(IO_TIMEOUT))?;
                Ok(Link::Original {
                    stream,
                    core: OriginalCore::new(plan.queue_depth),
                })
            }
        }
    }

    fn submit_write(
        &mut self,
        slot: usize,
        offset_bytes: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<()> {
        let length_bytes = u32::try_from(data.len())?;
        match self {
            Link::Native(client) => client
                .submit_write(slot as u64 + 1, NAMESPACE_ID, offset_bytes, data, fua)
                .context("native WRITE refused by the connection core"),
            Link::Nbd { core, .. } => core
                .submit_write_with(slot as u64, offset_bytes, length_bytes, fua, |buf| {
                    buf.copy_from_slice(data);
                })
                .context("NBD WRITE refused by the NBD core"),
            Link::Original { core, .. } => {
                assert!(!fua, "the original protocol has no FUA");
                core.submit_write(slot, offset_bytes, data);
                Ok(())
            }
        }
    }

    fn submit_flush(&mut self, slot: usize) -> Result<()> {
        match self {
            Link::Native(client) => client
                .submit_flush(slot as u64 + 1, NAMESPACE_ID)
                .context("native FLUSH refused by the connection core"),
            Link::Nbd { core, .. } => core
                .submit_flush(slot as u64)
                .context("NBD FLUSH refused by the NBD core"),
            Link::Original { .. } => unreachable!("the original protocol has no FLUSH"),
        }
    }

    /// Sends everything queued and waits for at least one answer, appended to `done` as
    /// (slot, success). Answers that arrived before the connection ended are in `done` even
    /// when it returns an error.
    fn exchange(&mut self, done: &mut Vec<(usize, bool)>) -> Result<(), LinkEnd> {
        match self {
            Link::Native(client) => loop {
                match client.wait(Some(IO_TIMEOUT)) {
                    Ok(true) => {}
                    Ok(false) => {
                        return Err(LinkEnd::Gone("no answer within the I/O timeout".into()));
                    }
                    Err(ClientError::Protocol(error)) => {
                        return Err(LinkEnd::Broken(error.to_string()));
                    }
                    Err(ClientError::Closed) => {
                        return Err(LinkEnd::Gone("the server closed the connection".into()));
                    }
                    Err(error) => return Err(LinkEnd::Gone(error.to_string())),
                }
                while let Some(completion) =
                    client.reap().map_err(|e| LinkEnd::Broken(e.to_string()))?
                {
                    if completion.is_notice() {
                        continue;
                    }
                    done.push(((completion.request_id - 1) as usize, completion.is_ok()));
                }
                if !done.is_empty() {
                    return Ok(());
                }
            },
            Link::Nbd { stream, core } => {
                while let Some(bytes) = core.transmit_start() {
                    let written = stream.write(bytes);
                    core.transmit_done(written.as_ref().map_or(0, |count| *count));
                    gone_unless_moved(written)?;
                }
                loop {
                    while let Some(completion) = core
                        .poll_completion()
                        .map_err(|e| LinkEnd::Broken(e.to_string()))?
                    {
                        done.push((completion.cookie as usize, completion.error == 0));
                    }
                    if !done.is_empty() {
                        return Ok(());
                    }
                    let Some(space) = core.receive_start() else {
                        return Err(LinkEnd::Broken(
                            "the receive buffer is full without a reply".into(),
                        ));
                    };
                    let received = stream.read(space);
                    core.receive_done(received.as_ref().map_or(0, |count| *count));
                    gone_unless_moved(received)?;
                }
            }
            Link::Original { stream, core } => {
                while !core.pending_output().is_empty() {
                    let written = stream.write(core.pending_output());
                    core.consume_output(written.as_ref().map_or(0, |count| *count));
                    gone_unless_moved(written)?;
                }
                let mut buffer = [0u8; 4096];
                loop {
                    while let Some(slot) = core
                        .poll_completion()
                        .map_err(|e| LinkEnd::Broken(e.to_string()))?
                    {
                        done.push((slot, true));
                    }
                    if !done.is_empty() {
                        return Ok(());
                    }
                    let received = stream.read(&mut buffer);
                    if let Ok(count) = received {
                        core.handle_bytes(&buffer[..count]);
                    }
                    gone_unless_moved(received)?;
                }
            }
        }
    }
}

/// Why a connection ended.
#[derive(Debug)]
enum LinkEnd {
    /// The server went away: closed, reset, or silent past [`IO_TIMEOUT`].
    Gone(String),
    /// The server's bytes broke the protocol: a finding, not a crash symptom.
    Broken(String),
}

/// A send or receive that moved no byte means the server is gone (EINTR is retried).
fn gone_unless_moved(result: std::io::Result<usize>) -> Result<(), LinkEnd> {
    match result {
        Ok(0) => Err(LinkEnd::Gone("the server closed the connection".into())),
        Ok(_) => Ok(()),
        Err(error) if error.kind() == ErrorKind::Interrupted => Ok(()),
        Err(error) => Err(LinkEnd::Gone(error.to_string())),
    }
}
