//! Thread scaling on a real reflexd over loopback (`docs/OPERATIONS.md`, "Thread scaling"),
//! on io_uring and on epoll: two threads, many connections with requests in flight and a
//! request half sent, then thread 1 parked through the scaling control (an operator's call,
//! not the load, so the test does not depend on timing). Every answer is checked for identity
//! (each request answered once) and content (the bytes each block holds); after the park
//! every connection lives on thread 0, each tenant (registered and bound over the wire) counts
//! its connection once and on thread 0, new connections land there, and after the wake thread
//! 1 takes new connections again. A third test lets the policy park an idle thread.

mod checked;
mod common;

use std::time::{Duration, Instant};

use checked::{BLOCK, Connection, Expect, NAMESPACE, block_bytes};
use common::{config, namespace, start};
use reflex_client::{NO_TENANT_HANDLE, RegisterBody, TenantClassRequest};
use reflex_server::DriverChoice;

/// Blocks each connection owns (writes and reads back).
const OWNED_BLOCKS: u64 = 4;

/// One connection's blocks and their versions, and the tenant it registered and bound to.
struct Client {
    connection: Connection,
    tenant: u64,
    first_block: u64,
    versions: Vec<u32>,
    next_id: u64,
}

impl Client {
    /// Connects, registers a best-effort tenant and binds the connection to it.
    fn new(addr: std::net::SocketAddr, index: u64) -> Client {
        let mut connection = Connection::connect(addr);
        let register = RegisterBody {
            namespace_id: NAMESPACE,
            class: TenantClassRequest::BestEffort,
            read_only: false,
            handle: NO_TENANT_HANDLE,
        };
        let id = index << 32;
        connection
            .core
            .submit_register(id, &register)
            .unwrap_or_else(|e| panic!("{e}"));
        connection.outstanding.insert(id, Expect::Control);
        connection.transmit();
        connection.drain();
        let Some(tenant) = connection.handle else {
            panic!("REGISTER refused");
        };
        connection
            .core
            .submit_bind(id + 1, tenant)
            .unwrap_or_else(|e| panic!("{e}"));
        connection.outstanding.insert(id + 1, Expect::Control);
        connection.transmit();
        connection.drain();
        Client {
            connection,
            tenant,
            first_block: index * OWNED_BLOCKS,
            versions: vec![0; OWNED_BLOCKS as usize],
            next_id: id + 2,
        }
    }

    /// Queues a rewrite of every block and, behind it on the same connection, reads of
    /// each: the reads must see the new bytes (order within a connection).
    fn queue_round(&mut self) {
        for slot in 0..OWNED_BLOCKS {
            let block = self.first_block + slot;
            self.versions[slot as usize] += 1;
            let version = self.versions[slot as usize];
            self.connection.write(self.next_id, block, version);
            self.next_id += 1;
            self.connection.read(
                self.next_id,
                block * BLOCK as u64,
                block_bytes(block, version),
            );
            self.next_id += 1;
        }
    }

    fn round(&mut self) {
        self.queue_round();
        self.connection.transmit();
        self.connection.drain();
    }
}

/// Waits (bounded) until `condition` holds; the test asserts the condition, not the time.
fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Memory with a profile (one that never holds a request back), so that tenants register.
fn profiled_memory() -> reflex_server::NamespaceConfig {
    let mut memory = namespace(NAMESPACE, "mem:16M", None);
    memory.profile = Some(format!(
        "{}/../../profiles/mem-unlimited.toml",
        env!("CARGO_MANIFEST_DIR")
    ));
    memory
}

fn park_and_wake(driver: DriverChoice) {
    let mut server_config = config(vec![profiled_memory()]);
    server_config.driver = driver;
    // Thread 0 takes thread 1's connections on top of its own: room in its table (and in
    // the native listener's share of it) for all of them.
    server_config.connections_per_thread_max = 256;
    let server = start(server_config);
    let addr = server.native_addr();
    let Some(scaling) = server.scaling() else {
        panic!("two threads and no thread scaling");
    };
    assert_eq!(scaling.active(), 2);

    // Enough connections that both threads get some (the chance that all 16 land on one is
    // 2^-15).
    let mut clients: Vec<Client> = (0..16).map(|index| Client::new(addr, index)).collect();
    for client in &mut clients {
        client.round();
    }
    wait_for("both threads to hold connections", || {
        scaling
            .connections_per_thread()
            .iter()
            .all(|&count| count > 0)
    });
    let on_thread_1 = scaling.connections_per_thread()[1];
    // Each tenant counts its one connection once, on the thread that serves it.
    let tenant_threads = |clients: &[Client]| -> Vec<Vec<u32>> {
        clients
            .iter()
            .map(|client| match server.tenant(client.tenant) {
                Some(info) => info.connections_per_thread,
                None => panic!("tenant {} gone", client.tenant),
            })
            .collect()
    };
    let before = tenant_threads(&clients);
    assert!(
        before.iter().all(|counts| counts.iter().sum::<u32>() == 1),
        "{before:?}"
    );
    assert_eq!(
        before.iter().filter(|counts| counts[1] == 1).count() as u32,
        on_thread_1,
        "{before:?}"
    );

    // Requests in flight on every connection, the last one cut in the middle.
    for client in &mut clients {
        client.queue_round();
        client.connection.transmit_holding(10);
    }
    assert_eq!(scaling.force(1), 1);
    assert_eq!(scaling.active_per_thread(), vec![true, false]);
    for client in &mut clients {
        client.connection.transmit();
        client.connection.drain();
    }
    // Every connection of thread 1 moves once it is between requests.
    wait_for("thread 1 to hand off its connections", || {
        scaling.connections_per_thread()[1] == 0
    });
    assert_eq!(scaling.connections_moved(), u64::from(on_thread_1));
    // The tenants followed their connections: each counted once, on thread 0.
    let after = tenant_threads(&clients);
    assert!(after.iter().all(|counts| counts == &[1, 0]), "{after:?}");
    // They carry on on thread 0, in order, charged to their tenants.
    for _ in 0..3 {
        for client in &mut clients {
            client.round();
        }
    }
    // New connections land on thread 0 only.
    let mut late: Vec<Client> = (16..24).map(|index| Client::new(addr, index)).collect();
    for client in &mut late {
        client.round();
    }
    assert_eq!(scaling.connections_per_thread()[1], 0);
    let moved = scaling.connections_moved();
    if std::env::var_os("REFLEX_TEST_RUNNER").is_some_and(|runner| !runner.is_empty()) {
        // Under qemu-user the steering program (SO_ATTACH_REUSEPORT_CBPF) is not attached:
        // a late connection may reach thread 1's listener, and is handed over like the others.
        assert!(moved >= u64::from(on_thread_1), "{moved}");
    } else {
        assert_eq!(moved, u64::from(on_thread_1));
    }

    // Woken, thread 1 takes new connections again.
    assert_eq!(scaling.force(2), 2);
    let mut woken: Vec<Client> = (24..40).map(|index| Client::new(addr, index)).collect();
    for client in &mut woken {
        client.round();
    }
    wait_for("thread 1 to take new connections", || {
        scaling.connections_per_thread()[1] > 0
    });
    for client in clients.iter_mut().chain(&mut late).chain(&mut woken) {
        client.round();
        assert!(client.connection.outstanding.is_empty());
    }
    assert_eq!((scaling.parks(), scaling.wakes()), (1, 1));
    let events = scaling.events();
    assert_eq!(events.len(), 2);
    assert_eq!(
        (events[0].kind, events[0].thread, events[0].to),
        ("park", 1, Some(0))
    );
    assert_eq!((events[1].kind, events[1].thread), ("wake", 1));
    let handed_over = scaling.connections_moved();
    drop(clients);
    drop(late);
    drop(woken);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let moved: Vec<(u64, u64)> = stats
        .iter()
        .map(|s| (s.connections_moved_out, s.connections_moved_in))
        .collect();
    eprintln!("{driver:?}: per thread (moved out, moved in): {moved:?}");
    assert_eq!(moved[1].0, handed_over, "{moved:?}");
    assert_eq!(moved[0].1, handed_over, "{moved:?}");
    assert_eq!((moved[0].0, moved[1].1), (0, 0), "{moved:?}");
}

#[test]
fn a_parked_thread_hands_its_connections_over_on_io_uring() {
    park_and_wake(common::io_uring_driver());
}

#[test]
fn a_parked_thread_hands_its_connections_over_on_epoll() {
    park_and_wake(DriverChoice::Epoll);
}

/// The policy itself, with thresholds that make an idle server park at once (any busy share
/// is below `park_below = 0.99`, one window suffices, no dwell): thread 1 parks by the load,
/// and connections opened before the park keep being served, after it on thread 0.
#[test]
fn the_load_parks_an_idle_thread_when_scaling_is_enabled() {
    let mut server_config = config(vec![profiled_memory()]);
    server_config.connections_per_thread_max = 256;
    server_config.scaling = reflex_qos::ScalingConfig {
        enabled: true,
        window_ms: 20,
        park_below: 0.99,
        park_windows: 1,
        wake_above: 1.0,
        dwell_ms: 0,
        active_min: 1,
        active_max: 0,
    };
    let server = start(server_config);
    let Some(scaling) = server.scaling() else {
        panic!("two threads and no thread scaling");
    };
    let mut clients: Vec<Client> = Vec::new();
    let mut round = 0;
    // Connect and serve while the policy decides, until it has parked thread 1.
    while scaling.active() == 2 {
        assert!(round < 10_000, "thread 1 never parked");
        clients.push(Client::new(server.native_addr(), round));
        for client in &mut clients {
            client.round();
        }
        std::thread::sleep(Duration::from_millis(5));
        round += 1;
    }
    wait_for("thread 1 to hand off its connections", || {
        scaling.connections_per_thread()[1] == 0
    });
    for client in &mut clients {
        client.round();
    }
    let events = scaling.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].kind, events[0].thread, events[0].cause),
        ("park", 1, "load")
    );
    assert!(events[0].mean_busy_share.is_some_and(|share| share < 0.99));
    assert_eq!(scaling.active_per_thread(), vec![true, false]);
}
