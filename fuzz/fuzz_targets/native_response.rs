//! Raw bytes as a client's receive buffer of native responses: headers and capabilities bodies
//! that decode re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::native::{Capabilities, Opcode, decode_response};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((header, header_bytes))) = decode_response(rest) {
        assert_eq!(header.to_bytes()[..], rest[..header_bytes]);
        rest = &rest[header_bytes..];
        let payload_bytes = (header.length_bytes as usize).min(rest.len());
        let payload = &rest[..payload_bytes];
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
