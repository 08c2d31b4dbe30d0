//! Loading and running the shipped scenarios from the integration tests, and the virtual
//! server the dataplane tests start.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use reflex_dataplane::Limits;
use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
use reflex_flash::Device;
use reflex_qos::QosConfig;
use reflex_sim::{
    LoadedScenario, NetworkModel, PointReport, RunOptions, VirtualListener, VirtualServer,
    VirtualServerSetup, run_scenario, scenario,
};

/// The namespace id of [`one_namespace_server`].
pub const NAMESPACE: u32 = 1;

/// [`one_namespace_server_on`] with one thread.
pub fn one_namespace_server(
    device: Arc<dyn Device>,
    limits: Limits,
    network: NetworkModel,
    listeners: Vec<VirtualListener>,
) -> VirtualServer {
    one_namespace_server_on(1, device, limits, network, listeners)
}

/// A server with `threads` threads and one namespace ([`NAMESPACE`]) on `device`, without
/// QoS, listening for `listeners`.
pub fn one_namespace_server_on(
    threads: u16,
    device: Arc<dyn Device>,
    limits: Limits,
    network: NetworkModel,
    listeners: Vec<VirtualListener>,
) -> VirtualServer {
    VirtualServer::new(VirtualServerSetup {
        threads,
        namespaces: vec![(NAMESPACE, device, false)],
        composites: Vec::new(),
        control: ControlSetup {
            threads,
            handles: HandleKeys::Seeded(1),
            tenant_limits: TenantLimits::default(),
            qos_config: QosConfig::default(),
            qos_enabled: false,
            namespaces: vec![NamespaceControl {
                namespace_id: NAMESPACE,
                profile: None,
                tenants: Vec::new(),
            }],
        },
        qos_config: QosConfig::default(),
        limits,
        network,
        listeners,
        nbd_exports: Vec::new(),
        nbd_default_export: None,
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

pub fn scenario_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scenarios")
        .join(format!("{name}.toml"))
}

pub fn load(name: &str) -> LoadedScenario {
    let path = scenario_path(name);
    scenario::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one point of scenario `name` (not a sweep), run with `seed`.
pub fn run(name: &str, seed: u64) -> PointReport {
    let options = RunOptions {
        seed: Some(seed),
        ..RunOptions::default()
    };
    let report = run_scenario(&load(name), &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(report.points.len(), 1, "{name} is not a sweep");
    report.points[0].1.clone()
}

/// Feeds what reached `socket` to `core` and hands each completion it finishes to `each`, in
/// order: the receive loop of every virtual client in these tests.
pub fn take_completions(
    server: &mut VirtualServer,
    socket: reflex_sim::SocketId,
    core: &mut reflex_client::ConnectionCore,
    received: &mut Vec<u8>,
    mut each: impl FnMut(reflex_client::Completion<'_>),
) {
    received.clear();
    server.client_read(socket, received);
    let mut offered = &received[..];
    loop {
        let taken = core.handle_received_bytes(offered);
        offered = &offered[taken..];
        while let Some(completion) = core.poll_completion().unwrap_or_else(|e| panic!("{e}")) {
            each(completion);
        }
        if offered.is_empty() || taken == 0 {
            break;
        }
    }
}

/// Sends everything `core` has queued on `socket`: the send loop of a virtual client.
pub fn transmit_all(
    server: &mut VirtualServer,
    socket: reflex_sim::SocketId,
    core: &mut reflex_client::ConnectionCore,
) {
    while let Some(bytes) = core.transmit_start() {
        let length = bytes.len();
        server.client_send(socket, bytes);
        core.transmit_done(length);
    }
}

/// A native-protocol client connection to `thread`: its virtual socket and a fresh client
/// core (a 128-request window assumed until the server says).
pub fn connect_native(
    server: &mut VirtualServer,
    thread: u16,
) -> (reflex_sim::SocketId, reflex_client::ConnectionCore) {
    let socket = server
        .connect(thread, 0, None)
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let core = reflex_client::ConnectionCore::new(reflex_client::CoreOptions {
        window_assumed: 128,
    });
    (socket, core)
}

/// Runs virtual time until `until` (or until nothing more happens before it).
pub fn run_until(server: &mut VirtualServer, until: reflex_qos::Nanos) {
    server.run_instant(server.now());
    while let Some(next) = server.next_event() {
        if next > until {
            break;
        }
        server.run_instant(next);
    }
    if server.now() < until {
        server.run_instant(until);
    }
}
