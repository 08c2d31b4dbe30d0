//! Inter-core migration between reflexd's dataplane threads (`docs/FAIRNESS.md`): the
//! bounded queues that carry [`MigrationMessage`]s between threads, and the device operation
//! a thread builds on another thread's buffer.
//!
//! One queue per ordered pair of threads (`from` → `to`), a `crossbeam` [`ArrayQueue`] of the
//! capacity the dataplane asks for ([`Dataplane::migration_queue_capacity`]): `from`'s driver
//! is its only producer and `to`'s its only consumer. The dataplane's credits bound what a
//! pair ever has in flight to that capacity; a full queue anyway leaves the message in the
//! sender's outbox (back-pressure, never loss). After a push the sender writes the receiver's
//! eventfd, so a sleeping receiver wakes: the eventfd keeps the count, so a wake-up written
//! between the receiver's last look at its queues and its sleep is not lost.
//!
//! At shutdown a thread whose dataplane has finished keeps answering what still arrives
//! (with an error: it serves nothing any more) until every thread has finished, so no home
//! waits for an answer from a thread that has stopped looking ([`MigrationLinks::linger`]).

use std::fs::File;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam::queue::ArrayQueue;
use reflex_dataplane::{Dataplane, DeviceCommand, MigrationMessage};
use reflex_flash::{DeviceOp, OpKind};
use reflex_qos::Nanos;

type Queue = ArrayQueue<MigrationMessage>;

/// One thread's ends of the queues between threads.
pub struct MigrationLinks {
    thread_index: usize,
    /// By destination thread (`None` for this thread).
    outgoing: Vec<Option<Arc<Queue>>>,
    /// By source thread (`None` for this thread).
    incoming: Vec<Option<Arc<Queue>>>,
    wakers: Vec<Arc<File>>,
    /// Threads whose dataplane has finished.
    finished: Arc<AtomicUsize>,
}

impl MigrationLinks {
    /// Every thread's links: a queue of `capacity` for each ordered pair.
    pub fn mesh(capacity: usize, wakers: &[Arc<File>]) -> Vec<MigrationLinks> {
        let threads = wakers.len();
        let queues: Vec<Vec<Option<Arc<Queue>>>> = (0..threads)
            .map(|from| {
                (0..threads)
                    .map(|to| (from != to).then(|| Arc::new(ArrayQueue::new(capacity.max(1)))))
                    .collect()
            })
            .collect();
        let finished = Arc::new(AtomicUsize::new(0));
        (0..threads)
            .map(|thread| MigrationLinks {
                thread_index: thread,
                outgoing: queues[thread].clone(),
                incoming: (0..threads)
                    .map(|from| queues[from][thread].clone())
                    .collect(),
                wakers: wakers.to_vec(),
                finished: Arc::clone(&finished),
            })
            .collect()
    }

    /// Hands every message that arrived to the dataplane; returns how many.
    pub fn receive(&self, dataplane: &mut Dataplane, now: Nanos) -> usize {
        let mut received = 0;
        for (from, queue) in self.incoming.iter().enumerate() {
            let Some(queue) = queue else { continue };
            while let Some(message) = queue.pop() {
                dataplane.handle_migration(from as u16, message, now);
                received += 1;
            }
        }
        received
    }

    /// Pushes the dataplane's messages onto the queues that have room and wakes their
    /// receivers.
    pub fn send(&self, dataplane: &mut Dataplane) {
        let mut woken = 0u64;
        while let Some((to, message)) = dataplane.poll_migration(|to| {
            self.outgoing
                .get(usize::from(to))
                .and_then(Option::as_ref)
                .is_some_and(|queue| !queue.is_full())
        }) {
            let to = usize::from(to);
            let Some(queue) = &self.outgoing[to] else {
                panic!("a message from thread {} to itself", self.thread_index);
            };
            if let Err(message) = queue.push(message) {
                // Not reachable: this thread is the queue's only producer and saw room.
                panic!("the queue to thread {to} filled under its producer: {message:?}");
            }
            woken |= 1 << (to % 64);
        }
        for (to, waker) in self.wakers.iter().enumerate() {
            if woken & (1 << (to % 64)) != 0 {
                // An eventfd write fails only when its counter would overflow (already woken).
                let _ = (&**waker).write(&1u64.to_ne_bytes());
            }
        }
    }

    /// After this thread's dataplane finished: answers what still arrives until every thread
    /// has finished (each answer is an error: a finished dataplane serves nothing).
    pub fn linger(&self, dataplane: &mut Dataplane, clock_origin: Instant) {
        assert!(dataplane.is_finished());
        self.finished.fetch_add(1, Ordering::AcqRel);
        let threads = self.wakers.len();
        loop {
            let now = Nanos(clock_origin.elapsed().as_nanos() as u64);
            self.receive(dataplane, now);
            self.send(dataplane);
            if self.finished.load(Ordering::Acquire) >= threads {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // What the last arrivals produced.
        self.send(dataplane);
    }
}

/// The device operation of a read another thread migrated here: the home's buffer, this
/// thread's queue. `None` when `command` is not such a read.
///
/// The buffer lies in the home thread's arena, which outlives every thread's use of it (the
/// threads are joined before any dataplane is dropped, and an arena with operations in
/// flight is leaked, never freed). The home does not touch the buffer between sending the
/// read and receiving its answer (the request is `Submitted`, as for its own device, or
/// `Orphaned` by the home's device timeout, which leaves the run lent until the answer comes
/// back), and the dataplane gives the address to exactly one thread, so this is the only
/// reference to it.
pub fn migrated_device_op(
    dataplane: &Dataplane,
    command: &DeviceCommand,
    user_data: u64,
) -> Option<DeviceOp<'static>> {
    let (_, read) = dataplane.migrated_read(command.id)?;
    let reflex_dataplane::DeviceOpKind::Read { offset_bytes, .. } = read.command.kind else {
        panic!("a migrated operation that is not a read: {read:?}");
    };
    assert_ne!(read.buffer_address, 0, "a migrated read without a buffer");
    // SAFETY: see the function's documentation: the home's arena holds `buffer_len` bytes at
    // this address for as long as the operation is in flight, and nothing else uses them.
    let buf = unsafe {
        std::slice::from_raw_parts_mut(read.buffer_address as *mut u8, read.buffer_len as usize)
    };
    Some(DeviceOp {
        user_data,
        kind: OpKind::Read {
            offset: offset_bytes,
            buf,
        },
        // Registered with the home's ring, not this one.
        buf_index: None,
        queue: command.queue,
    })
}
