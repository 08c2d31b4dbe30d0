//! Raw bytes as a client's receive buffer of native responses: headers and capabilities bodies
//! that decode re-encode to the same bytes, and so do REGISTER answers and RENEGOTIATE
//! notice bodies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::native::{
    Capabilities, NOTICE_REQUEST_ID, Opcode, RenegotiateBody, decode_handle, decode_response,
    encode_handle,
};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((header, header_bytes))) = decode_response(rest) {
        assert_eq!(header.to_bytes()[..], rest[..header_bytes]);
        rest = &rest[header_bytes..];
        let payload_bytes = (header.length_bytes as usize).min(rest.len());
        let payload = &rest[..payload_bytes];
        if header.opcode() == Ok(Opcode::Register) && header.status_raw == 0 {
            if let Ok(handle) = decode_handle(payload) {
                assert_eq!(encode_handle(handle)[..], payload[..]);
            }
        }
        if header.opcode() == Ok(Opcode::Renegotiate) && header.request_id == NOTICE_REQUEST_ID {
            if let Ok(notice) = RenegotiateBody::decode(payload) {
                assert_eq!(notice.to_bytes()[..], payload[..]);
            }
        }
        if header.opcode() == Ok(Opcode::Hello) {
            if let Ok((capabilities, entries)) = Capabilities::decode(payload) {
                let namespaces: Result<Vec<_>, _> = entries.collect();
                if let Ok(namespaces) = namespaces {
                    let mut out = vec![0u8; payload.len()];
                    assert_eq!(
                        capabilities.encode_into(&namespaces, &mut out),
                        Ok(payload.len())
                    );
                    assert_eq!(out, payload);
                }
            }
        }
        rest = &rest[payload_bytes..];
    }
});
