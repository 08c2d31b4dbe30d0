//! Raw bytes as a receive buffer of original-protocol requests: decoded headers re-encode to the
//! same bytes, and validation holds its promises (non-empty, ≤ 1 MiB, aligned, in range).
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::original::{Header, Limits, validate};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, mut rest)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        io_size_max_bytes: 1 << 20,
        alignment_bytes: if selector & 1 == 0 { 512 } else { 4096 },
    };
    let namespace_size_bytes = u64::from(selector) << 24;
    while let Ok(Some((header, header_bytes))) = Header::decode(rest) {
        assert_eq!(header.to_bytes()[..], rest[..header_bytes]);
        rest = &rest[header_bytes..];
        if let Ok(io) = validate(&header, &limits, namespace_size_bytes) {
            assert!(io.length_bytes() > 0 && io.length_bytes() <= limits.io_size_max_bytes);
            assert_eq!(io.offset_bytes() % u64::from(limits.alignment_bytes), 0);
            assert!(io.offset_bytes() + u64::from(io.length_bytes()) <= namespace_size_bytes);
            assert_eq!(
                header.request_payload_length_bytes(),
                match io.opcode() {
                    reflex_proto::original::Opcode::Read => 0,
                    reflex_proto::original::Opcode::Write => u64::from(io.length_bytes()),
                }
            );
        }
        let payload_bytes = header.request_payload_length_bytes().min(rest.len() as u64) as usize;
        rest = &rest[payload_bytes..];
    }
});
