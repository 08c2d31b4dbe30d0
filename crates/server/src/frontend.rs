//! Protocol front ends: how a connection's bytes become requests and how results become
//! response headers, for each wire protocol the dataplane serves.
//!
//! Why a layer of its own: the dataplane loop moves bytes and buffers; it must not know the
//! shape of any header. A [`Frontend`] is chosen by the listening port and lives in the
//! connection. [`Frontend::decode`] looks at the unparsed bytes of the receive buffer and says
//! one of three things: need more bytes, here is a request (validated through the `proto`
//! codecs, with the number of payload bytes that follow it in the stream), or close (broken
//! framing). [`Frontend::encode_response`] turns a request's [`Tag`] and outcome into header
//! bytes, or says the protocol cannot express that outcome (the original protocol has no
//! status field: the connection is closed instead).
//!
//! Adding a protocol with a handshake (NBD): add a variant holding its `proto` state machine;
//! during the handshake `decode` returns [`Action::Reply`] requests whose body the frontend
//! writes with [`Frontend::write_body`] (the dataplane gives it a buffer run and sends it like
//! READ data), and switches itself to the transmission phase when the handshake completes.

use reflex_proto::native::{self, Capabilities, ServerLimits, Status, ValidatedRequest};
use reflex_proto::original;

use crate::namespaces::NamespaceSet;

/// Room for the largest response header of any protocol.
pub const RESPONSE_HEADER_SIZE_MAX: usize = 32;

const _: () = assert!(native::RESPONSE_HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(original::HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);

/// The protocol of a connection, with any per-connection protocol state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    Native,
    /// The original ReFlex block protocol; the listening port fixed the namespace.
    Original {
        namespace_index: u16,
    },
}

/// What a response must echo, kept in the request slot from decode to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    None,
    Native { opcode_raw: u8, request_id: u64 },
    Original { response: original::Header },
}

/// A device operation, validated against its namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRequest {
    pub kind: IoKind,
    pub namespace_index: u16,
    pub offset_bytes: u64,
    pub length_bytes: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write { fua: bool },
    Flush,
    Trim,
}

impl IoKind {
    /// Whether the request needs a data buffer (READ and WRITE).
    pub fn has_data(self) -> bool {
        matches!(self, IoKind::Read | IoKind::Write { .. })
    }
}

/// What a decoded request asks the dataplane to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Io(IoRequest),
    /// Answer with the server's capabilities (native HELLO).
    Hello,
    /// Answer at once with this status and no body (validation failures, control opcodes not
    /// implemented yet). The request's payload, if any, is skipped.
    Reply(Status),
}

/// The outcome of looking at the unparsed bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Not a whole header yet: receive more.
    NeedMore,
    Request {
        /// Bytes of the buffer the request's header (and small body) occupied.
        header_bytes: usize,
        /// Bytes that follow in the stream and belong to this request: a WRITE's data, or a
        /// payload to skip.
        payload_bytes: u64,
        tag: Tag,
        action: Action,
    },
    /// Broken framing, or a request the protocol cannot refuse politely: close the connection.
    Close(String),
}

impl Frontend {
    pub fn decode(&self, input: &[u8], namespaces: &NamespaceSet) -> Decoded {
        match *self {
            Frontend::Native => decode_native(input, namespaces),
            Frontend::Original { namespace_index } => {
                decode_original(input, namespace_index, namespaces)
            }
        }
    }

    /// Writes the response header for `tag` with `status` and `data_bytes` of payload; `None`
    /// when the protocol cannot carry the status (the caller closes the connection).
    pub fn encode_response(
        &self,
        tag: &Tag,
        status: Status,
        data_bytes: u32,
        out: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
    ) -> Option<usize> {
        match *tag {
            Tag::None => Some(0),
            Tag::Native {
                opcode_raw,
                request_id,
            } => {
                let header =
                    native::ResponseHeader::new(opcode_raw, status, request_id, data_bytes);
                let bytes = header.to_bytes();
                out[..bytes.len()].copy_from_slice(&bytes);
                Some(bytes.len())
            }
            Tag::Original { response } => {
                if !status.is_ok() {
                    return None;
                }
                let bytes = response.to_bytes();
                out[..bytes.len()].copy_from_slice(&bytes);
                Some(bytes.len())
            }
        }
    }

    /// Bytes of body an [`Action::Hello`] needs.
    pub fn hello_body_size_max(namespaces: &NamespaceSet) -> usize {
        Capabilities::encoded_size(namespaces.native_table().len())
    }

    /// Writes the capabilities body into `out`; returns its length.
    pub fn write_hello_body(namespaces: &NamespaceSet, window: u32, out: &mut [u8]) -> usize {
        let capabilities = Capabilities::from_limits(&namespaces.limits(), window);
        match capabilities.encode_into(namespaces.native_table(), out) {
            Ok(length) => length,
            Err(e) => panic!("capabilities buffer sized from encoded_size: {e}"),
        }
    }
}

fn decode_native(input: &[u8], namespaces: &NamespaceSet) -> Decoded {
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
        action: Action::Reply(status),
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
                Ok(_) => Action::Hello,
                Err(_) => Action::Reply(Status::Invalid),
            };
            Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action,
            }
        }
        // Tenants arrive with the QoS work; until then the opcodes are refused politely.
        Ok(ValidatedRequest::Control { .. }) => reply(Status::Invalid),
        Ok(ValidatedRequest::Io(io)) => {
            let Some(namespace_index) = namespaces.index_of(io.namespace_id()) else {
                return reply(Status::NoSuchNamespace);
            };
            let kind = match io.op() {
                native::IoOp::Read => IoKind::Read,
                native::IoOp::Write { fua } => IoKind::Write { fua },
                native::IoOp::Flush => IoKind::Flush,
                native::IoOp::Trim => IoKind::Trim,
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
                }),
            }
        }
    }
}

fn decode_original(input: &[u8], namespace_index: u16, namespaces: &NamespaceSet) -> Decoded {
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
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespaces() -> NamespaceSet {
        let device = reflex_flash::spec::open("null:1M", None).unwrap_or_else(|e| panic!("{e}"));
        NamespaceSet::new(vec![(7, device, false)])
    }

    fn check(frontend: Frontend, input: &[u8], expected: Decoded) {
        assert_eq!(frontend.decode(input, &namespaces()), expected);
    }

    #[test]
    fn native_requests() {
        let read = native::RequestHeader::read(5, 7, 4096, 4096).to_bytes();
        check(Frontend::Native, &read[..10], Decoded::NeedMore);
        check(
            Frontend::Native,
            &read,
            Decoded::Request {
                header_bytes: 32,
                payload_bytes: 0,
                tag: Tag::Native {
                    opcode_raw: 2,
                    request_id: 5,
                },
                action: Action::Io(IoRequest {
                    kind: IoKind::Read,
                    namespace_index: 0,
                    offset_bytes: 4096,
                    length_bytes: 4096,
                }),
            },
        );
        let write = native::RequestHeader::write(6, 7, 1 << 20, 512, false).to_bytes();
        check(
            Frontend::Native,
            &write,
            Decoded::Request {
                header_bytes: 32,
                payload_bytes: 512,
                tag: Tag::Native {
                    opcode_raw: 3,
                    request_id: 6,
                },
                action: Action::Reply(Status::OutOfRange),
            },
        );
        let mut bad = read;
        bad[0] = b'X';
        assert!(matches!(
            Frontend::Native.decode(&bad, &namespaces()),
            Decoded::Close(_)
        ));
        let hello = native::RequestHeader::hello(9).to_bytes();
        check(Frontend::Native, &hello, Decoded::NeedMore);
        let mut with_body = hello.to_vec();
        with_body.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        check(
            Frontend::Native,
            &with_body,
            Decoded::Request {
                header_bytes: 48,
                payload_bytes: 0,
                tag: Tag::Native {
                    opcode_raw: 1,
                    request_id: 9,
                },
                action: Action::Hello,
            },
        );
    }

    #[test]
    fn original_requests() {
        let frontend = Frontend::Original { namespace_index: 0 };
        let header = original::Header {
            opcode: original::Opcode::Write,
            handle: [1; 8],
            lba: 8,
            lba_count: 8,
        };
        let decoded = frontend.decode(&header.to_bytes(), &namespaces());
        assert!(matches!(
            decoded,
            Decoded::Request {
                payload_bytes: 4096,
                ..
            }
        ));
        let beyond = original::Header {
            lba: 1 << 20,
            ..header
        };
        assert!(matches!(
            frontend.decode(&beyond.to_bytes(), &namespaces()),
            Decoded::Close(_)
        ));
        let tag = Tag::Original { response: header };
        let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
        assert_eq!(
            frontend.encode_response(&tag, Status::IoError, 0, &mut out),
            None
        );
        assert_eq!(
            frontend.encode_response(&tag, Status::Ok, 0, &mut out),
            Some(24)
        );
    }
}
