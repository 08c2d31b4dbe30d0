//! The native protocol v1 (`docs/PROTOCOL.md`): headers validated by `reflex_proto::native`
//! become requests; HELLO and control bodies are small and decoded whole.

use reflex_proto::native::{self, ControlOp, RegisterBody, ServerLimits, Status, ValidatedRequest};

use super::{Action, Answer, ControlRequest, Decoded, IoKind, IoRequest, Tag};
use crate::control::TenantRef;
use crate::namespaces::NamespaceSet;

pub(super) fn decode(input: &[u8], namespaces: &NamespaceSet) -> Decoded {
    let (header, header_bytes) = match native::decode_request(input) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => return Decoded::NeedMore,
        Err(e) => return Decoded::Close(e.to_string()),
    };
    let tag = Tag::Native {
        opcode_raw: header.opcode_raw,
        request_id: header.request_id,
    };
    let payload_bytes = u64::from(header.payload_length_bytes());
    let limits: ServerLimits = namespaces.limits();
    let reply = |status: Status| Decoded::Request {
        header_bytes,
        payload_bytes,
        tag,
        action: Action::Reply(Answer::Native(status)),
    };
    match native::validate_request(&header, &limits, namespaces.native_table()) {
        Err(status) => reply(status),
        Ok(ValidatedRequest::Hello) => {
            // The 16-byte body is small: wait until it is in the buffer with the header.
            let total = header_bytes + native::HELLO_BODY_SIZE;
            let Some(body) = input.get(header_bytes..total) else {
                return Decoded::NeedMore;
            };
            let action = match native::HelloBody::decode(body) {
                Ok(hello) => Action::Hello {
                    io_priority: hello.io_priority,
                },
                Err(_) => Action::Reply(Answer::Native(Status::Invalid)),
            };
            Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action,
            }
        }
        Ok(ValidatedRequest::Control {
            op,
            body_length_bytes,
        }) => {
            // Bodies are small (at most 4 KiB, const-asserted to fit the receive buffer):
            // wait until the whole body is there with its header.
            let total = header_bytes + body_length_bytes as usize;
            let Some(body) = input.get(header_bytes..total) else {
                return Decoded::NeedMore;
            };
            let request = match op {
                ControlOp::Register => RegisterBody::decode(body).map(ControlRequest::Register),
                ControlOp::Unregister => {
                    native::decode_handle(body).map(|handle| ControlRequest::Unregister { handle })
                }
                ControlOp::Bind => {
                    native::decode_handle(body).map(|handle| ControlRequest::Bind { handle })
                }
                ControlOp::Report => native::ReportBody::decode(body).map(ControlRequest::Report),
            };
            let action = match request {
                Ok(request) => Action::Control(request),
                Err(_) => Action::Reply(Answer::Native(Status::Invalid)),
            };
            Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action,
            }
        }
        Ok(ValidatedRequest::Io(io)) => {
            let Some(namespace_index) = namespaces.index_of(io.namespace_id()) else {
                return reply(Status::NoSuchNamespace);
            };
            let kind = match io.op() {
                native::IoOp::Read => IoKind::Read,
                native::IoOp::Write { fua } => IoKind::Write { fua },
                native::IoOp::Flush => IoKind::Flush,
                native::IoOp::Trim => IoKind::Trim {
                    fua: false,
                    hint: false,
                },
            };
            Decoded::Request {
                header_bytes,
                payload_bytes,
                tag,
                action: Action::Io(IoRequest {
                    kind,
                    namespace_index,
                    offset_bytes: io.offset_bytes(),
                    length_bytes: io.length_bytes(),
                    tenant: TenantRef::NONE,
                }),
            }
        }
    }
}
