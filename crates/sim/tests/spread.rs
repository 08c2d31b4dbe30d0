//! `[scaling] spread_tenants` in virtual time: connections of one tenant that BIND at the
//! same instant, most of them accepted on one thread, end spread evenly over the threads
//! (the decisions count the connections still on their way where they go), and each
//! connection's requests are answered after its move. Without spreading they stay where they
//! were accepted.

mod common;

use std::sync::Arc;

use common::NAMESPACE;
use reflex_client::{ConnectionCore, CoreOptions};
use reflex_dataplane::Limits;
use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
use reflex_flash::Device;
use reflex_qos::{DeviceProfile, Nanos, QosConfig, TenantSpec};
use reflex_sim::{NetworkModel, SocketId, VirtualListener, VirtualServer, VirtualServerSetup};

/// Two threads over memory with a profile that holds nothing back (tenants need one).
fn server() -> VirtualServer {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../profiles/mem-unlimited.toml"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let profile = DeviceProfile::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let memory: Arc<dyn Device> =
        Arc::new(reflex_flash::mem::MemDevice::new(16 << 20).unwrap_or_else(|e| panic!("{e}")));
    VirtualServer::new(VirtualServerSetup {
        threads: 2,
        namespaces: vec![(NAMESPACE, memory, false)],
        composites: Vec::new(),
        control: ControlSetup {
            threads: 2,
            handles: HandleKeys::Seeded(3),
            tenant_limits: TenantLimits::default(),
            qos_config: QosConfig::default(),
            qos_enabled: true,
            namespaces: vec![NamespaceControl {
                namespace_id: NAMESPACE,
                profile: Some(profile),
                tenants: Vec::new(),
            }],
        },
        qos_config: QosConfig::default(),
        limits: Limits::with_arena(64 << 20, 25),
        network: NetworkModel::default(),
        listeners: vec![VirtualListener::Native],
        nbd_exports: Vec::new(),
        nbd_default_export: None,
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

struct Client {
    socket: SocketId,
    core: ConnectionCore,
    received: Vec<u8>,
    answered: Vec<u64>,
}

impl Client {
    fn take_answers(&mut self, server: &mut VirtualServer) {
        let answered = &mut self.answered;
        common::take_completions(
            server,
            self.socket,
            &mut self.core,
            &mut self.received,
            |completion| {
                assert!(completion.is_ok(), "{completion:?}");
                answered.push(completion.request_id);
            },
        );
    }
}

/// Runs the server until nothing is left to do (bounded), the clients taking their answers.
fn settle(server: &mut VirtualServer, clients: &mut [Client]) {
    for _ in 0..10_000 {
        let Some(next) = server.next_event() else {
            break;
        };
        server.run_instant(next);
        for client in clients.iter_mut() {
            client.take_answers(server);
        }
    }
    for client in clients.iter_mut() {
        client.take_answers(server);
    }
}

/// Eight connections of one tenant, six accepted on thread 0 and two on thread 1, BIND at
/// one instant and then read a block each; returns the tenant's connections per thread.
fn bind_at_once(spread: bool) -> Vec<u32> {
    let mut server = server();
    server.set_spread_tenants(spread);
    let handle = server
        .control()
        .admin_register(NAMESPACE, "flow", TenantSpec::BestEffort, false)
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant
        .handle;
    let mut clients: Vec<Client> = [0, 0, 0, 1, 0, 0, 1, 0]
        .into_iter()
        .map(|thread| Client {
            socket: server
                .connect(thread, 0, None)
                .unwrap_or_else(|e| panic!("connect: {e}")),
            core: ConnectionCore::new(CoreOptions {
                window_assumed: 128,
            }),
            received: Vec::new(),
            answered: Vec::new(),
        })
        .collect();
    for client in &mut clients {
        client
            .core
            .submit_bind(1, handle)
            .unwrap_or_else(|e| panic!("{e}"));
        // The read is parsed on the thread the connection ends on.
        client
            .core
            .submit_read(2, NAMESPACE, 0, 4096)
            .unwrap_or_else(|e| panic!("{e}"));
        common::transmit_all(&mut server, client.socket, &mut client.core);
    }
    let now = server.now();
    server.run_instant(Nanos(now.0 + 1));
    settle(&mut server, &mut clients);
    for client in &clients {
        assert_eq!(
            client.answered,
            vec![1, 2],
            "each request answered once, in order"
        );
    }
    let per_thread = server
        .control()
        .tenant(handle)
        .unwrap_or_else(|| panic!("tenant gone"))
        .connections_per_thread;
    let sockets: Vec<u16> = clients
        .iter()
        .map(|client| server.socket_thread(client.socket))
        .collect();
    assert_eq!(
        (0..2u16)
            .map(|thread| sockets.iter().filter(|&&t| t == thread).count() as u32)
            .collect::<Vec<_>>(),
        per_thread,
        "the tenant counts its connections where they are served"
    );
    per_thread
}

#[test]
fn connections_binding_at_once_end_spread_evenly() {
    assert_eq!(bind_at_once(true), vec![4, 4]);
}

#[test]
fn without_spreading_connections_stay_where_they_were_accepted() {
    assert_eq!(bind_at_once(false), vec![6, 2]);
}
