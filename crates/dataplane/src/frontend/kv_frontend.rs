//! The key-value protocol (`docs/KV.md`): one port serves the table on one namespace and
//! charges the port's tenant, or the tenant a connection BINDs to. A valid request becomes an [`IoKind::Kv`] request whose payload (the
//! key, then the value) the dataplane receives into the request's run like a WRITE payload;
//! the table's step machine then decides its device operations (`core/kv.rs`). An invalid
//! header is answered with its status and its payload skipped; only a wrong magic closes the
//! connection.

use reflex_proto::kv::{self, Opcode};

use super::{Action, Answer, Decoded, IoKind, IoRequest, Tag};
use crate::control::TenantRef;

pub(super) fn decode(input: &[u8], namespace_index: u16, tenant: TenantRef) -> Decoded {
    let (header, header_bytes) = match kv::decode_request(input) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => return Decoded::NeedMore,
        Err(e) => return Decoded::Close(e.to_string()),
    };
    let tag = Tag::Kv {
        opcode_raw: header.opcode_raw,
        request_id: header.request_id,
    };
    let payload_bytes = header.payload_length_bytes();
    let action = match kv::validate_request(&header) {
        Err(status) => Action::Reply(Answer::Kv(status)),
        Ok(valid) if valid.opcode() == Opcode::Bind => {
            // The key is the 8-byte handle: wait until it is in the buffer with its header
            // and decode it here, like a native control body (never received into a run).
            let total = header_bytes + kv::BIND_KEY_SIZE_BYTES;
            let Some(key) = input.get(header_bytes..total) else {
                return Decoded::NeedMore;
            };
            let Some(handle) = (kv::Request::Bind { key }).bind_handle() else {
                panic!("a validated BIND key of {} bytes", key.len());
            };
            return Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action: Action::KvBind { handle },
            };
        }
        Ok(valid) => Action::Io(IoRequest {
            kind: IoKind::Kv {
                opcode: valid.opcode(),
                // 0 ..= 255, validated.
                key_bytes: valid.key_length_bytes() as u8,
            },
            namespace_index,
            offset_bytes: 0,
            // ≤ 255 + 64 KiB, validated.
            length_bytes: payload_bytes as u32,
            tenant,
        }),
    };
    Decoded::Request {
        header_bytes,
        payload_bytes,
        tag,
        action,
    }
}

/// The wire status of an answer to a KV request.
pub(super) fn status(answer: Answer) -> kv::Status {
    match answer {
        Answer::Ok => kv::Status::Ok,
        Answer::Kv(status) => status,
        // The tenant may not do this: removed (revoked), a read-only grant, another namespace.
        Answer::Permission => kv::Status::Permission,
        Answer::Native(_) | Answer::Nbd(_) => kv::Status::Invalid,
        Answer::DeviceError { .. } | Answer::Unsupported | Answer::ShuttingDown => {
            kv::Status::IoError
        }
    }
}

/// The response header for `opcode_raw`/`request_id` with `answer` and `value_bytes` after it.
pub(super) fn response(
    opcode_raw: u8,
    request_id: u64,
    answer: Answer,
    value_bytes: u32,
) -> [u8; kv::RESPONSE_HEADER_SIZE] {
    kv::ResponseHeader {
        opcode_raw,
        status_raw: status(answer).as_u16(),
        request_id,
        value_length_bytes: value_bytes,
    }
    .to_bytes()
}

/// Whether `opcode` writes the table (charged and checked as a write).
pub fn writes(opcode: Opcode) -> bool {
    matches!(opcode, Opcode::Put | Opcode::Delete)
}
