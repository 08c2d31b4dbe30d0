//! The real dataplane in virtual time (issue 10): behaviour that depends on timing, proven
//! exactly and fast through [`VirtualServer`] instead of with sleeps on a noisy machine.
//! Clients speak the native protocol with the client library's sans-IO core.

mod common;

use std::sync::Arc;

use reflex_client::ConnectionCore;
use reflex_dataplane::{Limits, RECV_BUFFERS_SPARE_MAX, RequestState};
use reflex_flash::Device;
use reflex_qos::Nanos;
use reflex_sim::{FixedDevice, ModelFlash, NetworkModel, SocketId, VirtualListener, VirtualServer};

const NAMESPACE: u32 = 1;

fn limits() -> Limits {
    Limits::with_arena(32 << 20, 25)
}

/// A server with one thread and one namespace on `device`, the native protocol on listener 0.
fn server(device: Arc<dyn Device>, limits: Limits, network: NetworkModel) -> VirtualServer {
    common::one_namespace_server(device, limits, network, vec![VirtualListener::Native])
}

fn mem() -> Arc<dyn Device> {
    Arc::new(reflex_flash::mem::MemDevice::new(256 << 20).unwrap_or_else(|e| panic!("{e}")))
}

/// A device that takes 100 µs per 4 KiB read, one at a time: requests pile up in it.
fn slow() -> Arc<dyn Device> {
    let mut model = FixedDevice::new(1, 100_000, 100_000, 1024);
    model.set_capacity_bytes(256 << 20);
    Arc::new(ModelFlash::new(Box::new(model), "slow"))
}

/// One native client on a virtual socket.
struct Client {
    socket: SocketId,
    core: ConnectionCore,
    answered: Vec<(u64, bool)>,
    received: Vec<u8>,
}

impl Client {
    fn connect(server: &mut VirtualServer) -> Client {
        let (socket, core) = common::connect_native(server, 0);
        Client {
            socket,
            core,
            answered: Vec::new(),
            received: Vec::new(),
        }
    }

    fn read(&mut self, server: &mut VirtualServer, id: u64, offset: u64, length: u32) {
        self.read_from(server, NAMESPACE, id, offset, length);
    }

    fn read_from(
        &mut self,
        server: &mut VirtualServer,
        namespace: u32,
        id: u64,
        offset: u64,
        length: u32,
    ) {
        self.core
            .submit_read(id, namespace, offset, length)
            .unwrap_or_else(|e| panic!("{e}"));
        self.transmit(server);
    }

    fn transmit(&mut self, server: &mut VirtualServer) {
        common::transmit_all(server, self.socket, &mut self.core);
    }

    /// Takes what reached this client and records each answer (id, ok).
    fn take_answers(&mut self, server: &mut VirtualServer) {
        let answered = &mut self.answered;
        common::take_completions(
            server,
            self.socket,
            &mut self.core,
            &mut self.received,
            |completion| answered.push((completion.request_id, completion.is_ok())),
        );
    }
}

const MS: u64 = 1_000_000;

#[test]
fn idle_connections_park_without_a_buffer_and_wake_on_their_next_request() {
    let mut limits = limits();
    limits.park_after = Some(Nanos(200 * MS));
    let mut server = server(mem(), limits, NetworkModel::default());
    let mut clients: Vec<Client> = (0..300).map(|_| Client::connect(&mut server)).collect();
    for (index, client) in clients.iter_mut().enumerate() {
        client.read(&mut server, 1, (index as u64) * 4096, 4096);
    }
    common::run_until(&mut server, Nanos(10 * MS));
    for client in &mut clients {
        client.take_answers(&mut server);
        assert_eq!(client.answered, vec![(1, true)]);
    }
    let (parked, allocated) = server.dataplane(0).recv_buffer_usage();
    assert_eq!(parked, 0);
    assert_eq!(
        allocated, 300,
        "every active connection holds a receive buffer"
    );
    // Idle for a second: every connection parks and the buffers go (but a few spares).
    common::run_until(&mut server, Nanos(1_000 * MS));
    let (parked, allocated) = server.dataplane(0).recv_buffer_usage();
    assert_eq!(parked, 300);
    assert!(
        allocated <= RECV_BUFFERS_SPARE_MAX,
        "{allocated} buffers for idle connections"
    );
    // Each wakes on its next request and is served.
    for client in &mut clients {
        client.read(&mut server, 2, 0, 4096);
    }
    common::run_until(&mut server, Nanos(1_010 * MS));
    for client in &mut clients {
        client.take_answers(&mut server);
        assert_eq!(client.answered, vec![(1, true), (2, true)]);
    }
    assert_eq!(server.dataplane(0).recv_buffer_usage().0, 0);
}

#[test]
fn a_client_that_never_reads_its_answers_does_not_stall_the_others() {
    let network = NetworkModel {
        latency: Nanos(10_000),
        client_buffer_bytes: 256 << 10,
        ..NetworkModel::default()
    };
    let mut server = server(mem(), limits(), network);
    let mut hog = Client::connect(&mut server);
    for id in 0..128 {
        hog.read(&mut server, id, 0, 1 << 20);
    }
    common::run_until(&mut server, Nanos(50 * MS));
    // The hog holds what its share of the arena allows, nothing more.
    let held = server
        .dataplane(0)
        .requests_in_state(RequestState::Completed)
        + server.dataplane(0).requests_in_state(RequestState::Sending);
    assert!(held <= 9, "the hog holds {held} answers of 1 MiB");
    let mut polite = Client::connect(&mut server);
    for id in 0..100 {
        polite.read(&mut server, id, 4096 * id, 4096);
    }
    // The polite client reads as its answers arrive.
    for step in 51..=60 {
        common::run_until(&mut server, Nanos(step * MS));
        polite.take_answers(&mut server);
    }
    assert_eq!(polite.answered.len(), 100);
    assert!(polite.answered.iter().all(|&(_, ok)| ok));
}

#[test]
fn shutdown_answers_the_requests_in_flight_then_finishes() {
    let mut server = server(slow(), limits(), NetworkModel::default());
    let mut clients: Vec<Client> = (0..4).map(|_| Client::connect(&mut server)).collect();
    for (index, client) in clients.iter_mut().enumerate() {
        for id in 0..20 {
            client.read(&mut server, id, (index as u64 * 20 + id) * 4096, 4096);
        }
    }
    // 80 reads at 100 µs each, one at a time: about 8 ms of work; shut down after 1 ms.
    common::run_until(&mut server, Nanos(MS));
    server.begin_shutdown();
    common::run_until(&mut server, Nanos(100 * MS));
    assert!(server.is_finished());
    for client in &mut clients {
        client.take_answers(&mut server);
        assert_eq!(
            client.answered.len(),
            20,
            "every request in flight was answered"
        );
        assert!(client.answered.iter().all(|&(_, ok)| ok));
        assert!(server.is_closed_by_server(client.socket));
    }
    let stats = &server.stats()[0];
    assert_eq!(
        stats.requests_per_state[RequestState::Free as usize],
        4096,
        "every request slot is free again"
    );
}

#[test]
fn read_latency_is_measured_from_arrival_to_the_answer_leaving() {
    // 100 µs per read on the device, 20 µs each way on the network: the server sees the
    // device time only (it measures from the request's arrival off the socket to its answer
    // leaving), whatever the network adds.
    let network = NetworkModel {
        latency: Nanos(20_000),
        ..NetworkModel::default()
    };
    let mut server = server(slow(), limits(), network);
    let mut client = Client::connect(&mut server);
    for id in 0..10 {
        client.read(&mut server, id, id * 4096, 4096);
        common::run_until(&mut server, Nanos((id + 1) * 2 * MS));
        client.take_answers(&mut server);
    }
    assert_eq!(client.answered.len(), 10);
    let reads = &server.dataplane(0).namespace_telemetry(0).reads;
    assert_eq!(reads.count(), 10);
    let median = reads.quantile_us(0.5);
    assert!((100..=107).contains(&median), "median {median} µs");
}

/// A window of 64 reads that arrive together leaves in one gathered send: each answer takes
/// the slices it needs (header and data), not three, so 64 fit the send's 129 (43 did before).
#[test]
fn sixty_four_pipelined_reads_are_answered_in_one_send() {
    let mut server = server(mem(), limits(), NetworkModel::default());
    let mut client = Client::connect(&mut server);
    common::run_until(&mut server, Nanos(MS));
    let sends_before = server.dataplane(0).stats().sends;
    for id in 0..64 {
        client
            .core
            .submit_read(id, NAMESPACE, id * 4096, 4096)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    client.transmit(&mut server);
    common::run_until(&mut server, Nanos(2 * MS));
    client.take_answers(&mut server);
    assert_eq!(client.answered.len(), 64);
    assert!(client.answered.iter().all(|&(_, ok)| ok));
    assert_eq!(server.dataplane(0).stats().sends - sends_before, 1);
}

/// A `mem` READ of one whole block is answered with a loan of the device's memory, not a
/// copy: its answer must still carry the data as it was when read, however late it is sent.
/// A reader that does not take its answers keeps them queued at the server (its receive
/// window is full) while another client overwrites the blocks; the queued answers then
/// arrive with the old bytes, and a later READ sees the new ones.
#[test]
fn a_lent_read_keeps_its_data_when_a_write_lands_before_it_is_sent() {
    let network = NetworkModel {
        latency: Nanos(10_000),
        client_buffer_bytes: 16 << 10,
        ..NetworkModel::default()
    };
    let device =
        Arc::new(reflex_flash::mem::MemDevice::new(256 << 20).unwrap_or_else(|e| panic!("{e}")));
    let mut server = server(device.clone(), limits(), network);
    let mut writer = Client::connect(&mut server);
    let old: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    for block in 0..16u64 {
        writer
            .core
            .submit_write(block, NAMESPACE, block * 4096, &old, false)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    writer.transmit(&mut server);
    common::run_until(&mut server, Nanos(MS));
    writer.take_answers(&mut server);
    assert_eq!(writer.answered.len(), 16);
    // 16 reads of 4 KiB against a 16 KiB receive window: most answers wait at the server.
    let mut reader = Client::connect(&mut server);
    for block in 0..16u64 {
        reader
            .core
            .submit_read(block, NAMESPACE, block * 4096, 4096)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    reader.transmit(&mut server);
    common::run_until(&mut server, Nanos(2 * MS));
    let lent = server.dataplane(0).stats().reads_lent;
    assert_eq!(lent, 16, "every read was answered with a loan");
    let waiting = server
        .dataplane(0)
        .requests_in_state(RequestState::Completed)
        + server.dataplane(0).requests_in_state(RequestState::Sending);
    assert!(waiting >= 8, "only {waiting} answers wait to be sent");
    // An answer that waits holds its loan.
    assert!(device.loans_outstanding() >= waiting as u64);
    let new = vec![0xEE; 4096];
    for block in 0..16u64 {
        writer
            .core
            .submit_write(100 + block, NAMESPACE, block * 4096, &new, false)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    writer.transmit(&mut server);
    common::run_until(&mut server, Nanos(3 * MS));
    writer.take_answers(&mut server);
    assert_eq!(writer.answered.len(), 32);
    assert!(writer.answered.iter().all(|&(_, ok)| ok));
    // The reader takes its answers now: every one has the data of its read.
    let mut data = Vec::new();
    for step in 4..=20 {
        common::run_until(&mut server, Nanos(step * MS));
        common::take_completions(
            &mut server,
            reader.socket,
            &mut reader.core,
            &mut reader.received,
            |completion| {
                assert!(completion.is_ok());
                data.push((completion.request_id, completion.data.to_vec()));
            },
        );
    }
    assert_eq!(data.len(), 16);
    // Every loan went back once its answer was sent (the last ones when that send
    // completed, in one batch).
    assert_eq!(device.loans_outstanding(), 0);
    for (id, bytes) in &data {
        assert_eq!(bytes, &old, "read {id} changed after it was answered");
    }
    // The blocks hold the new data.
    reader
        .core
        .submit_read(99, NAMESPACE, 5 * 4096, 4096)
        .unwrap_or_else(|e| panic!("{e}"));
    reader.transmit(&mut server);
    common::run_until(&mut server, Nanos(21 * MS));
    let mut last = Vec::new();
    common::take_completions(
        &mut server,
        reader.socket,
        &mut reader.core,
        &mut reader.received,
        |completion| last.push(completion.data.to_vec()),
    );
    assert_eq!(last, vec![new]);
}

/// Finding 8 at the dataplane: with a 1 MiB arena (one maximal run, which one connection may
/// hold), a client pipelining 1 MiB READs and reading its answers slowly took every freed run
/// ahead of another client's small READ that had waited longer, for as long as it kept
/// sending. Waiting connections are now served in the order they began to wait.
#[test]
fn a_connection_pipelining_large_reads_does_not_take_every_freed_buffer() {
    let network = NetworkModel {
        client_buffer_bytes: 64 << 10,
        ..NetworkModel::default()
    };
    let mut server = server(mem(), Limits::with_arena(1 << 20, 25), network);
    let mut hog = Client::connect(&mut server);
    for id in 0..8 {
        hog.read(&mut server, id, 0, 1 << 20);
    }
    common::run_until(&mut server, Nanos(MS));
    let mut polite = Client::connect(&mut server);
    polite.read(&mut server, 100, 0, 4096);
    // The hog takes 64 KiB per millisecond; the polite client reads as its answer arrives.
    for step in 2..=1_000 {
        common::run_until(&mut server, Nanos(step * MS));
        hog.take_answers(&mut server);
        polite.take_answers(&mut server);
        if !polite.answered.is_empty() {
            break;
        }
    }
    assert_eq!(polite.answered, [(100, true)]);
    // Its READ waited for the run of the hog's first READ and then for the one the hog had
    // begun to wait for before it: not for the hog's later READs.
    assert!(
        hog.answered.len() <= 2,
        "the polite READ waited for {} of the hog's 1 MiB READs",
        hog.answered.len()
    );
}

#[test]
fn a_namespace_added_then_removed_under_load_finishes_its_admitted_requests() {
    use reflex_dataplane::control::NewNamespace;
    use reflex_dataplane::namespaces::SlotState;
    let mut server = server(mem(), limits(), NetworkModel::default());
    let mut client = Client::connect(&mut server);
    // Namespace 2 on a slow device, added while the server runs.
    let added = server
        .control()
        .add_namespace(NewNamespace {
            id: 2,
            device: slow(),
            read_only: false,
            profile: None,
            export: None,
        })
        .unwrap_or_else(|e| panic!("add: {e}"));
    assert_eq!(added.namespace_index, 1);
    for id in 1..=10 {
        client.read_from(&mut server, 2, id, id * 4096, 4096);
    }
    // Two reads take 200 µs: the others wait in the device and the scheduler.
    let until = server.now() + Nanos(250_000);
    common::run_until(&mut server, until);
    client.take_answers(&mut server);
    let early = client.answered.len();
    assert!((1..10).contains(&early), "{:?}", client.answered);
    let removed = server
        .control()
        .remove_namespace(2, true)
        .unwrap_or_else(|e| panic!("remove: {e}"));
    assert_eq!(removed.namespace_index, 1);
    // Admitted requests finish on the device; a new one is refused as naming no namespace.
    client.read_from(&mut server, 2, 11, 0, 4096);
    client.read(&mut server, 12, 0, 4096);
    let until = server.now() + Nanos(10 * MS);
    common::run_until(&mut server, until);
    client.take_answers(&mut server);
    let mut answers = client.answered.clone();
    answers.sort_unstable();
    let expected: Vec<(u64, bool)> = (1..=12).map(|id| (id, id != 11)).collect();
    assert_eq!(answers, expected);
    // Every thread drained the slot: its queue is closed and the catalog dropped its device.
    assert_eq!(server.dataplane(0).namespaces_draining(), 0);
    assert_eq!(server.control().namespaces_removing(), 0);
    let catalog = server
        .control()
        .catalog()
        .unwrap_or_else(|| panic!("no catalog"));
    assert_eq!(catalog.namespaces.state(1), SlotState::Gone);
    assert!(catalog.namespaces.device(1).is_none());
    assert_eq!(catalog.namespaces.index_of(2), None);
}

/// A full table makes room by closing the oldest connection that never completed a request:
/// connections that did, connections already closed (whose slots were reused) and younger
/// ones stay. Candidates are kept in arrival order per listener instead of scanning the table
/// on every accept (a slowloris flood at a full table accepts hundreds per second).
#[test]
fn a_full_table_evicts_the_oldest_connection_still_waiting_for_its_first_request() {
    let mut limits = limits();
    limits.connections_max = 8;
    let mut server = server(mem(), limits, NetworkModel::default());
    let mut clients: Vec<Client> = Vec::new();
    let later = |server: &mut VirtualServer, by: u64| {
        let until = Nanos(server.now().0 + by);
        common::run_until(server, until);
    };
    let connect = |server: &mut VirtualServer, clients: &mut Vec<Client>| {
        later(server, MS);
        clients.push(Client::connect(server));
        later(server, MS);
    };
    for _ in 0..8 {
        connect(&mut server, &mut clients);
    }
    // 0 and 2 complete a request; 1 closes (its slot is free for the next newcomer).
    for index in [0, 2] {
        clients[index].read(&mut server, 1, 0, 4096);
    }
    server.client_close(clients[1].socket);
    later(&mut server, 10 * MS);
    for index in [0, 2] {
        clients[index].take_answers(&mut server);
        assert_eq!(clients[index].answered, vec![(1, true)]);
    }
    assert!(server.is_closed_by_server(clients[1].socket));
    // Client 8 takes 1's place without evicting anyone; then every newcomer evicts the
    // oldest still waiting: 3, 4, 5, 6, 7, then 8 (in the reused slot), never 0 or 2.
    connect(&mut server, &mut clients);
    let evicted_before = |server: &VirtualServer, clients: &[Client]| -> Vec<usize> {
        (0..clients.len())
            .filter(|&index| index != 1 && server.is_closed_by_server(clients[index].socket))
            .collect()
    };
    assert_eq!(evicted_before(&server, &clients), Vec::<usize>::new());
    let mut expected = Vec::new();
    for victim in [3, 4, 5, 6, 7, 8] {
        connect(&mut server, &mut clients);
        expected.push(victim);
        assert_eq!(evicted_before(&server, &clients), expected);
    }
    assert_eq!(server.stats()[0].connections_evicted, 6);
}

/// The eviction candidates stay right when many connections come and go behind one that
/// never sends a request (their entries go stale behind it and are compacted away).
#[test]
fn eviction_stays_oldest_first_after_many_connections_came_and_went() {
    let mut limits = limits();
    limits.connections_max = 8;
    let mut server = server(mem(), limits, NetworkModel::default());
    let later = |server: &mut VirtualServer, by: u64| {
        let until = Nanos(server.now().0 + by);
        common::run_until(server, until);
    };
    let oldest = Client::connect(&mut server);
    later(&mut server, MS);
    // Far more than twice the table's slots: entries for closed connections pile up behind
    // the oldest one, which stays open without a request.
    for _ in 0..500 {
        let passing = Client::connect(&mut server);
        later(&mut server, 10_000);
        server.client_close(passing.socket);
        later(&mut server, 10_000);
        assert!(server.is_closed_by_server(passing.socket));
    }
    let mut waiting: Vec<Client> = Vec::new();
    for _ in 0..7 {
        waiting.push(Client::connect(&mut server));
        later(&mut server, MS);
    }
    assert!(!server.is_closed_by_server(oldest.socket));
    // The table is full: the newcomer evicts the oldest, then the next oldest.
    let _newcomer = Client::connect(&mut server);
    later(&mut server, MS);
    assert!(server.is_closed_by_server(oldest.socket));
    assert!(
        waiting
            .iter()
            .all(|c| !server.is_closed_by_server(c.socket))
    );
    let _another = Client::connect(&mut server);
    later(&mut server, MS);
    assert!(server.is_closed_by_server(waiting[0].socket));
    assert!(
        waiting[1..]
            .iter()
            .all(|c| !server.is_closed_by_server(c.socket))
    );
    assert_eq!(server.stats()[0].connections_evicted, 2);
}
