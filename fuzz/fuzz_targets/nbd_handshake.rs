//! Raw bytes as a client's side of the NBD handshake, fed in chunks whose sizes the first byte
//! picks: the state machine never panics, never consumes more than it is given, and when it
//! reaches transmission the rest of the input goes through the transmission decoder.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use reflex_proto::nbd::{
    Export, ExportTable, Handshake, HandshakeConfig, Outcome, TlsPolicy, decode_request,
};

fn exports() -> Arc<ExportTable> {
    static TABLE: OnceLock<Arc<ExportTable>> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            let exports = vec![
                Export::new("disk", 1 << 30).with_description("main disk"),
                Export::new("ro", 1 << 20).read_only(),
            ];
            Arc::new(ExportTable::new(exports, Some("disk")).unwrap())
        })
        .clone()
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, input)) = data.split_first() else {
        return;
    };
    let chunk_bytes = usize::from(selector % 32) + 1;
    let config = HandshakeConfig {
        block_size_required: selector & 0x80 != 0,
        options_max: 64,
        tls: match selector & 0x60 {
            0x20 => TlsPolicy::Optional,
            0x40 => TlsPolicy::Required,
            _ => TlsPolicy::Off,
        },
    };
    let mut handshake = Handshake::new(exports(), config);
    let mut out = [0u8; 512];
    let mut position = 0;
    while position < input.len() {
        let end = (position + chunk_bytes).min(input.len());
        let Ok(consumed) = handshake.handle_bytes(&input[position..end]) else {
            return;
        };
        assert!(consumed <= end - position);
        position += consumed;
        while handshake.poll_transmit(&mut out) > 0 {}
        // After STARTTLS the rest of the input stands for the decrypted stream.
        let _ = handshake.take_start_tls();
        if let Some(outcome) = handshake.outcome() {
            if let Outcome::Transmission(session) = outcome {
                let mut rest = &input[position..];
                while let Ok(Some((header, header_bytes))) = decode_request(rest) {
                    let _ = session.validate(&header);
                    rest = &rest[header_bytes..];
                    let payload = (header.payload_length_bytes() as usize).min(rest.len());
                    rest = &rest[payload..];
                }
            }
            return;
        }
    }
    handshake.handle_eof();
    assert!(handshake.outcome().is_some());
});
