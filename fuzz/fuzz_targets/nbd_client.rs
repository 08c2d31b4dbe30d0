//! Raw bytes as a server's side of the NBD handshake, seen by the client codec (what
//! `reflex bench -s nbd://` runs): fed in chunks whose sizes the first byte picks, the client
//! state machine never panics and never consumes more than it is given; once it reaches
//! transmission (or fails), the rest of the input goes through the simple-reply decoder, which
//! must consume exactly one 16-byte reply at a time or refuse the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::nbd::{ClientHandshake, SIMPLE_REPLY_SIZE, decode_simple_reply};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, input)) = data.split_first() else {
        return;
    };
    let chunk_bytes = usize::from(selector % 32) + 1;
    let Ok(mut handshake) = ClientHandshake::new("disk") else {
        return;
    };
    let mut position = 0;
    while position < input.len() && handshake.outcome().is_none() {
        let pending = handshake.pending_output().len();
        handshake.consume_output(pending);
        let end = (position + chunk_bytes).min(input.len());
        match handshake.handle_bytes(&input[position..end]) {
            Ok(consumed) => {
                assert!(consumed <= end - position);
                position += consumed;
                if consumed == 0 && handshake.outcome().is_none() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    if let Some(export) = handshake.outcome() {
        assert!(export.minimum_block_bytes().is_power_of_two());
        assert!(export.maximum_payload_bytes() >= export.minimum_block_bytes());
    }
    let mut rest = &input[position.min(input.len())..];
    while let Ok(Some((_, consumed))) = decode_simple_reply(rest) {
        assert_eq!(consumed, SIMPLE_REPLY_SIZE);
        rest = &rest[consumed..];
    }
});
