//! A namespace striped over two devices (issue 11), through the real dataplane in virtual
//! time: each piece of a request is charged to, scheduled on and served by the member device
//! it lands on, so a flood on one member's own namespace slows only the pieces that land on
//! that member, and each device's tokens are charged to the tenant's member tenant there.

mod common;

use std::sync::Arc;

use reflex_client::ConnectionCore;
use reflex_dataplane::Limits;
use reflex_dataplane::composite::CompositeSpec;
use reflex_dataplane::control::{
    ControlSetup, HandleKeys, NamespaceControl, TenantLimits, TenantRef,
};
use reflex_flash::Device;
use reflex_qos::{CostModel, DeviceProfile, IoKind, LoadMode, Nanos, QosConfig, TenantSpec};
use reflex_sim::{
    EmuSimDevice, ModelFlash, NetworkModel, SocketId, VirtualListener, VirtualServer,
    VirtualServerSetup,
};

const STRIPE_BYTES: u64 = 64 << 10;
const COMPOSITE: u32 = 3;
/// The striped tenant's reservation: half of it on each member.
const STRIPED_IOPS: u64 = 6_000;
const MS: u64 = 1_000_000;
/// The BIND's request id (the reads count from 0).
const BIND_ID: u64 = 1 << 40;
/// The REPORTs' request ids (one every [`REPORT_EVERY`] reads) start here.
const REPORT_ID: u64 = 1 << 41;
/// Reads between two REPORTs of the striped tenant's client (25 ms at 4,000 a second).
const REPORT_EVERY: u64 = 100;
/// Reads the striped tenant sends, one every 250 µs (4,000 a second).
const READS: u64 = 1_600;

fn profile() -> DeviceProfile {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../profiles/device-a-small.toml"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    DeviceProfile::from_toml(&text).unwrap_or_else(|e| panic!("{e}"))
}

fn emulated(seed: u64) -> Arc<dyn Device> {
    let profile =
        reflex_flash::emu::EmuProfile::lookup("device-a-small").unwrap_or_else(|e| panic!("{e}"));
    let device = reflex_flash::emu::EmuDevice::new(profile, 16 << 30, seed)
        .unwrap_or_else(|e| panic!("{e}"));
    Arc::new(ModelFlash::new(
        Box::new(EmuSimDevice::new(device)),
        "emulated device-a-small",
    ))
}

/// Namespaces 1 and 2 on their own emulated devices (each with its profile), namespace 3
/// striped over them with LC tenant S configured on it.
fn server() -> VirtualServer {
    let striped = TenantSpec::LatencyCritical {
        latency_us_p95: 500,
        iops: STRIPED_IOPS,
        read_percent: 100,
    };
    server_on("stripe:64K:1,2", vec![("S".into(), striped)]).unwrap_or_else(|e| panic!("{e}"))
}

/// Namespace 3 laid over namespaces 1 and 2 as `spec` says, with `tenants` configured on it.
fn server_on(
    spec: &str,
    tenants: Vec<(String, TenantSpec)>,
) -> Result<VirtualServer, reflex_sim::VirtualServerError> {
    // Self-calibration on (it is off by default): the tests check that a composite's reads
    // reach each member device's calibrator.
    let mut qos_config = QosConfig::default();
    qos_config.calibration.enabled = true;
    let member = |id| NamespaceControl {
        namespace_id: id,
        profile: Some(profile()),
        tenants: Vec::new(),
    };
    VirtualServer::new(VirtualServerSetup {
        threads: 1,
        namespaces: vec![(1, emulated(1), false), (2, emulated(2), false)],
        composites: vec![(
            COMPOSITE,
            CompositeSpec::parse(spec).unwrap_or_else(|e| panic!("{e}")),
        )],
        control: ControlSetup {
            threads: 1,
            handles: HandleKeys::Seeded(7),
            tenant_limits: TenantLimits::default(),
            qos_config: qos_config.clone(),
            qos_enabled: true,
            namespaces: vec![
                member(1),
                member(2),
                NamespaceControl {
                    namespace_id: COMPOSITE,
                    profile: None,
                    tenants,
                },
            ],
        },
        qos_config,
        limits: Limits::with_arena(64 << 20, 25),
        network: NetworkModel::default(),
        listeners: vec![VirtualListener::Native],
        nbd_exports: Vec::new(),
        nbd_default_export: None,
    })
}

struct Client {
    socket: SocketId,
    core: ConnectionCore,
    received: Vec<u8>,
    /// The handles the RENEGOTIATE notices it received name.
    notices: Vec<u64>,
}

impl Client {
    fn connect(server: &mut VirtualServer) -> Client {
        let (socket, core) = common::connect_native(server, 0);
        Client {
            socket,
            core,
            received: Vec::new(),
            notices: Vec::new(),
        }
    }

    fn transmit(&mut self, server: &mut VirtualServer) {
        common::transmit_all(server, self.socket, &mut self.core);
    }

    /// The ids of the answers that arrived (each must be OK).
    fn answers(&mut self, server: &mut VirtualServer) -> Vec<u64> {
        let mut done = Vec::new();
        let notices = &mut self.notices;
        common::take_completions(
            server,
            self.socket,
            &mut self.core,
            &mut self.received,
            |completion| {
                if let Some(notice) = completion.notice() {
                    notices.push(notice.handle);
                    return;
                }
                assert!(
                    completion.is_ok(),
                    "request {} failed: {:?}",
                    completion.request_id,
                    completion
                );
                done.push(completion.request_id);
            },
        );
        done
    }
}

/// What one run measured of the striped tenant's reads, by where they landed.
#[derive(Debug, Default)]
struct Run {
    /// Mean latency (µs) of the 4 KiB reads on member 1, on member 2.
    mean_us: [f64; 2],
    /// Pieces sent to each member (a read across a stripe boundary counts on both).
    pieces: [u64; 2],
    /// Requests and millitokens charged to S's member tenant on each member, the requests
    /// charged to each member's default tenant, and S's arrivals on the composite.
    member_requests: [u64; 2],
    member_millitokens: [i64; 2],
    default_requests: [u64; 2],
    composite_arrivals: u64,
    answered: usize,
    /// RENEGOTIATE notices the striped tenant's connection received, with S's handle.
    notices: usize,
    notices_for_others: usize,
    /// Each member device's self-calibration windows with enough LC reads to judge (S's
    /// reads are measured on the member they land on).
    evidence_windows: [u64; 2],
    /// Each member device's share of the SLO left to the network and the client in its last
    /// window (µs; configured plus learned).
    client_share_us: [Option<u64>; 2],
}

/// The striped tenant S sends [`READS`] 4 KiB reads at 4,000 a second, stripe `k` for read
/// `k` (so alternating members; read `k ≡ 9 mod 10` is 8 KiB across the boundary into
/// stripe `k + 1`); with `flood`, an unbound connection keeps
/// 64 reads in flight on namespace 1, member 1's own namespace.
fn run(flood: bool) -> Run {
    run_on(server(), flood, None)
}

/// As [`run`] on `server`; with `report_p95_us`, the striped tenant's client REPORTs that p95
/// over the last [`REPORT_EVERY`] reads after each of them.
fn run_on(mut server: VirtualServer, flood: bool, report_p95_us: Option<u32>) -> Run {
    let striped = server.qos()[2]
        .tenants
        .iter()
        .find(|(name, _)| name == "S")
        .map(|(_, tenant)| *tenant)
        .unwrap_or_else(|| panic!("S not admitted"));
    let members: Vec<TenantRef> = server.control().member_tenants(striped.handle);
    assert_eq!(members.len(), 2);
    let defaults = [
        server.qos()[0].default_tenant,
        server.qos()[1].default_tenant,
    ];

    let mut client = Client::connect(&mut server);
    client
        .core
        .submit_bind(BIND_ID, striped.handle)
        .unwrap_or_else(|e| panic!("{e}"));
    client.transmit(&mut server);
    let mut flooder = Client::connect(&mut server);
    let mut flood_next = 0u64;
    let flood_fill = |flooder: &mut Client, server: &mut VirtualServer, next: &mut u64| {
        while flooder.core.outstanding_count() < 64 {
            let offset = (*next * 7919 % 100_000) * 4096;
            flooder
                .core
                .submit_read(*next, 1, offset, 4096)
                .unwrap_or_else(|e| panic!("{e}"));
            *next += 1;
        }
        flooder.transmit(server);
    };
    if flood {
        flood_fill(&mut flooder, &mut server, &mut flood_next);
    }

    let interval = Nanos(250_000);
    let first = Nanos(10 * MS);
    // Sending ends with the last read (later than planned when a full window held it back);
    // then the answers have 2 s to arrive.
    let mut drain_until = Nanos::ZERO;
    let mut sent_at = Vec::new();
    let mut member_of = Vec::new();
    let mut latency_sum_us = [0f64; 2];
    let mut latency_count = [0u64; 2];
    let mut result = Run::default();
    let mut next_send = first;
    let mut id = 0u64;
    loop {
        let next_event = server.next_event();
        let now = match next_event {
            Some(event) if id < READS && event < next_send => event,
            _ if id < READS => next_send,
            Some(event) if event <= drain_until => event,
            _ => break,
        };
        server.run_instant(now);
        if now == next_send && id < READS && client.core.outstanding_count() >= 128 {
            next_send += interval; // The window is full (a throttled tenant): later.
        } else if now == next_send && id < READS {
            let stripe = id; // stripe k lands on member k % 2
            let (offset, length, member) = if id % 10 == 9 {
                // Across the boundary from stripe k into stripe k + 1.
                let offset = (stripe + 1) * STRIPE_BYTES - 4096;
                result.pieces[(stripe % 2) as usize] += 1;
                result.pieces[((stripe + 1) % 2) as usize] += 1;
                (offset, 8192, None)
            } else {
                result.pieces[(stripe % 2) as usize] += 1;
                (
                    stripe * STRIPE_BYTES + 4096,
                    4096,
                    Some((stripe % 2) as usize),
                )
            };
            client
                .core
                .submit_read(id, COMPOSITE, offset, length)
                .unwrap_or_else(|e| panic!("{e}"));
            if let Some(read_p95_us) = report_p95_us
                && id % REPORT_EVERY == REPORT_EVERY - 1
            {
                let report = reflex_proto::native::ReportBody {
                    reads: REPORT_EVERY as u32,
                    read_p95_us,
                    backlog: 0,
                };
                client
                    .core
                    .submit_report(REPORT_ID + id, &report)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            client.transmit(&mut server);
            sent_at.push(now);
            member_of.push(member);
            id += 1;
            next_send += interval;
            drain_until = now + Nanos(2_000 * MS);
        }
        for done in client.answers(&mut server) {
            if done == BIND_ID || done >= REPORT_ID {
                continue; // the BIND or a REPORT
            }
            result.answered += 1;
            if let Some(member) = member_of[done as usize] {
                latency_sum_us[member] +=
                    now.saturating_since(sent_at[done as usize]).0 as f64 / 1e3;
                latency_count[member] += 1;
            }
        }
        if flood {
            let _ = flooder.answers(&mut server);
            if id < READS {
                flood_fill(&mut flooder, &mut server, &mut flood_next);
            }
        }
    }
    assert_eq!(result.answered, id as usize, "every striped read answered");
    result.notices = client
        .notices
        .iter()
        .filter(|&&handle| handle == striped.handle)
        .count();
    result.notices_for_others = client.notices.len() - result.notices;
    for member in 0..2 {
        result.mean_us[member] = latency_sum_us[member] / latency_count[member] as f64;
    }
    for (namespace_id, info) in server.control().calibration() {
        if (1..=2).contains(&namespace_id) {
            result.evidence_windows[namespace_id as usize - 1] = info.stats.windows_with_evidence;
            result.client_share_us[namespace_id as usize - 1] =
                info.last.map(|last| last.client_share_us);
        }
    }
    let stats = server.stats();
    for tenant in &stats[0].tenants {
        for member in 0..2 {
            if tenant.handle == members[member].handle {
                result.member_requests[member] += tenant.requests;
                result.member_millitokens[member] += tenant.millitokens;
            }
            if tenant.handle == defaults[member].handle {
                result.default_requests[member] += tenant.requests;
            }
        }
        if tenant.handle == striped.handle {
            result.composite_arrivals += tenant.arrivals;
            assert_eq!(
                tenant.requests, 0,
                "nothing is scheduled on the composite itself"
            );
        }
    }
    result
}

#[test]
fn a_flood_on_one_member_slows_only_the_pieces_that_land_there() {
    let quiet = run(false);
    let flooded = run(true);
    println!("quiet   {quiet:?}\nflooded {flooded:?}");
    // Member 2 never sees the flood: its reads take what they took without it.
    assert!(
        (flooded.mean_us[1] - quiet.mean_us[1]).abs() <= 0.05 * quiet.mean_us[1],
        "member 2: {:.1} µs with the flood on member 1, {:.1} µs without",
        flooded.mean_us[1],
        quiet.mean_us[1]
    );
    // Member 1 is shared with the flood: its reads wait longer there.
    assert!(
        flooded.mean_us[0] > 1.5 * quiet.mean_us[0],
        "member 1: {:.1} µs with the flood, {:.1} µs without",
        flooded.mean_us[0],
        quiet.mean_us[0]
    );
    assert!(flooded.mean_us[0] > 1.5 * flooded.mean_us[1]);
    // Reads across the boundary were answered as one (counted in `answered`, checked in
    // `run`), and the flood was served too.
    assert!(flooded.default_requests[0] > 1_000);
}

#[test]
fn each_piece_is_charged_to_the_member_device_it_lands_on() {
    for flood in [false, true] {
        let run = run(flood);
        // 1,600 reads: 160 cross a boundary (a piece on each member); of the others, the
        // 800 even ones land on member 1 and the 640 odd ones on member 2.
        assert_eq!(run.answered, 1_600);
        assert_eq!(run.pieces, [960, 800]);
        assert_eq!(run.composite_arrivals, 1_600);
        // Every piece was admitted by its member's scheduler for S's member tenant there.
        assert_eq!(run.member_requests, run.pieces, "flood {flood}");
        // Each piece is a 4 KiB read, charged at its device's read-only read cost (no
        // writes anywhere: 473 millitokens on this profile).
        let cost = CostModel::from_profile(&profile())
            .cost(IoKind::Read, 4096, LoadMode::ReadOnly)
            .0;
        assert_eq!(cost, 473);
        for member in 0..2 {
            assert_eq!(
                run.member_millitokens[member],
                cost * run.pieces[member] as i64,
                "member {member}, flood {flood}"
            );
        }
        // S's reads feed each member device's self-calibration (2,000 LC reads a second on
        // each: 200 a window, above the 100 a window needs).
        assert!(
            run.evidence_windows.iter().all(|&windows| windows >= 2),
            "{:?}",
            run.evidence_windows
        );
        // The flood is charged to namespace 1's default tenant only.
        assert_eq!(run.default_requests[1], 0);
        if flood {
            assert!(
                run.default_requests[0] > 1_000,
                "{}",
                run.default_requests[0]
            );
        } else {
            assert_eq!(run.default_requests[0], 0);
        }
    }
}

#[test]
fn the_striped_reservation_is_spread_evenly_over_the_members() {
    let server = server();
    let striped = server.qos()[2].tenants[0].1;
    let members = server.control().member_tenants(striped.handle);
    assert_eq!(members.len(), 2);
    for member in &members {
        let info = server
            .control()
            .tenant(member.handle)
            .unwrap_or_else(|| panic!("member tenant {member:?}"));
        assert_eq!(info.name, "S/ns3");
        assert_eq!(
            info.spec,
            TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: STRIPED_IOPS / 2,
                read_percent: 100
            }
        );
    }
    let namespaces: Vec<u32> = members
        .iter()
        .map(|member| {
            server
                .control()
                .tenant(member.handle)
                .map_or(0, |info| info.namespace_id)
        })
        .collect();
    assert_eq!(namespaces, vec![1, 2]);
}

/// An LC reservation of `iops` 4 KiB reads at 500 µs.
fn reads(iops: u64) -> TenantSpec {
    TenantSpec::LatencyCritical {
        latency_us_p95: 500,
        iops,
        read_percent: 100,
    }
}

/// The spec and namespace of each member tenant of the composite's tenant `name`.
fn member_specs(server: &VirtualServer, name: &str) -> Vec<(u32, TenantSpec)> {
    let control = server.control();
    let tenant = control
        .tenants()
        .into_iter()
        .find(|tenant| tenant.namespace_id == COMPOSITE && tenant.name == name)
        .unwrap_or_else(|| panic!("no tenant {name} on the composite"));
    control
        .member_tenants(tenant.handle)
        .iter()
        .map(|member| {
            let info = control
                .tenant(member.handle)
                .unwrap_or_else(|| panic!("member {member:?}"));
            (info.namespace_id, info.spec)
        })
        .collect()
}

#[test]
fn a_concatenation_asks_every_member_for_the_whole_reservation() {
    // Half the small device's read-only rate fits each member whole.
    let server = server_on("concat:1,2", vec![("C".into(), reads(20_000))])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        member_specs(&server, "C"),
        vec![(1, reads(20_000)), (2, reads(20_000))]
    );
    // A reservation one member cannot hold is refused, naming the member; a striped one of
    // the same size fits, half on each.
    let refused = match server_on("concat:1,2", vec![("C".into(), reads(60_000))]) {
        Ok(_) => panic!("a concatenation admitted 60K IOPS on each small device"),
        Err(error) => error.to_string(),
    };
    assert!(
        refused.contains("tenant \"C\" refused at startup: member namespace 1: needs"),
        "{refused}"
    );
    let server = server_on("stripe:64K:1,2", vec![("C".into(), reads(60_000))])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        member_specs(&server, "C"),
        vec![(1, reads(30_000)), (2, reads(30_000))]
    );
}

#[test]
fn composite_tenants_added_changed_and_removed_at_run_time_follow_on_every_member() {
    let server = server_on("stripe:64K:1,2", Vec::new()).unwrap_or_else(|e| panic!("{e}"));
    let control = server.control();
    control
        .admin_register(COMPOSITE, "R", reads(10_000), false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        member_specs(&server, "R"),
        vec![(1, reads(5_000)), (2, reads(5_000))]
    );
    // More than the members hold: refused whole, the members keep the old SLO.
    let refused = control
        .admin_update(COMPOSITE, "R", reads(200_000))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(refused.contains("member namespace 1: needs"), "{refused}");
    assert_eq!(
        member_specs(&server, "R"),
        vec![(1, reads(5_000)), (2, reads(5_000))]
    );
    control
        .admin_update(COMPOSITE, "R", reads(16_000))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        member_specs(&server, "R"),
        vec![(1, reads(8_000)), (2, reads(8_000))]
    );
    let members_before = control.tenants().len();
    control
        .admin_remove(COMPOSITE, "R")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        control.tenants().len(),
        members_before - 3,
        "R and its two member tenants"
    );
    assert!(
        control
            .tenants()
            .iter()
            .all(|tenant| tenant.name != "R/ns3"),
        "no member tenant left behind"
    );
}

#[test]
fn a_member_devices_deficit_notice_reaches_the_composite_tenants_connection() {
    // S reserves 400 IOPS (200 on each member) and sends ten times that while the flood
    // takes member 1's spare tokens: member 1's scheduler runs S's member tenant into its
    // deficit limit, and the notice names S, the handle S's client knows.
    let server = server_on("stripe:64K:1,2", vec![("S".into(), reads(400))])
        .unwrap_or_else(|e| panic!("{e}"));
    let run = run_on(server, true, None);
    println!("{run:?}");
    assert!(run.notices >= 1, "no notice reached S: {run:?}");
    assert_eq!(run.notices_for_others, 0, "a notice named a member tenant");
}

#[test]
fn a_tenant_registered_over_the_wire_on_the_composite_lives_on_every_member() {
    use reflex_proto::native::{RegisterBody, TenantClassRequest, decode_handle};
    let mut server = server_on("stripe:64K:1,2", Vec::new()).unwrap_or_else(|e| panic!("{e}"));
    let mut client = Client::connect(&mut server);
    let call = |client: &mut Client, server: &mut VirtualServer, id: u64| -> Vec<u8> {
        client.transmit(server);
        let until = server.now() + Nanos(10 * MS);
        while let Some(next) = server.next_event().filter(|&next| next <= until) {
            server.run_instant(next);
        }
        server.run_instant(until);
        client.received.clear();
        server.client_read(client.socket, &mut client.received);
        let taken = client.core.handle_received_bytes(&client.received);
        assert_eq!(taken, client.received.len());
        let completion = client
            .core
            .poll_completion()
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("no answer"));
        assert_eq!(completion.request_id, id);
        assert!(completion.is_ok(), "{completion:?}");
        completion.data.to_vec()
    };
    let register = |iops| RegisterBody {
        namespace_id: COMPOSITE,
        class: TenantClassRequest::LatencyCritical {
            latency_us_p95: 500,
            iops,
            read_percent: 100,
        },
        read_only: false,
        handle: 0,
    };
    client
        .core
        .submit_register(1, &register(9_000))
        .unwrap_or_else(|e| panic!("{e}"));
    let handle =
        decode_handle(&call(&mut client, &mut server, 1)).unwrap_or_else(|e| panic!("{e}"));
    let members = server.control().member_tenants(handle);
    let specs: Vec<(u32, TenantSpec)> = members
        .iter()
        .map(|member| {
            let info = server
                .control()
                .tenant(member.handle)
                .unwrap_or_else(|| panic!("{member:?}"));
            (info.namespace_id, info.spec)
        })
        .collect();
    assert_eq!(specs, vec![(1, reads(4_500)), (2, reads(4_500))]);
    // A new SLO over the wire follows on the members.
    client
        .core
        .submit_register(
            2,
            &RegisterBody {
                handle,
                ..register(3_000)
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    call(&mut client, &mut server, 2);
    for member in &members {
        let info = server.control().tenant(member.handle);
        assert_eq!(info.map(|info| info.spec), Some(reads(1_500)));
    }
    client
        .core
        .submit_unregister(3, handle)
        .unwrap_or_else(|e| panic!("{e}"));
    call(&mut client, &mut server, 3);
    for member in members
        .iter()
        .chain(std::iter::once(&TenantRef { handle, id: 0 }))
    {
        assert!(
            server.control().tenant(member.handle).is_none(),
            "{member:?} left"
        );
    }
}

#[test]
fn the_composite_tenants_client_reports_reach_every_member_devices_calibrator() {
    // S's client reports a p95 of 900 µs against its 500 µs SLO: each member's calibrator
    // learns that much of the SLO is spent outside the server (capped at half the SLO,
    // `network_share_max`). Before, a REPORT on a composite namespace went to the composite's
    // own window, which calibrates nothing, and the members learnt only the round trips.
    let cap_us = 250;
    let quiet = run_on(server(), false, None);
    let reported = run_on(server(), false, Some(900));
    println!(
        "without: {:?}, with: {:?}",
        quiet.client_share_us, reported.client_share_us
    );
    for member in 0..2 {
        assert_eq!(
            reported.client_share_us[member],
            Some(cap_us),
            "{reported:?}"
        );
        let without = quiet.client_share_us[member].unwrap_or_else(|| panic!("{quiet:?}"));
        assert!(without < cap_us, "{quiet:?}");
    }
}
