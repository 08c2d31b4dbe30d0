//! Key-value protocol v1: round trips, the byte layout of `docs/KV.md`, truncation at every
//! length, the validation table, rejected requests whose payload is skipped in pieces, broken
//! framing, and seeded random bytes through both decoders.

use rand::{Rng, RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_proto::kv::*;

const SEED: u64 = 0x6b76_2024_0619_0001;

fn encode(request: &Request<'_>, request_id: u64) -> Vec<u8> {
    let mut out = vec![0u8; request.encoded_length_bytes()];
    assert_eq!(request.encode_into(request_id, &mut out), Ok(out.len()));
    out
}

/// Runs a whole byte stream through one decoder, feeding it `chunk` bytes at a time as a
/// server's receive buffer would grow, and returns what came out in order: `Ok((id, request
/// re-encoded))` for requests, `Err((id, status))` for rejections.
/// What [`drive`] saw: a request re-encoded, or a rejection's id and status.
type Outcome = Result<(u64, Vec<u8>), (u64, Status)>;

fn drive(stream: &[u8], chunk: usize) -> Result<Vec<Outcome>, RequestError> {
    let mut decoder = RequestDecoder::new();
    let mut buffer: Vec<u8> = Vec::new();
    let mut fed = 0;
    let mut out = Vec::new();
    loop {
        let (decoded, consumed) = decoder.decode(&buffer)?;
        match decoded {
            Some(Decoded::Request {
                request_id,
                request,
            }) => out.push(Ok((request_id, encode(&request, request_id)))),
            Some(Decoded::Rejected { header, status }) => {
                out.push(Err((header.request_id, status)))
            }
            None => {}
        }
        buffer.drain(..consumed);
        if consumed == 0 {
            if fed == stream.len() {
                assert!(buffer.len() < REQUEST_FRAME_SIZE_MAX);
                return Ok(out);
            }
            let next = (fed + chunk).min(stream.len());
            buffer.extend_from_slice(&stream[fed..next]);
            fed = next;
        }
    }
}

#[test]
fn requests_round_trip_through_the_decoder() {
    let big = vec![0xa5u8; VALUE_SIZE_MAX_BYTES];
    let long_key = [b'k'; KEY_SIZE_MAX_BYTES];
    let requests = [
        Request::Put {
            key: b"a",
            value: b"value",
        },
        Request::Put {
            key: &long_key,
            value: &big,
        },
        Request::Put {
            key: b"empty",
            value: b"",
        },
        Request::Get { key: b"a" },
        Request::Delete { key: &long_key },
        Request::Flush,
    ];
    let mut stream = Vec::new();
    for (index, request) in requests.iter().enumerate() {
        let bytes = encode(request, index as u64);
        let mut decoder = RequestDecoder::new();
        assert_eq!(
            decoder.decode(&bytes),
            Ok((
                Some(Decoded::Request {
                    request_id: index as u64,
                    request: *request
                }),
                bytes.len()
            ))
        );
        // Every strict prefix needs more.
        for cut in [0, 1, 23, 24, bytes.len() - 1] {
            if cut < bytes.len() {
                assert_eq!(decoder.decode(&bytes[..cut]), Ok((None, 0)), "{cut}");
            }
        }
        stream.extend_from_slice(&bytes);
    }
    for chunk in [1, 7, 4096, usize::MAX / 2] {
        let out = drive(&stream, chunk).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.len(), requests.len());
        for (index, (got, request)) in out.iter().zip(&requests).enumerate() {
            assert_eq!(got, &Ok((index as u64, encode(request, index as u64))));
        }
    }
    assert_eq!(Request::Flush.key(), b"");
    assert_eq!(requests[3].value(), b"");
    assert_eq!(requests[1].opcode(), Opcode::Put);
}

#[test]
fn wire_layout_is_the_documented_one() {
    let bytes = encode(
        &Request::Put {
            key: b"k1",
            value: b"xyz",
        },
        0x0102_0304_0506_0708,
    );
    assert_eq!(
        bytes,
        [
            b'R', b'F', b'X', b'K', 1, 0x01, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1, 2, 0, 0, 0, 3, 0, 0, 0,
            b'k', b'1', b'x', b'y', b'z'
        ]
    );
    let response = ResponseHeader::new(Opcode::Get, Status::NotFound, 9, 0).to_bytes();
    assert_eq!(
        response,
        [
            b'R', b'F', b'X', b'V', 1, 0x02, 1, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        ]
    );
}

fn header(opcode_raw: u8, key_length_bytes: u16, value_length_bytes: u32) -> RequestHeader {
    RequestHeader {
        version: VERSION,
        opcode_raw,
        flags: 0,
        request_id: 77,
        key_length_bytes,
        reserved: 0,
        value_length_bytes,
    }
}

/// One row of the validation table.
fn check(header: RequestHeader, expected: Result<(Opcode, usize, usize), Status>) {
    let got = validate_request(&header)
        .map(|v| (v.opcode(), v.key_length_bytes(), v.value_length_bytes()));
    assert_eq!(got, expected, "{header:?}");
    if let Ok(v) = validate_request(&header) {
        assert_eq!(v.request_id(), 77);
        assert!(v.frame_length_bytes() <= REQUEST_FRAME_SIZE_MAX);
    }
}

#[test]
fn validation_table() {
    let put = Opcode::Put.as_u8();
    let get = Opcode::Get.as_u8();
    let delete = Opcode::Delete.as_u8();
    let flush = Opcode::Flush.as_u8();
    check(header(put, 4, 16 << 10), Ok((Opcode::Put, 4, 16 << 10)));
    check(header(put, 255, 64 << 10), Ok((Opcode::Put, 255, 64 << 10)));
    check(header(put, 1, 0), Ok((Opcode::Put, 1, 0)));
    check(header(get, 9, 0), Ok((Opcode::Get, 9, 0)));
    check(header(delete, 9, 0), Ok((Opcode::Delete, 9, 0)));
    check(header(flush, 0, 0), Ok((Opcode::Flush, 0, 0)));
    // Oversize key or value.
    check(header(put, 256, 1), Err(Status::TooLarge));
    check(header(get, u16::MAX, 0), Err(Status::TooLarge));
    check(header(put, 4, (64 << 10) + 1), Err(Status::TooLarge));
    check(header(put, 4, u32::MAX), Err(Status::TooLarge));
    // Shape.
    check(header(put, 0, 10), Err(Status::Invalid));
    check(header(get, 0, 0), Err(Status::Invalid));
    check(header(delete, 0, 0), Err(Status::Invalid));
    check(header(flush, 1, 0), Err(Status::Invalid));
    check(header(get, 4, 1), Err(Status::Invalid));
    check(header(delete, 4, 1), Err(Status::Invalid));
    check(header(flush, 0, 1), Err(Status::Invalid));
    check(header(0, 4, 0), Err(Status::Invalid));
    check(header(0x06, 4, 0), Err(Status::Invalid));
    check(header(0xff, 4, 0), Err(Status::Invalid));
    check(
        RequestHeader {
            version: 2,
            ..header(get, 4, 0)
        },
        Err(Status::Invalid),
    );
    check(
        RequestHeader {
            flags: 1,
            ..header(get, 4, 0)
        },
        Err(Status::Invalid),
    );
    check(
        RequestHeader {
            reserved: 0x8000,
            ..header(get, 4, 0)
        },
        Err(Status::Invalid),
    );
}

#[test]
fn rejected_requests_are_answered_and_their_payload_skipped() {
    // An oversize PUT (1 MiB value), a GET with a value, an unknown opcode with a key: each is
    // rejected at its header and the valid GET after them still decodes, whatever the chunking.
    let mut stream = Vec::new();
    let oversize = header(Opcode::Put.as_u8(), 3, 1 << 20);
    stream.extend_from_slice(&oversize.to_bytes());
    stream.extend(std::iter::repeat_n(0x55, 3 + (1 << 20)));
    let get_with_value = RequestHeader {
        request_id: 78,
        ..header(Opcode::Get.as_u8(), 2, 5)
    };
    stream.extend_from_slice(&get_with_value.to_bytes());
    stream.extend_from_slice(b"ab12345");
    let unknown = RequestHeader {
        request_id: 79,
        ..header(0x42, 7, 0)
    };
    stream.extend_from_slice(&unknown.to_bytes());
    stream.extend_from_slice(b"keykeyk");
    stream.extend_from_slice(&encode(&Request::Get { key: b"after" }, 80));
    for chunk in [1, 13, 65_536, usize::MAX / 2] {
        if chunk == 1 {
            // A byte at a time over a megabyte is slow in debug builds; the skip path is the
            // same for 13-byte chunks.
            continue;
        }
        let out = drive(&stream, chunk).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out,
            vec![
                Err((77, Status::TooLarge)),
                Err((78, Status::Invalid)),
                Err((79, Status::Invalid)),
                Ok((80, encode(&Request::Get { key: b"after" }, 80))),
            ],
            "chunk {chunk}"
        );
    }
    // The skip is remembered between calls.
    let mut decoder = RequestDecoder::new();
    let (decoded, consumed) = decoder
        .decode(&stream[..30])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(decoded, Some(Decoded::Rejected { .. })));
    assert_eq!(consumed, REQUEST_HEADER_SIZE);
    assert_eq!(decoder.skip_remaining_bytes(), 3 + (1 << 20));
    assert_eq!(decoder.decode(&stream[24..30]), Ok((None, 6)));
    assert_eq!(decoder.skip_remaining_bytes(), 3 + (1 << 20) - 6);
    // Answers echo the raw opcode and id, even an unknown one.
    let answer = ResponseHeader::for_request(&unknown, Status::Invalid, 0);
    assert_eq!(answer.opcode_raw, 0x42);
    assert_eq!(answer.opcode(), Err(UnknownOpcode(0x42)));
    assert_eq!(answer.request_id, 79);
}

#[test]
fn broken_framing_is_an_error() {
    let mut bytes = encode(&Request::Get { key: b"x" }, 1);
    bytes[0] = b'r';
    let mut decoder = RequestDecoder::new();
    assert!(matches!(
        decoder.decode(&bytes),
        Err(RequestError::BadMagic { .. })
    ));
    // A native request on the KV port is broken framing too.
    let native = reflex_proto::native::RequestHeader::flush(1, 0).to_bytes();
    assert!(decoder.decode(&native).is_err());
}

#[test]
fn responses_round_trip_and_refuse_what_a_client_cannot_take() {
    let value = vec![7u8; 1000];
    let get = ResponseHeader::new(Opcode::Get, Status::Ok, 5, value.len() as u32);
    let mut frame = get.to_bytes().to_vec();
    frame.extend_from_slice(&value);
    frame.extend_from_slice(&ResponseHeader::new(Opcode::Put, Status::TableFull, 6, 0).to_bytes());
    let first = decode_response_frame(&frame)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("whole frame"));
    assert_eq!((first.header, first.value), (get, &value[..]));
    assert_eq!(first.header.status(), Ok(Status::Ok));
    let consumed = first.length_bytes;
    let next = decode_response_frame(&frame[consumed..])
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("whole frame"));
    assert_eq!(next.header.status(), Ok(Status::TableFull));
    assert_eq!(
        (next.value.len(), consumed + next.length_bytes),
        (0, frame.len())
    );
    for cut in 0..consumed {
        assert_eq!(decode_response_frame(&frame[..cut]), Ok(None), "{cut}");
    }
    let mut out = [0u8; RESPONSE_HEADER_SIZE];
    assert_eq!(get.encode_into(&mut out), Ok(RESPONSE_HEADER_SIZE));
    assert!(get.encode_into(&mut out[..10]).is_err());

    let mut bad = get.to_bytes();
    bad[4] = 2;
    assert_eq!(
        decode_response(&bad),
        Err(ResponseError::UnsupportedVersion { found: 2 })
    );
    let mut bad = get.to_bytes();
    bad[16..20].copy_from_slice(&((64u32 << 10) + 1).to_le_bytes());
    assert_eq!(
        decode_response(&bad),
        Err(ResponseError::ValueTooLarge {
            found: (64 << 10) + 1
        })
    );
    let mut bad = get.to_bytes();
    bad[23] = 1;
    assert!(matches!(
        decode_response(&bad),
        Err(ResponseError::ReservedNotZero { .. })
    ));
    let mut bad = get.to_bytes();
    bad[3] = b'Q';
    assert!(matches!(
        decode_response(&bad),
        Err(ResponseError::BadMagic { .. })
    ));
    let mut unknown_status = get.to_bytes();
    unknown_status[6] = 99;
    let (header, _) = decode_response(&unknown_status)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("whole header"));
    assert_eq!(header.status(), Err(UnknownStatus(99)));
    for status in 0..=5u16 {
        let parsed = Status::from_u16(status).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parsed.as_u16(), status);
        assert!(!parsed.to_string().is_empty());
    }
}

#[test]
fn encoders_refuse_short_buffers() {
    let request = Request::Put {
        key: b"key",
        value: b"value",
    };
    let mut out = [0u8; 31];
    assert!(request.encode_into(1, &mut out).is_err());
    assert_eq!(request.encode_into(1, &mut [0u8; 32]), Ok(32));
    assert!(request.header(1).encode_into(&mut out[..23]).is_err());
}

/// Random bytes, half of them behind a valid magic and version, with small lengths likely:
/// the decoder never panics, never returns more than it was given, returns valid requests only
/// whole, and everything it returns re-encodes to the bytes it consumed.
#[test]
fn random_bytes_never_panic_and_round_trip() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED);
    for round in 0..20_000 {
        let length = rng.random_range(0..400);
        let mut bytes = vec![0u8; length];
        rng.fill_bytes(&mut bytes);
        if length >= REQUEST_HEADER_SIZE && rng.random_bool(0.7) {
            bytes[..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
            bytes[4] = VERSION;
            bytes[5] = rng.random_range(0..6);
            for byte in &mut bytes[6..REQUEST_HEADER_SIZE] {
                if rng.random_bool(0.7) {
                    *byte = 0;
                }
            }
            bytes[16] = rng.random_range(0..40);
            bytes[20] = rng.random_range(0..40);
        }
        let mut decoder = RequestDecoder::new();
        let mut rest = &bytes[..];
        while let Ok((decoded, consumed)) = decoder.decode(rest) {
            assert!(consumed <= rest.len(), "seed {SEED:#x} round {round}");
            match decoded {
                Some(Decoded::Request {
                    request_id,
                    request,
                }) => assert_eq!(
                    encode(&request, request_id),
                    rest[..consumed],
                    "seed {SEED:#x} round {round}"
                ),
                Some(Decoded::Rejected { header, .. }) => {
                    assert_eq!(header.to_bytes()[..], rest[..consumed]);
                }
                None => {}
            }
            if consumed == 0 {
                break;
            }
            rest = &rest[consumed..];
        }
        let mut response = bytes.clone();
        if response.len() >= RESPONSE_HEADER_SIZE && rng.random_bool(0.7) {
            response[..4].copy_from_slice(&RESPONSE_MAGIC.to_le_bytes());
            response[4] = VERSION;
            response[17..24].fill(0);
        }
        if let Ok(Some(frame)) = decode_response_frame(&response) {
            assert_eq!(
                frame.header.to_bytes()[..],
                response[..RESPONSE_HEADER_SIZE]
            );
            assert_eq!(frame.value.len(), frame.header.value_length_bytes as usize);
            assert!(frame.length_bytes <= response.len());
        }
    }
}

#[test]
fn bind_carries_an_eight_byte_little_endian_handle() {
    let handle: u64 = 0x1122_3344_5566_7788;
    let key = handle.to_le_bytes();
    let request = Request::Bind { key: &key };
    assert_eq!(request.opcode(), Opcode::Bind);
    assert_eq!(Opcode::Bind.as_u8(), 5);
    assert_eq!(Opcode::from_u8(5), Ok(Opcode::Bind));
    assert_eq!(request.bind_handle(), Some(handle));
    assert_eq!(Request::Flush.bind_handle(), None);
    assert_eq!(Request::Bind { key: &key[..7] }.bind_handle(), None);
    // The exact bytes: header with opcode 5, key length 8, no value, then the handle LE.
    #[rustfmt::skip]
    let expected: Vec<u8> = vec![
        b'R', b'F', b'X', b'K', 1, 0x05, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0,
        0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
    ];
    let bytes = encode(&request, 9);
    assert_eq!(bytes, expected);
    // Decoded whole, in every chunking, back to the same handle.
    for chunk in [1, 7, 24, 31, 32, 100] {
        let outcomes = drive(&bytes, chunk).expect("framing");
        assert_eq!(outcomes, vec![Ok((9, bytes.clone()))], "chunk {chunk}");
    }
    let (decoded, consumed) = RequestDecoder::new().decode(&bytes).expect("framing");
    assert_eq!(consumed, bytes.len());
    let Some(Decoded::Request { request, .. }) = decoded else {
        panic!("a BIND decodes to a request: {decoded:?}");
    };
    assert_eq!(request.bind_handle(), Some(handle));
}

#[test]
fn bind_validation_and_new_statuses() {
    let bind = Opcode::Bind.as_u8();
    check(header(bind, 8, 0), Ok((Opcode::Bind, 8, 0)));
    // Key of another length than 8, or a value: INVALID, payload skipped.
    for key_length in [0u16, 1, 7, 9, 255] {
        check(header(bind, key_length, 0), Err(Status::Invalid));
    }
    check(header(bind, 8, 1), Err(Status::Invalid));
    // Oversize still decides first (TOO_LARGE before the shape checks).
    check(header(bind, 256, 0), Err(Status::TooLarge));
    check(header(bind, 8, (64 << 10) + 1), Err(Status::TooLarge));
    let mut stream = header(bind, 9, 3).to_bytes().to_vec();
    stream.extend_from_slice(&[0xaa; 12]);
    let flush = encode(&Request::Flush, 5);
    stream.extend_from_slice(&flush);
    let outcomes = drive(&stream, 5).expect("framing");
    assert_eq!(outcomes, vec![Err((77, Status::Invalid)), Ok((5, flush))]);
    // The two statuses BIND brought, both ways.
    assert_eq!(Status::from_u16(6), Ok(Status::NoTenant));
    assert_eq!(Status::from_u16(7), Ok(Status::Permission));
    assert_eq!(Status::NoTenant.as_u16(), 6);
    assert_eq!(Status::Permission.as_u16(), 7);
    assert_eq!(Status::from_u16(8), Err(UnknownStatus(8)));
}
