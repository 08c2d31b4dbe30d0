//! The protocol and the table together, as a server's connection would use them (without the
//! dataplane, which is not wired yet): a client's byte stream of valid and malformed requests
//! goes through `RequestDecoder` and `serve::answer`, the responses are encoded into a stream
//! and decoded on the client side, and every request gets exactly one answer in order.

use reflex_kv::layout::SLOTS_PER_BUCKET;
use reflex_kv::serve::answer;
use reflex_kv::{Geometry, KvStore, MemBlocks};
use reflex_proto::kv::{
    Decoded, KEY_SIZE_MAX_BYTES, Opcode, Request, RequestDecoder, RequestHeader, ResponseHeader,
    Status, VALUE_SIZE_MAX_BYTES, decode_response_frame,
};

fn encode(request: &Request<'_>, request_id: u64, stream: &mut Vec<u8>) {
    let start = stream.len();
    stream.resize(start + request.encoded_length_bytes(), 0);
    let written = request.encode_into(request_id, &mut stream[start..]);
    assert_eq!(written, Ok(request.encoded_length_bytes()));
}

/// Serves `stream` on `store` and returns the decoded answers: (id, opcode, status, value).
fn serve(store: &mut KvStore<MemBlocks>, stream: &[u8]) -> Vec<(u64, u8, Status, Vec<u8>)> {
    let mut decoder = RequestDecoder::new();
    let mut value = vec![0u8; VALUE_SIZE_MAX_BYTES];
    let mut responses = Vec::new();
    let mut rest = stream;
    loop {
        let (decoded, consumed) = decoder.decode(rest).unwrap_or_else(|e| panic!("{e}"));
        match decoded {
            Some(Decoded::Request {
                request_id,
                request,
            }) => {
                let header = answer(store, request_id, &request, &mut value);
                responses.extend_from_slice(&header.to_bytes());
                responses.extend_from_slice(&value[..header.value_length_bytes as usize]);
            }
            Some(Decoded::Rejected { header, status }) => {
                responses
                    .extend_from_slice(&ResponseHeader::for_request(&header, status, 0).to_bytes());
            }
            None if consumed == 0 => break,
            None => {}
        }
        rest = &rest[consumed..];
    }
    assert!(rest.is_empty(), "{} bytes left undecoded", rest.len());
    let mut answers = Vec::new();
    let mut rest = &responses[..];
    while let Some(frame) = decode_response_frame(rest).unwrap_or_else(|e| panic!("{e}")) {
        let status = frame.header.status().unwrap_or_else(|e| panic!("{e}"));
        answers.push((
            frame.header.request_id,
            frame.header.opcode_raw,
            status,
            frame.value.to_vec(),
        ));
        rest = &rest[frame.length_bytes..];
    }
    assert!(rest.is_empty());
    answers
}

#[test]
fn every_request_is_answered_in_order_and_bad_ones_are_skipped() {
    let mut store = KvStore::format(
        MemBlocks::new(200),
        Geometry::new(200, 1, 1).unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let big = vec![0x5a; VALUE_SIZE_MAX_BYTES];
    let mut stream = Vec::new();
    encode(
        &Request::Put {
            key: b"k",
            value: b"v1",
        },
        1,
        &mut stream,
    );
    encode(&Request::Get { key: b"k" }, 2, &mut stream);
    encode(&Request::Get { key: b"missing" }, 3, &mut stream);
    // Oversize value: TOO_LARGE, its 64 KiB + 1 bytes skipped.
    let oversize = vec![1u8; VALUE_SIZE_MAX_BYTES + 1];
    encode(
        &Request::Put {
            key: b"big",
            value: &oversize,
        },
        4,
        &mut stream,
    );
    // Oversize key: TOO_LARGE.
    let long_key = [b'x'; KEY_SIZE_MAX_BYTES + 1];
    encode(&Request::Get { key: &long_key }, 5, &mut stream);
    // Unknown opcode with a payload, and a GET carrying a value: INVALID, skipped.
    let unknown = RequestHeader {
        opcode_raw: 0x66,
        ..RequestHeader::new(Opcode::Get, 6, 3, 2)
    };
    stream.extend_from_slice(&unknown.to_bytes());
    stream.extend_from_slice(b"abcde");
    let get_with_value = RequestHeader::new(Opcode::Get, 7, 1, 4);
    stream.extend_from_slice(&get_with_value.to_bytes());
    stream.extend_from_slice(b"kVVVV");
    encode(
        &Request::Put {
            key: b"max",
            value: &big,
        },
        8,
        &mut stream,
    );
    encode(&Request::Delete { key: b"k" }, 9, &mut stream);
    encode(&Request::Delete { key: b"k" }, 10, &mut stream);
    encode(&Request::Flush, 11, &mut stream);
    // Fill the one bucket: TABLE_FULL on the 16th key.
    let keys: Vec<Vec<u8>> = (0..SLOTS_PER_BUCKET)
        .map(|i| format!("f{i}").into_bytes())
        .collect();
    for (index, key) in keys.iter().enumerate() {
        encode(
            &Request::Put { key, value: b"x" },
            100 + index as u64,
            &mut stream,
        );
    }
    encode(&Request::Get { key: b"max" }, 12, &mut stream);

    let answers = serve(&mut store, &stream);
    let put = Opcode::Put.as_u8();
    let get = Opcode::Get.as_u8();
    let mut expected = vec![
        (1, put, Status::Ok, vec![]),
        (2, get, Status::Ok, b"v1".to_vec()),
        (3, get, Status::NotFound, vec![]),
        (4, put, Status::TooLarge, vec![]),
        (5, get, Status::TooLarge, vec![]),
        (6, 0x66, Status::Invalid, vec![]),
        (7, get, Status::Invalid, vec![]),
        (8, put, Status::Ok, vec![]),
        (9, Opcode::Delete.as_u8(), Status::Ok, vec![]),
        (10, Opcode::Delete.as_u8(), Status::NotFound, vec![]),
        (11, Opcode::Flush.as_u8(), Status::Ok, vec![]),
    ];
    // "max" holds one slot, so 14 of the 15 new keys fit.
    for index in 0..SLOTS_PER_BUCKET as u64 {
        let status = if index < SLOTS_PER_BUCKET as u64 - 1 {
            Status::Ok
        } else {
            Status::TableFull
        };
        expected.push((100 + index, put, status, vec![]));
    }
    expected.push((12, get, Status::Ok, big));
    assert_eq!(answers.len(), expected.len());
    for (got, want) in answers.iter().zip(&expected) {
        assert_eq!(
            (got.0, got.1, got.2, got.3.len()),
            (want.0, want.1, want.2, want.3.len())
        );
        assert!(got.3 == want.3, "value of request {}", got.0);
    }
}
