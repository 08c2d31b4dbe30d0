//! NVMe/TCP's secure channel (TP 8011): which connections start TLS, and which Connects a
//! TLS identity (or its absence) allows.
//!
//! A host that wants TLS sends a TLS ClientHello right after the TCP connect, before its
//! ICReq; the first byte tells them apart (a TLS handshake record is 0x16, an ICReq's PDU
//! type 0x00). The session runs in the dataplane's TLS layer (`core/tls`) with the hosts' keys
//! by the host and subsystem the PSK identity names (`NVMe0R0x <host NQN> <subsystem NQN>`,
//! or TP 8018's `NVMe1R0x <host NQN> <subsystem NQN> <PSK digest>`), and the identity whose
//! key the host proved is handed to the frontend once the handshake is done.
//!
//! Why Connect checks the identity: the key proves which host and subsystem it was made for,
//! but the host NQN and subsystem NQN that select the controller, the tenant and the
//! namespaces come from Connect's data. A key for host A must not let a connection act as
//! host B, nor reach a subsystem other than the one in its identity. And a host with a key,
//! or a subsystem that requires a secure channel, is refused over plaintext: otherwise anyone
//! could claim that host NQN without the key.

use reflex_proto::nvme_tcp::tls_key::PskIdentity;

use super::nvme_tcp_targets::NvmeTcpTargets;

/// The content type of a TLS handshake record (RFC 8446 §5.1).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Whether an NVMe/TCP listener takes TLS (`[nvme_tcp] tls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NvmeTlsMode {
    /// Plaintext only (a ClientHello is a malformed PDU).
    #[default]
    Off,
    /// Each host chooses.
    Optional,
    /// TLS only (SPDK's `--secure-channel` listener): a plaintext ICReq closes the connection.
    Require,
}

/// What a connection's transport is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Channel {
    /// Nothing received yet.
    Undecided,
    Plain,
    /// TLS started; the identity is set once the handshake is done.
    Tls {
        identity: Option<String>,
    },
}

/// What the first byte of a connection asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FirstByte {
    NeedMore,
    Plain,
    StartTls,
    /// Refused by the listener's mode, with the reason.
    Refuse(&'static str),
}

/// Reads the first byte of a connection on a listener in `mode`.
pub(super) fn first_byte(input: &[u8], mode: NvmeTlsMode) -> FirstByte {
    let Some(&first) = input.first() else {
        return FirstByte::NeedMore;
    };
    let tls = first == TLS_HANDSHAKE_RECORD;
    match (mode, tls) {
        // Without TLS the PDU decoder answers a ClientHello as a malformed PDU, as before.
        (NvmeTlsMode::Off, _) | (NvmeTlsMode::Optional, false) => FirstByte::Plain,
        (NvmeTlsMode::Optional | NvmeTlsMode::Require, true) => FirstByte::StartTls,
        (NvmeTlsMode::Require, false) => FirstByte::Refuse(
            "NVMe/TCP: this listener requires TLS (TP 8011) and the host sent plaintext",
        ),
    }
}

/// Why a Connect is refused on this channel (`None`: allowed). `subsystem`: the index of the
/// subsystem Connect names (`None`: discovery).
pub(super) fn connect_refusal(
    channel: &Channel,
    targets: &NvmeTcpTargets,
    host_nqn: &str,
    subsystem_nqn: &str,
    subsystem: Option<usize>,
) -> Option<&'static str> {
    match channel {
        Channel::Tls { identity } => {
            let Some(identity) = identity.as_deref().and_then(PskIdentity::parse) else {
                return Some("the TLS session has no NVMe/TCP PSK identity");
            };
            if identity.host_nqn != host_nqn {
                return Some("the TLS identity names another host NQN than Connect");
            }
            if identity.subsystem_nqn != subsystem_nqn {
                return Some("the TLS identity names another subsystem than Connect");
            }
            None
        }
        Channel::Undecided | Channel::Plain => {
            let Some(index) = subsystem else {
                // The discovery subsystem: its own requirement and keys (a discovery log
                // names where a host may connect, which is worth keeping from eavesdroppers
                // and from a host claiming another's NQN).
                let discovery = &targets.discovery;
                if discovery.secure_channel {
                    return Some("the discovery subsystem requires TLS (secure channel)");
                }
                if discovery.hosts_with_keys.iter().any(|nqn| nqn == host_nqn) {
                    return Some(
                        "the host has a TLS key for the discovery subsystem: it must connect over TLS",
                    );
                }
                return None;
            };
            let found = targets.subsystems.get(index)?;
            if found.secure_channel {
                return Some("the subsystem requires TLS (secure channel)");
            }
            if found
                .hosts
                .iter()
                .any(|host| host.nqn == host_nqn && host.tls_key)
            {
                return Some("the host has a TLS key: it must connect over TLS");
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_byte_picks_the_channel_by_mode() {
        let hello = [0x16, 3, 1];
        let ic_req = [0x00, 0, 128];
        let cases = [
            (NvmeTlsMode::Off, &hello[..], FirstByte::Plain),
            (NvmeTlsMode::Off, &ic_req[..], FirstByte::Plain),
            (NvmeTlsMode::Optional, &hello[..], FirstByte::StartTls),
            (NvmeTlsMode::Optional, &ic_req[..], FirstByte::Plain),
            (NvmeTlsMode::Require, &hello[..], FirstByte::StartTls),
            (NvmeTlsMode::Optional, &[][..], FirstByte::NeedMore),
        ];
        for (mode, input, expected) in cases {
            assert_eq!(first_byte(input, mode), expected, "{mode:?} {input:?}");
        }
        assert!(matches!(
            first_byte(&ic_req, NvmeTlsMode::Require),
            FirstByte::Refuse(_)
        ));
    }
}
