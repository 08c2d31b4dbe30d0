//! Raw bytes as a server's receive buffer of pipelined native requests: every header that
//! decodes re-encodes to the same bytes, validation never panics, and payloads are skipped by
//! the length the codec announces, exactly as the server does; tenant bodies (REGISTER,
//! UNREGISTER, BIND, REPORT) that decode re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::native::{
    ControlOp, HelloBody, Namespace, RegisterBody, ReportBody, ServerLimits, ValidatedRequest,
    decode_handle, decode_request, encode_handle, validate_request,
};

const NAMESPACES: [Namespace; 2] = [
    Namespace {
        id: 0,
        size_bytes: 1 << 30,
        read_only: false,
    },
    Namespace {
        id: 1,
        size_bytes: 1 << 20,
        read_only: true,
    },
];

fuzz_target!(|data: &[u8]| {
    let limits = ServerLimits::default();
    let mut rest = data;
    while let Ok(Some((header, header_bytes))) = decode_request(rest) {
        assert_eq!(header.to_bytes()[..], rest[..header_bytes]);
        rest = &rest[header_bytes..];
        let payload_bytes = (header.payload_length_bytes() as usize).min(rest.len());
        let payload = &rest[..payload_bytes];
        match validate_request(&header, &limits, &NAMESPACES[..]) {
            Ok(ValidatedRequest::Hello) => {
                if let Ok(hello) = HelloBody::decode(payload) {
                    assert_eq!(hello.to_bytes()[..], payload[..]);
                }
            }
            Ok(ValidatedRequest::Io(io)) => {
                let namespace = NAMESPACES
                    .iter()
                    .find(|n| n.id == io.namespace_id())
                    .unwrap();
                assert!(io.offset_bytes() + u64::from(io.length_bytes()) <= namespace.size_bytes);
                assert!(
                    io.length_bytes() <= limits.io_size_max_bytes() || io.opcode().as_u8() == 5
                );
            }
            Ok(ValidatedRequest::Control {
                op,
                body_length_bytes,
            }) => {
                assert_eq!(body_length_bytes, header.payload_length_bytes());
                match op {
                    ControlOp::Register => {
                        if let Ok(body) = RegisterBody::decode(payload) {
                            assert_eq!(body.to_bytes()[..], payload[..]);
                        }
                    }
                    ControlOp::Unregister | ControlOp::Bind => {
                        if let Ok(handle) = decode_handle(payload) {
                            assert_eq!(encode_handle(handle)[..], payload[..]);
                        }
                    }
                    ControlOp::Report => {
                        if let Ok(report) = ReportBody::decode(payload) {
                            assert_eq!(report.to_bytes()[..], payload[..]);
                        }
                    }
                }
            }
            Err(_) => {}
        }
        rest = &rest[payload_bytes..];
    }
});
