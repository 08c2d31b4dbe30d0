//! Raw bytes as a server's receive stream of key-value requests, fed to one `RequestDecoder`
//! in chunks whose sizes the input's first byte picks: the decoder never panics, never consumes
//! more than it is given, returns valid requests only whole, everything it returns re-encodes
//! to the bytes it consumed, a BIND's handle is its 8-byte key, and a buffer of `REQUEST_FRAME_SIZE_MAX` always makes progress.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::kv::{Decoded, REQUEST_FRAME_SIZE_MAX, RequestDecoder};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk_seed, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk_seed) + 1;
    let mut decoder = RequestDecoder::new();
    let mut buffer: Vec<u8> = Vec::new();
    let mut fed = 0;
    loop {
        let Ok((decoded, consumed)) = decoder.decode(&buffer) else {
            return;
        };
        assert!(consumed <= buffer.len());
        match decoded {
            Some(Decoded::Request {
                request_id,
                request,
            }) => {
                let mut out = vec![0u8; request.encoded_length_bytes()];
                assert_eq!(request.encode_into(request_id, &mut out), Ok(out.len()));
                assert_eq!(out[..], buffer[..consumed]);
                // A BIND always carries exactly one little-endian handle.
                if request.opcode() == reflex_proto::kv::Opcode::Bind {
                    let key: [u8; 8] = match request.key().try_into() {
                        Ok(key) => key,
                        Err(_) => panic!("a decoded BIND with a {}-byte key", request.key().len()),
                    };
                    assert_eq!(request.bind_handle(), Some(u64::from_le_bytes(key)));
                }
            }
            Some(Decoded::Rejected { header, status: _ }) => {
                assert_eq!(header.to_bytes()[..], buffer[..consumed]);
            }
            None => {}
        }
        buffer.drain(..consumed);
        if consumed == 0 {
            assert!(buffer.len() < REQUEST_FRAME_SIZE_MAX);
            if fed == stream.len() {
                return;
            }
            let next = (fed + chunk).min(stream.len());
            buffer.extend_from_slice(&stream[fed..next]);
            fed = next;
        }
    }
});
