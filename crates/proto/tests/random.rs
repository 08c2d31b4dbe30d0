//! Property tests with a seeded RNG: random and half-valid bytes through every decoder, state
//! machine and validator must never panic, everything that decodes must re-encode to the same
//! bytes, and the handshake never consumes more than it is given. The seed is in every message.

use std::sync::Arc;

use rand::{Rng, RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_proto::{native, nbd, original};

const SEED: u64 = 0x5eed_2017_a5b1_0517;
const ROUNDS: usize = 20_000;

fn random_bytes(rng: &mut Xoshiro256PlusPlus, length_max: usize) -> Vec<u8> {
    let length = rng.random_range(0..=length_max);
    let mut bytes = vec![0u8; length];
    rng.fill_bytes(&mut bytes);
    bytes
}

/// Random bytes that start, half the time, with `magic`; small numbers are likelier, so
/// validation sees in-range values too.
fn candidate(rng: &mut Xoshiro256PlusPlus, magic: &[u8], length_max: usize) -> Vec<u8> {
    let mut bytes = random_bytes(rng, length_max);
    if rng.random_bool(0.5) && bytes.len() >= magic.len() {
        bytes[..magic.len()].copy_from_slice(magic);
    }
    for byte in bytes.iter_mut().skip(magic.len()) {
        if rng.random_bool(0.6) {
            *byte = rng.random_range(0..4);
        }
    }
    bytes
}

#[test]
fn native_decoders_never_panic_and_round_trip() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED);
    let namespaces = [
        native::Namespace {
            id: 0,
            size_bytes: 1 << 20,
            read_only: false,
        },
        native::Namespace {
            id: 1,
            size_bytes: 1 << 30,
            read_only: true,
        },
    ];
    let limits = native::ServerLimits::default();
    for round in 0..ROUNDS {
        let request_magic = native::REQUEST_MAGIC.to_le_bytes();
        let mut bytes = candidate(&mut rng, &request_magic, 64);
        if bytes.len() > 4 && rng.random_bool(0.5) {
            bytes[4] = 1;
        }
        if let Ok(Some((header, size))) = native::decode_request(&bytes) {
            assert_eq!(
                header.to_bytes()[..],
                bytes[..size],
                "seed {SEED:#x} round {round}"
            );
            let _ = header.payload_length_bytes();
            if let Ok(native::ValidatedRequest::Io(io)) =
                native::validate_request(&header, &limits, &namespaces[..])
            {
                let namespace = namespaces
                    .iter()
                    .find(|namespace| namespace.id == io.namespace_id())
                    .unwrap();
                assert!(io.offset_bytes() + u64::from(io.length_bytes()) <= namespace.size_bytes);
            }
        }
        let response_magic = native::RESPONSE_MAGIC.to_le_bytes();
        let bytes = candidate(&mut rng, &response_magic, 48);
        if let Ok(Some((header, size))) = native::decode_response(&bytes) {
            assert_eq!(
                header.to_bytes()[..],
                bytes[..size],
                "seed {SEED:#x} round {round}"
            );
        }
        let body = random_bytes(&mut rng, 80);
        if let Ok(hello) = native::HelloBody::decode(&body) {
            assert_eq!(hello.to_bytes()[..], body[..]);
        }
        if let Ok((capabilities, entries)) = native::Capabilities::decode(&body) {
            let decoded: Result<Vec<_>, _> = entries.collect();
            if let Ok(decoded) = decoded {
                let mut out = vec![0u8; body.len()];
                assert_eq!(capabilities.encode_into(&decoded, &mut out), Ok(body.len()));
                assert_eq!(out, body);
            }
        }
    }
}

#[test]
fn original_decoder_never_panics_and_round_trips() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED ^ 1);
    for round in 0..ROUNDS {
        let bytes = candidate(&mut rng, &[24, 0], 40);
        if let Ok(Some((header, size))) = original::Header::decode(&bytes) {
            assert_eq!(
                header.to_bytes()[..],
                bytes[..size],
                "seed {SEED:#x} round {round}"
            );
            let namespace_size_bytes = rng.random_range(0..1u64 << 31);
            let limits = original::Limits {
                io_size_max_bytes: 1 << 20,
                alignment_bytes: if rng.random_bool(0.5) { 512 } else { 4096 },
            };
            if let Ok(io) = original::validate(&header, &limits, namespace_size_bytes) {
                assert!(io.length_bytes() > 0 && io.length_bytes() <= 1 << 20);
                assert!(io.offset_bytes() + u64::from(io.length_bytes()) <= namespace_size_bytes);
            }
        }
    }
}

#[test]
fn nbd_transmission_never_panics_and_round_trips() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED ^ 2);
    let sessions = [
        nbd::Session::new(0, &nbd::Export::new("a", 1 << 20), false),
        nbd::Session::new(0, &nbd::Export::new("a", 1 << 20), true),
        nbd::Session::new(1, &nbd::Export::new("b", 1 << 30).read_only(), true),
    ];
    for round in 0..ROUNDS {
        let bytes = candidate(&mut rng, &nbd::REQUEST_MAGIC.to_be_bytes(), 40);
        if let Ok(Some((header, size))) = nbd::decode_request(&bytes) {
            assert_eq!(
                header.to_bytes()[..],
                bytes[..size],
                "seed {SEED:#x} round {round}"
            );
            for session in &sessions {
                match session.validate(&header) {
                    Ok(command) => {
                        let _ = session.reply_ok(&command);
                    }
                    Err(errno) => {
                        let reply = session.reply_error(header.cookie, errno);
                        let (decoded, _) = nbd::Reply::decode(reply.as_bytes()).unwrap().unwrap();
                        let cookie = match decoded {
                            nbd::Reply::Simple(simple) => simple.cookie,
                            nbd::Reply::Chunk(chunk) => chunk.cookie,
                        };
                        assert_eq!(cookie, header.cookie);
                    }
                }
            }
        }
        let bytes = random_bytes(&mut rng, 32);
        if let Ok(Some((reply, size))) = nbd::Reply::decode(&bytes) {
            assert_eq!(reply.to_bytes().as_bytes(), &bytes[..size]);
        }
    }
}

/// A client stream of plausible options: real option codes, structured INFO/GO data, random
/// lengths and bytes in between.
fn handshake_stream(rng: &mut Xoshiro256PlusPlus) -> Vec<u8> {
    let mut stream = rng.random_range(0u32..4).to_be_bytes().to_vec();
    for _ in 0..rng.random_range(0..6) {
        let option = rng.random_range(0u32..13);
        let data = match option {
            6 | 7 if rng.random_bool(0.7) => {
                let name: &[u8] = [&b"disk"[..], b"", b"ro", b"nope"][rng.random_range(0..4)];
                let mut data = (name.len() as u32).to_be_bytes().to_vec();
                data.extend_from_slice(name);
                let count = rng.random_range(0u16..4);
                data.extend_from_slice(&count.to_be_bytes());
                for _ in 0..count {
                    data.extend_from_slice(&rng.random_range(0u16..5).to_be_bytes());
                }
                if rng.random_bool(0.2) {
                    data.push(rng.random());
                }
                data
            }
            1 => [&b"disk"[..], b"ro", b"", b"nope"][rng.random_range(0..4)].to_vec(),
            _ => {
                let length_max = if rng.random_bool(0.1) { 10_000 } else { 8 };
                random_bytes(rng, length_max)
            }
        };
        stream.extend_from_slice(b"IHAVEOPT");
        stream.extend_from_slice(&option.to_be_bytes());
        let length = if rng.random_bool(0.9) {
            data.len() as u32
        } else {
            rng.random()
        };
        stream.extend_from_slice(&length.to_be_bytes());
        stream.extend_from_slice(&data);
        if rng.random_bool(0.05) {
            stream.extend_from_slice(&random_bytes(rng, 20));
        }
    }
    stream
}

#[test]
fn nbd_handshake_never_panics() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED ^ 3);
    let table = nbd::ExportTable::new(
        vec![
            nbd::Export::new("disk", 1 << 30).with_description("d"),
            nbd::Export::new("ro", 1 << 20).read_only(),
        ],
        Some("disk"),
    )
    .unwrap();
    let table = Arc::new(table);
    let mut out = [0u8; 333];
    let (mut transmissions, mut aborts, mut failures) = (0, 0, 0);
    for round in 0..ROUNDS / 4 {
        let stream = if rng.random_bool(0.8) {
            handshake_stream(&mut rng)
        } else {
            random_bytes(&mut rng, 200)
        };
        let config = nbd::HandshakeConfig {
            block_size_required: rng.random_bool(0.3),
            options_max: 4,
            tls: [
                nbd::TlsPolicy::Off,
                nbd::TlsPolicy::Optional,
                nbd::TlsPolicy::Required,
            ][rng.random_range(0..3)],
        };
        let mut handshake = nbd::Handshake::new(Arc::clone(&table), config);
        let mut position = 0;
        let mut steps = 0;
        while position < stream.len() && steps < 100_000 {
            steps += 1;
            let end = (position + rng.random_range(1..64)).min(stream.len());
            match handshake.handle_bytes(&stream[position..end]) {
                Ok(count) => {
                    assert!(count <= end - position, "seed {SEED:#x} round {round}");
                    position += count;
                }
                Err(_) => {
                    failures += 1;
                    break;
                }
            }
            while handshake.poll_transmit(&mut out) > 0 {}
            // After STARTTLS the rest of the stream stands for the decrypted one.
            let _ = handshake.take_start_tls();
            if handshake.outcome().is_some() {
                break;
            }
        }
        match handshake.outcome() {
            Some(nbd::Outcome::Transmission(_)) => transmissions += 1,
            Some(nbd::Outcome::Aborted) => aborts += 1,
            _ => {}
        }
        handshake.handle_eof();
        assert!(
            handshake.outcome().is_some() || handshake.handle_bytes(&[]).is_err(),
            "seed {SEED:#x} round {round}"
        );
    }
    // The streams reach every ending, so the interesting paths were exercised.
    assert!(
        transmissions > 100 && aborts > 100 && failures > 100,
        "{transmissions} {aborts} {failures}"
    );
}
