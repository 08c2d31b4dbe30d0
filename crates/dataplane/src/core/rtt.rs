//! Sampling the network round trip of connections: the part of a response time the server
//! never measures itself.
//!
//! - Online self-calibration (issue 11) learns the network's share of what latency-critical
//!   tenants see from their connections' round trips ("the client-side share it learns, e.g.
//!   from the TCP round-trip time"), so no hand-set headroom is needed.
//! - The fairness monitor (issue 14) adds the round trip T_net to every flow's response time
//!   (OctoFAS: RT = T_net + server time), from best-effort connections' samples.
//!
//! Why here and how: the dataplane cannot read a socket's state (it is sans-IO), so when a
//! read's answer leaves and no sample of its class (LC, or the rest) was taken for
//! [`RTT_SAMPLE_INTERVAL`], it asks the driver for that connection's smoothed round-trip time
//! ([`Op::SampleRtt`]: `TCP_INFO`'s `tcpi_rtt` on Linux, the network model's in the
//! simulator). Samples follow traffic: an idle server never wakes for them. LC samples go into
//! the namespace's telemetry window only (best-effort connections may cross slower networks
//! and must not shrink LC tenants' device target).

use reflex_qos::Nanos;

use super::Dataplane;
use super::ops::{ConnectionId, Op};

/// At most one sample per class and thread in this interval: ten per thread in a default
/// calibration window (100 ms), enough for the window's p95 of a smoothed figure.
pub const RTT_SAMPLE_INTERVAL: Nanos = Nanos(10_000_000);

/// The one sample a thread may have outstanding, and when each class may be sampled next.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RttSampler {
    next_lc_at: Nanos,
    next_other_at: Nanos,
    /// The connection asked about, the namespace its read was on, and whether it was an LC
    /// tenant's.
    pending: Option<(ConnectionId, u16, bool)>,
}

impl Dataplane {
    /// A read on `namespace_index` was answered on connection `connection_index`: ask for a
    /// round-trip sample if one of its class is due.
    pub(super) fn note_read_answered(
        &mut self,
        connection_index: u32,
        namespace_index: u16,
        latency_critical: bool,
        now: Nanos,
    ) {
        let sampler = &mut self.rtt;
        let next_at = if latency_critical {
            &mut sampler.next_lc_at
        } else {
            &mut sampler.next_other_at
        };
        if sampler.pending.is_some() || now < *next_at {
            return;
        }
        let Some(connection) = self.connections.get(connection_index as usize) else {
            return;
        };
        if !connection.is_open() {
            return;
        }
        let connection = connection.id(connection_index);
        *next_at = now + RTT_SAMPLE_INTERVAL;
        sampler.pending = Some((connection, namespace_index, latency_critical));
        self.ops.push_back(Op::SampleRtt { connection });
    }

    /// The driver's answer to [`Op::SampleRtt`]: the connection's smoothed round-trip time in
    /// µs, or the errno of the failed query (the sample is then dropped). A report for another
    /// connection than the one asked about (a driver's bug) is ignored.
    pub fn handle_rtt(&mut self, connection: ConnectionId, rtt: Result<u32, i32>) {
        let Some((asked, namespace_index, latency_critical)) = self.rtt.pending else {
            return;
        };
        if asked != connection {
            return;
        }
        self.rtt.pending = None;
        let Ok(rtt_us) = rtt else {
            return;
        };
        let namespace_index = usize::from(namespace_index);
        if latency_critical {
            if let Some(telemetry) = self.telemetry.get_mut(namespace_index) {
                telemetry.window.network_rtt.record_us(u64::from(rtt_us));
            }
        } else if let Some(namespace) = self.qos.get_mut(namespace_index) {
            namespace
                .fair
                .set_network_rtt(Nanos(u64::from(rtt_us) * 1_000));
        }
    }
}
