//! The original ReFlex block protocol: one port serves one namespace and charges one tenant;
//! its header has no status field, so a request it cannot serve closes the connection.

use reflex_proto::original;

use super::{Action, Decoded, IoKind, IoRequest, Tag};
use crate::control::TenantRef;
use crate::namespaces::NamespaceSet;

pub(super) fn decode(
    input: &[u8],
    namespace_index: u16,
    tenant: TenantRef,
    namespaces: &NamespaceSet,
) -> Decoded {
    let (header, header_bytes) = match original::Header::decode(input) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => return Decoded::NeedMore,
        Err(e) => return Decoded::Close(e.to_string()),
    };
    let limits = original::Limits::default();
    let size_bytes = namespaces.size_bytes(namespace_index);
    match original::validate(&header, &limits, size_bytes) {
        Err(e) => Decoded::Close(e.to_string()),
        Ok(io) => {
            let kind = match io.opcode() {
                original::Opcode::Read => IoKind::Read,
                original::Opcode::Write => IoKind::Write { fua: false },
            };
            // Validation at the edge, as on every other protocol: with no status to refuse
            // with, a write to a read-only namespace closes the connection unwritten.
            if kind != IoKind::Read && namespaces.is_read_only(namespace_index) {
                return Decoded::Close(format!(
                    "write to read-only namespace {}",
                    namespaces.id(namespace_index)
                ));
            }
            Decoded::Request {
                header_bytes,
                payload_bytes: header.request_payload_length_bytes(),
                tag: Tag::Original {
                    response: io.response_header(),
                },
                action: Action::Io(IoRequest {
                    kind,
                    namespace_index,
                    offset_bytes: io.offset_bytes(),
                    length_bytes: io.length_bytes(),
                    tenant,
                }),
            }
        }
    }
}
