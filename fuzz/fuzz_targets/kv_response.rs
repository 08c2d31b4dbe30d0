//! Raw bytes as a client's receive buffer of key-value responses: every frame that decodes
//! re-encodes its header to the same bytes and carries exactly the value length it announces.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::kv::decode_response_frame;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some(frame)) = decode_response_frame(rest) {
        assert_eq!(frame.header.to_bytes()[..], rest[..24]);
        assert_eq!(frame.value.len(), frame.header.value_length_bytes as usize);
        assert_eq!(frame.length_bytes, 24 + frame.value.len());
        rest = &rest[frame.length_bytes..];
    }
});
