//! Native protocol v1: round trips, truncation, corruption, validation tables, pipelining and
//! the hex examples of `docs/PROTOCOL.md`.

use reflex_proto::native::*;

const NAMESPACES: [Namespace; 3] = [
    Namespace {
        id: 1,
        size_bytes: 1 << 30,
        read_only: false,
    },
    Namespace {
        id: 2,
        size_bytes: 1 << 20,
        read_only: true,
    },
    Namespace {
        id: 7,
        size_bytes: u64::MAX - 511,
        read_only: false,
    },
];

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------------
// Round trips.

fn sample_requests() -> Vec<RequestHeader> {
    vec![
        RequestHeader::read(1, 1, 0, 4096),
        RequestHeader::write(2, 1, 8192, 1 << 20, true),
        RequestHeader::write(3, 2, 512, 512, false),
        RequestHeader::flush(4, 1),
        RequestHeader::trim(5, 7, 1 << 40, 1 << 31),
        RequestHeader::hello(6),
        RequestHeader {
            length_bytes: 64,
            ..RequestHeader::new(Opcode::Register, 7)
        },
        RequestHeader {
            length_bytes: 8,
            ..RequestHeader::new(Opcode::Unregister, 8)
        },
        RequestHeader {
            length_bytes: 8,
            ..RequestHeader::new(Opcode::Bind, 9)
        },
        RequestHeader {
            version: 0xff,
            opcode_raw: 0xee,
            flags: RequestFlags::from_bits_retain(0xffff),
            request_id: u64::MAX,
            offset_bytes: u64::MAX,
            length_bytes: u32::MAX,
            namespace_id: u32::MAX,
        },
    ]
}

#[test]
fn request_headers_round_trip() {
    for header in sample_requests() {
        let bytes = header.to_bytes();
        assert_eq!(
            decode_request(&bytes),
            Ok(Some((header, REQUEST_HEADER_SIZE))),
            "{header:?}"
        );
        let mut out = [0u8; 40];
        assert_eq!(header.encode_into(&mut out), Ok(REQUEST_HEADER_SIZE));
        assert_eq!(out[..REQUEST_HEADER_SIZE], bytes);
    }
}

#[test]
fn response_headers_round_trip() {
    let request = RequestHeader::read(0x1122_3344_5566_7788, 1, 0, 4096);
    let headers = [
        ResponseHeader::for_request(&request, Status::Ok, 4096),
        ResponseHeader::for_request(&request, Status::OutOfRange, 0),
        ResponseHeader::notice(32),
        ResponseHeader::for_request(&request, Status::NoSpace, 0),
        ResponseHeader {
            opcode_raw: 0x77,
            status_raw: 0xffff,
            request_id: 0,
            length_bytes: u32::MAX,
        },
    ];
    for header in headers {
        let bytes = header.to_bytes();
        assert_eq!(
            decode_response(&bytes),
            Ok(Some((header, RESPONSE_HEADER_SIZE)))
        );
        let mut out = [0u8; RESPONSE_HEADER_SIZE];
        assert_eq!(header.encode_into(&mut out), Ok(RESPONSE_HEADER_SIZE));
        assert_eq!(out, bytes);
    }
    assert_eq!(headers[0].status(), Ok(Status::Ok));
    assert_eq!(headers[0].opcode(), Ok(Opcode::Read));
    assert_eq!(headers[0].request_id, request.request_id);
    assert_eq!(headers[2].request_id, NOTICE_REQUEST_ID);
    assert_eq!(headers[4].status(), Err(UnknownStatus(0xffff)));
    // Out of space travels as status 10 (bytes 6-7, little endian).
    let no_space = headers[3].to_bytes();
    assert_eq!(no_space[6..8], [10, 0]);
    assert_eq!(headers[3].status(), Ok(Status::NoSpace));
}

#[test]
fn encoders_refuse_short_buffers() {
    let mut short = [0u8; 10];
    let error = RequestHeader::flush(1, 1)
        .encode_into(&mut short)
        .unwrap_err();
    assert_eq!((error.needed_bytes, error.available_bytes), (32, 10));
    assert!(ResponseHeader::notice(0).encode_into(&mut short).is_err());
    let capabilities = Capabilities::from_limits(&ServerLimits::default(), 64);
    let mut out = [0u8; 35];
    assert!(
        capabilities
            .encode_into(&NAMESPACES[..1], &mut out)
            .is_err()
    );
}

#[test]
fn hello_body_round_trips() {
    for body in [
        HelloBody {
            version_max: 1,
            io_priority: 0,
        },
        HelloBody {
            version_max: 9,
            io_priority: (2 << 13) | 4,
        },
        HelloBody {
            version_max: u16::MAX,
            io_priority: u16::MAX,
        },
    ] {
        assert_eq!(HelloBody::decode(&body.to_bytes()), Ok(body));
    }
    let body = HelloBody {
        version_max: 1,
        io_priority: (1 << 13) | 3,
    };
    assert_eq!((body.io_priority_class(), body.io_priority_level()), (1, 3));
}

#[test]
fn capabilities_round_trip_with_0_1_3_and_256_namespaces() {
    let many: Vec<Namespace> = (0..256)
        .map(|index| Namespace {
            id: index,
            size_bytes: u64::from(index) << 20,
            read_only: index % 2 == 1,
        })
        .collect();
    let capabilities = Capabilities::from_limits(&ServerLimits::default(), 128);
    for namespaces in [&[][..], &NAMESPACES[..1], &NAMESPACES[..], &many[..]] {
        let mut out = vec![0u8; CAPABILITIES_SIZE_MAX];
        let length = capabilities.encode_into(namespaces, &mut out).unwrap();
        assert_eq!(length, Capabilities::encoded_size(namespaces.len()));
        let (decoded, entries) = Capabilities::decode(&out[..length]).unwrap();
        assert_eq!(decoded, capabilities);
        assert_eq!(entries.len(), namespaces.len());
        let entries: Vec<Namespace> = entries.map(Result::unwrap).collect();
        assert_eq!(entries, namespaces);
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation is "need more", never an error.

#[test]
fn every_truncated_header_needs_more() {
    for header in sample_requests() {
        let bytes = header.to_bytes();
        for length in 0..REQUEST_HEADER_SIZE {
            assert_eq!(decode_request(&bytes[..length]), Ok(None), "{length}");
        }
    }
    let bytes = ResponseHeader::notice(0).to_bytes();
    for length in 0..RESPONSE_HEADER_SIZE {
        assert_eq!(decode_response(&bytes[..length]), Ok(None), "{length}");
    }
    // Truncation wins even over a bad magic: framing is judged on a whole header.
    assert_eq!(decode_request(b"XXXX"), Ok(None));
}

// ---------------------------------------------------------------------------------------------
// Corruption: each field gives its own typed error.

#[test]
fn corrupted_request_magic_is_broken_framing() {
    let bytes = RequestHeader::read(1, 1, 0, 512).to_bytes();
    for index in 0..4 {
        let mut corrupted = bytes;
        corrupted[index] ^= 0x20;
        let found = u32::from_le_bytes(corrupted[..4].try_into().unwrap());
        assert_eq!(
            decode_request(&corrupted),
            Err(RequestError::BadMagic { found })
        );
    }
}

#[test]
fn corrupted_request_fields_decode_and_fail_validation_instead() {
    // Any field but the magic leaves framing intact: the header decodes and validation answers.
    let limits = ServerLimits::default();
    let bytes = RequestHeader::read(1, 1, 0, 512).to_bytes();
    let cases: [(usize, u8, Status); 5] = [
        (4, 2, Status::UnsupportedVersion),
        (5, 0x7f, Status::Invalid),
        (6, 0x02, Status::Invalid),
        (16, 0x01, Status::Invalid),
        (28, 0x09, Status::NoSuchNamespace),
    ];
    for (index, value, status) in cases {
        let mut corrupted = bytes;
        corrupted[index] = value;
        let (header, _) = decode_request(&corrupted).unwrap().unwrap();
        assert_eq!(
            validate_request(&header, &limits, &NAMESPACES[..]),
            Err(status),
            "byte {index}"
        );
    }
}

#[test]
fn corrupted_response_fields() {
    let bytes = ResponseHeader::new(2, Status::Ok, 5, 0).to_bytes();
    let mut magic = bytes;
    magic[3] = 0;
    assert_eq!(
        decode_response(&magic),
        Err(ResponseError::BadMagic { found: 0x0058_4652 })
    );
    let mut version = bytes;
    version[4] = 2;
    assert_eq!(
        decode_response(&version),
        Err(ResponseError::UnsupportedVersion { found: 2 })
    );
    let mut reserved = bytes;
    reserved[23] = 1;
    assert_eq!(
        decode_response(&reserved),
        Err(ResponseError::ReservedNotZero { found: 0x0100_0000 })
    );
    // The request's magic is not a response's.
    assert!(matches!(
        decode_response(&RequestHeader::flush(1, 1).to_bytes()),
        Err(ResponseError::BadMagic { .. })
    ));
}

#[test]
fn corrupted_hello_bodies() {
    let good = HelloBody {
        version_max: 1,
        io_priority: 0,
    }
    .to_bytes();
    assert_eq!(
        HelloBody::decode(&good[..15]),
        Err(BodyError::WrongLength {
            expected_bytes: 16,
            found_bytes: 15
        })
    );
    assert_eq!(
        HelloBody::decode(&[good.as_slice(), &[0]].concat()),
        Err(BodyError::WrongLength {
            expected_bytes: 16,
            found_bytes: 17
        })
    );
    let mut version = good;
    version[0] = 0;
    assert_eq!(HelloBody::decode(&version), Err(BodyError::VersionMaxZero));
    let mut flags = good;
    flags[5] = 1;
    assert_eq!(
        HelloBody::decode(&flags),
        Err(BodyError::UnknownFlags { found: 0x100 })
    );
    let mut reserved = good;
    reserved[15] = 1;
    assert_eq!(
        HelloBody::decode(&reserved),
        Err(BodyError::ReservedNotZero)
    );
}

#[test]
fn corrupted_capabilities_bodies() {
    let mut body = vec![0u8; CAPABILITIES_SIZE_MAX];
    let capabilities = Capabilities::from_limits(&ServerLimits::default(), 64);
    let length = capabilities
        .encode_into(&NAMESPACES[..2], &mut body)
        .unwrap();
    body.truncate(length);
    let check = |index: usize, value: u8, expected: BodyError| {
        let mut corrupted = body.clone();
        corrupted[index] = value;
        match Capabilities::decode(&corrupted) {
            Err(error) => assert_eq!(error, expected, "byte {index}"),
            Ok((_, mut entries)) => assert_eq!(
                entries.find_map(Result::err),
                Some(expected),
                "byte {index}"
            ),
        }
    };
    check(0, 2, BodyError::UnsupportedVersion { found: 2 });
    check(2, 1, BodyError::ReservedNotZero);
    check(4, 3, BodyError::BadBlockSize { found: 0x203 });
    check(
        8,
        1,
        BodyError::BadIoSizeMax {
            found: (1 << 20) + 1,
        },
    );
    check(
        16,
        1,
        BodyError::WrongLength {
            expected_bytes: 36,
            found_bytes: 52,
        },
    );
    check(17, 2, BodyError::TooManyNamespaces { count: 0x202 });
    check(24, 2, BodyError::UnknownFlags { found: 2 });
    assert_eq!(
        Capabilities::decode(&body[..19]).unwrap_err(),
        BodyError::WrongLength {
            expected_bytes: 20,
            found_bytes: 19
        }
    );
    assert_eq!(
        Capabilities::decode(&body[..51]).unwrap_err(),
        BodyError::WrongLength {
            expected_bytes: 52,
            found_bytes: 51
        }
    );
}

#[test]
fn capabilities_with_zero_window_is_refused() {
    let mut body = vec![0u8; CAPABILITIES_SIZE_MAX];
    let capabilities = Capabilities::from_limits(&ServerLimits::default(), 0);
    let length = capabilities.encode_into(&[], &mut body).unwrap();
    assert_eq!(
        Capabilities::decode(&body[..length]).unwrap_err(),
        BodyError::WindowZero
    );
}

// ---------------------------------------------------------------------------------------------
// Opcodes, statuses, flags.

#[test]
fn enums_convert_both_ways_and_refuse_unknown_values() {
    for value in 0..=u8::MAX {
        match Opcode::from_u8(value) {
            Ok(opcode) => assert_eq!(opcode.as_u8(), value),
            Err(error) => assert_eq!(error, UnknownOpcode(value)),
        }
    }
    let known: Vec<u8> = (0..=u8::MAX)
        .filter(|value| Opcode::from_u8(*value).is_ok())
        .collect();
    assert_eq!(
        known,
        [0x01, 0x02, 0x03, 0x04, 0x05, 0x10, 0x11, 0x12, 0x13, 0x20]
    );
    for value in 0..=u16::MAX {
        match Status::from_u16(value) {
            Ok(status) => assert_eq!(status.as_u16(), value),
            Err(error) => assert!(value > 10 && error == UnknownStatus(value)),
        }
    }
    assert_eq!(Status::from_u16(10), Ok(Status::NoSpace));
    assert_eq!(Status::NoSpace.as_u16(), 10);
    assert!(!Status::NoSpace.is_ok());
    assert_eq!(Status::NoSpace.to_string(), "no space left on device");
    assert!(RequestFlags::FUA.fua());
    assert_eq!(
        RequestFlags::from_bits_retain(0x8003).unknown_bits(),
        0x8002
    );
}

#[test]
fn payload_length_follows_the_opcode_whatever_the_validity() {
    let with = |opcode_raw: u8, version: u8| RequestHeader {
        version,
        opcode_raw,
        flags: RequestFlags::from_bits_retain(0xffff),
        request_id: 0,
        offset_bytes: 0,
        length_bytes: 777,
        namespace_id: 99,
    };
    for opcode_raw in 0..=u8::MAX {
        let expected = match opcode_raw {
            0x01 | 0x03 | 0x10 | 0x11 | 0x12 | 0x13 => 777,
            _ => 0,
        };
        assert_eq!(
            with(opcode_raw, 1).payload_length_bytes(),
            expected,
            "{opcode_raw:#x}"
        );
        assert_eq!(
            with(opcode_raw, 9).payload_length_bytes(),
            expected,
            "{opcode_raw:#x} v9"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Validation table.

fn describe(result: Result<ValidatedRequest, Status>) -> String {
    match result {
        Err(status) => format!("{status:?}"),
        Ok(ValidatedRequest::Hello) => "hello".into(),
        Ok(ValidatedRequest::Control {
            op,
            body_length_bytes,
        }) => format!("{op:?} {body_length_bytes}"),
        Ok(ValidatedRequest::Io(io)) => {
            let op = match io.op() {
                IoOp::Read => "read",
                IoOp::Write { fua: false } => "write",
                IoOp::Write { fua: true } => "write+fua",
                IoOp::Flush => "flush",
                IoOp::Trim => "trim",
            };
            assert_eq!(io.opcode().as_u8(), op_code(op));
            format!(
                "{op} ns{} {}+{} id{}",
                io.namespace_id(),
                io.offset_bytes(),
                io.length_bytes(),
                io.request_id()
            )
        }
    }
}

fn op_code(op: &str) -> u8 {
    match op {
        "read" => 2,
        "write" | "write+fua" => 3,
        "flush" => 4,
        _ => 5,
    }
}

fn check(header: RequestHeader, limits: ServerLimits, expected: &str) {
    let actual = describe(validate_request(&header, &limits, &NAMESPACES[..]));
    assert_eq!(actual, expected, "{header:?}");
}

#[test]
fn validation_table() {
    let limits = ServerLimits::default();
    let mib = 1u32 << 20;
    let gib = 1u64 << 30;
    let h = RequestHeader::read;
    let cases: Vec<(RequestHeader, &str)> = vec![
        // Valid requests of every kind.
        (h(1, 1, 0, 4096), "read ns1 0+4096 id1"),
        (h(2, 1, gib - 512, 512), "read ns1 1073741312+512 id2"),
        (h(3, 1, 0, mib), "read ns1 0+1048576 id3"),
        (
            RequestHeader::write(4, 1, 512, 1024, false),
            "write ns1 512+1024 id4",
        ),
        (
            RequestHeader::write(5, 1, 512, 1024, true),
            "write+fua ns1 512+1024 id5",
        ),
        (RequestHeader::flush(6, 1), "flush ns1 0+0 id6"),
        (RequestHeader::flush(6, 2), "flush ns2 0+0 id6"),
        (
            RequestHeader::trim(7, 1, 0, 1 << 29),
            "trim ns1 0+536870912 id7",
        ),
        (
            RequestHeader::trim(7, 7, 0, 1 << 31),
            "trim ns7 0+2147483648 id7",
        ),
        (RequestHeader::hello(8), "hello"),
        (
            RequestHeader {
                length_bytes: 4096,
                ..RequestHeader::new(Opcode::Register, 9)
            },
            "Register 4096",
        ),
        (
            RequestHeader {
                length_bytes: 0,
                ..RequestHeader::new(Opcode::Bind, 9)
            },
            "Bind 0",
        ),
        (
            RequestHeader {
                length_bytes: 8,
                ..RequestHeader::new(Opcode::Unregister, 9)
            },
            "Unregister 8",
        ),
        // 1. Version first, even before an unknown opcode.
        (
            RequestHeader {
                version: 2,
                opcode_raw: 0x99,
                ..h(1, 1, 0, 512)
            },
            "UnsupportedVersion",
        ),
        (
            RequestHeader {
                version: 0,
                ..h(1, 1, 0, 512)
            },
            "UnsupportedVersion",
        ),
        // 2. Opcode.
        (
            RequestHeader {
                opcode_raw: 0x00,
                ..h(1, 1, 0, 512)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                opcode_raw: 0x06,
                ..h(1, 1, 0, 512)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                opcode_raw: 0x20,
                ..h(1, 1, 0, 512)
            },
            "Invalid",
        ),
        // 3. Flags, before the namespace.
        (
            RequestHeader {
                flags: RequestFlags::FUA,
                ..h(1, 99, 0, 512)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                flags: RequestFlags::FUA,
                ..RequestHeader::flush(1, 1)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                flags: RequestFlags::from_bits_retain(2),
                ..RequestHeader::write(1, 1, 0, 512, false)
            },
            "Invalid",
        ),
        // 4. Control bodies.
        (
            RequestHeader {
                length_bytes: 15,
                ..RequestHeader::hello(1)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                length_bytes: 17,
                ..RequestHeader::hello(1)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                length_bytes: 4097,
                ..RequestHeader::new(Opcode::Register, 1)
            },
            "TooLarge",
        ),
        // 5. Namespace.
        (h(1, 0, 0, 512), "NoSuchNamespace"),
        (RequestHeader::flush(1, 3), "NoSuchNamespace"),
        (RequestHeader::write(1, 3, 0, 0, false), "NoSuchNamespace"),
        // 6. Permission, before range checks.
        (RequestHeader::write(1, 2, 0, 512, false), "Permission"),
        (RequestHeader::write(1, 2, 1 << 40, 3, true), "Permission"),
        (RequestHeader::trim(1, 2, 0, 512), "Permission"),
        (h(1, 2, 0, 512), "read ns2 0+512 id1"),
        // 7. FLUSH carries no range.
        (
            RequestHeader {
                offset_bytes: 512,
                ..RequestHeader::flush(1, 1)
            },
            "Invalid",
        ),
        (
            RequestHeader {
                length_bytes: 512,
                ..RequestHeader::flush(1, 1)
            },
            "Invalid",
        ),
        // 8. Zero length.
        (h(1, 1, 0, 0), "Invalid"),
        (RequestHeader::write(1, 1, 0, 0, false), "Invalid"),
        (RequestHeader::trim(1, 1, 0, 0), "Invalid"),
        // 9. Too large (READ/WRITE only), before alignment.
        (h(1, 1, 0, mib + 512), "TooLarge"),
        (h(1, 1, 0, mib + 1), "TooLarge"),
        (RequestHeader::write(1, 1, 0, u32::MAX, false), "TooLarge"),
        (
            RequestHeader::trim(1, 1, 0, mib + 512),
            "trim ns1 0+1049088 id1",
        ),
        // 10. Alignment.
        (h(1, 1, 1, 512), "Invalid"),
        (h(1, 1, 0, 513), "Invalid"),
        (RequestHeader::trim(1, 1, 256, 512), "Invalid"),
        // 11. Range.
        (h(1, 1, gib, 512), "OutOfRange"),
        (h(1, 1, gib - 512, 1024), "OutOfRange"),
        (h(1, 1, u64::MAX - 511, 512), "OutOfRange"),
        (
            h(1, 7, u64::MAX - 1023, 512),
            "read ns7 18446744073709550592+512 id1",
        ),
        (h(1, 7, u64::MAX - 511, 512), "OutOfRange"),
        (RequestHeader::trim(1, 2, 0, 512), "Permission"),
    ];
    for (header, expected) in cases {
        check(header, limits, expected);
    }
    // A server with 4 KiB blocks and 128 KiB maximum.
    let small = ServerLimits::new(4096, 128 << 10).unwrap();
    check(h(1, 1, 512, 4096), small, "Invalid");
    check(h(1, 1, 4096, 4096), small, "read ns1 4096+4096 id1");
    check(h(1, 1, 0, 132 << 10), small, "TooLarge");
}

#[test]
fn limits_are_checked_at_construction() {
    assert_eq!(
        ServerLimits::new(256, 1 << 20),
        Err(LimitsError::BlockSize(256))
    );
    assert_eq!(
        ServerLimits::new(1000, 1 << 20),
        Err(LimitsError::BlockSize(1000))
    );
    assert_eq!(ServerLimits::new(512, 0), Err(LimitsError::IoSizeMax(0)));
    assert_eq!(
        ServerLimits::new(4096, 6144),
        Err(LimitsError::IoSizeMax(6144))
    );
    assert_eq!(ServerLimits::new(512, 1 << 20), Ok(ServerLimits::default()));
}

// ---------------------------------------------------------------------------------------------
// Pipelining: many requests parsed out of one buffer, payloads skipped by length.

#[test]
fn pipelined_requests_parse_out_of_one_buffer() {
    let mut stream = Vec::new();
    let requests = [
        (RequestHeader::write(1, 1, 0, 1024, false), vec![0xaa; 1024]),
        (RequestHeader::read(2, 1, 0, 512), vec![]),
        // Invalid (read-only namespace) but its payload is still there and must be skipped.
        (RequestHeader::write(3, 2, 0, 512, false), vec![0xbb; 512]),
        // Unknown opcode with a length: no payload follows it.
        (
            RequestHeader {
                opcode_raw: 0x42,
                length_bytes: 4096,
                ..RequestHeader::new(Opcode::Read, 4)
            },
            vec![],
        ),
        (
            RequestHeader::hello(5),
            HelloBody {
                version_max: 1,
                io_priority: 0,
            }
            .to_bytes()
            .to_vec(),
        ),
        (RequestHeader::flush(6, 1), vec![]),
    ];
    for (header, payload) in &requests {
        stream.extend_from_slice(&header.to_bytes());
        stream.extend_from_slice(payload);
    }
    let limits = ServerLimits::default();
    let mut position = 0;
    let mut seen = Vec::new();
    while let Some((header, header_bytes)) = decode_request(&stream[position..]).unwrap() {
        position += header_bytes;
        let payload_bytes = header.payload_length_bytes() as usize;
        let payload = &stream[position..position + payload_bytes];
        position += payload_bytes;
        let result = validate_request(&header, &limits, &NAMESPACES[..]);
        if result == Ok(ValidatedRequest::Hello) {
            assert_eq!(
                HelloBody::decode(payload),
                Ok(HelloBody {
                    version_max: 1,
                    io_priority: 0
                })
            );
        }
        seen.push((header.request_id, result.map(|_| ())));
    }
    assert_eq!(position, stream.len());
    assert_eq!(
        seen,
        [
            (1, Ok(())),
            (2, Ok(())),
            (3, Err(Status::Permission)),
            (4, Err(Status::Invalid)),
            (5, Ok(())),
            (6, Ok(()))
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// The examples printed in docs/PROTOCOL.md §1.8.

#[test]
fn documented_hello_example() {
    let request = RequestHeader::hello(1);
    let body = HelloBody {
        version_max: 1,
        io_priority: (2 << 13) | 4,
    };
    assert_eq!(
        hex(&request.to_bytes()),
        "52 46 58 51 01 01 00 00 01 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 10 00 00 00 00 00 00 00"
    );
    assert_eq!(
        hex(&body.to_bytes()),
        "01 00 04 40 00 00 00 00 00 00 00 00 00 00 00 00"
    );
    let capabilities = Capabilities::from_limits(&ServerLimits::default(), 128);
    let namespaces = [Namespace {
        id: 1,
        size_bytes: 1 << 30,
        read_only: false,
    }];
    let mut out = [0u8; 64];
    let length = capabilities.encode_into(&namespaces, &mut out).unwrap();
    let response = ResponseHeader::for_request(&request, Status::Ok, length as u32);
    assert_eq!(
        hex(&response.to_bytes()),
        "52 46 58 52 01 01 00 00 01 00 00 00 00 00 00 00 24 00 00 00 00 00 00 00"
    );
    assert_eq!(
        hex(&out[..length]),
        "01 00 00 00 00 02 00 00 00 00 10 00 80 00 00 00 01 00 00 00 \
         01 00 00 00 00 00 00 00 00 00 00 40 00 00 00 00"
    );
}

#[test]
fn documented_read_example() {
    let request = RequestHeader::read(7, 1, 4096, 4096);
    assert_eq!(
        hex(&request.to_bytes()),
        "52 46 58 51 01 02 00 00 07 00 00 00 00 00 00 00 00 10 00 00 00 00 00 00 00 10 00 00 01 00 00 00"
    );
    let ok = ResponseHeader::for_request(&request, Status::Ok, 4096);
    assert_eq!(
        hex(&ok.to_bytes()),
        "52 46 58 52 01 02 00 00 07 00 00 00 00 00 00 00 00 10 00 00 00 00 00 00"
    );
    let beyond = RequestHeader::read(8, 1, 1 << 30, 4096);
    let status = validate_request(&beyond, &ServerLimits::default(), &NAMESPACES[..]).unwrap_err();
    let error = ResponseHeader::for_request(&beyond, status, 0);
    assert_eq!(
        hex(&error.to_bytes()),
        "52 46 58 52 01 02 02 00 08 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00"
    );
}

// ---------------------------------------------------------------------------------------------
// Tenant bodies (§1.9).

fn lc(latency_us_p95: u32, iops: u64, read_percent: u8) -> TenantClassRequest {
    TenantClassRequest::LatencyCritical {
        latency_us_p95,
        iops,
        read_percent,
    }
}

#[test]
fn register_bodies_round_trip() {
    let bodies = [
        RegisterBody {
            namespace_id: 1,
            class: lc(500, 12_000, 100),
            read_only: false,
            handle: NO_TENANT_HANDLE,
        },
        RegisterBody {
            namespace_id: u32::MAX,
            class: lc(u32::MAX, u64::MAX, 0),
            read_only: true,
            handle: u64::MAX,
        },
        RegisterBody {
            namespace_id: 7,
            class: TenantClassRequest::BestEffort,
            read_only: true,
            handle: 42,
        },
    ];
    for body in bodies {
        let bytes = body.to_bytes();
        assert_eq!(RegisterBody::decode(&bytes), Ok(body));
    }
}

#[test]
fn corrupted_register_bodies() {
    let good = RegisterBody {
        namespace_id: 1,
        class: lc(500, 70_000, 80),
        read_only: false,
        handle: 0,
    }
    .to_bytes();
    let check = |at: usize, value: u8, expected: BodyError| {
        let mut bytes = good;
        bytes[at] = value;
        assert_eq!(
            RegisterBody::decode(&bytes),
            Err(expected),
            "byte {at} = {value}"
        );
    };
    check(0, 0, BodyError::UnknownClass { found: 0 });
    check(0, 3, BodyError::UnknownClass { found: 3 });
    check(
        1,
        101,
        BodyError::InvalidTenant {
            reason: "read percentage above 100",
        },
    );
    check(2, 2, BodyError::UnknownFlags { found: 2 });
    check(3, 1, BodyError::UnknownFlags { found: 0x100 });
    check(12, 1, BodyError::ReservedNotZero);
    let mut zero_latency = good;
    zero_latency[8..12].fill(0);
    assert_eq!(
        RegisterBody::decode(&zero_latency),
        Err(BodyError::InvalidTenant {
            reason: "latency SLO of 0 µs"
        })
    );
    let mut zero_iops = good;
    zero_iops[16..24].fill(0);
    assert_eq!(
        RegisterBody::decode(&zero_iops),
        Err(BodyError::InvalidTenant {
            reason: "reservation of 0 IOPS"
        })
    );
    // A best-effort tenant carries no SLO.
    let mut best_effort_with_slo = good;
    best_effort_with_slo[0] = 2;
    assert_eq!(
        RegisterBody::decode(&best_effort_with_slo),
        Err(BodyError::InvalidTenant {
            reason: "best-effort tenant with an SLO"
        })
    );
    for length in [0, 31, 33] {
        let bytes = vec![0u8; length];
        assert_eq!(
            RegisterBody::decode(&bytes),
            Err(BodyError::WrongLength {
                expected_bytes: REGISTER_BODY_SIZE,
                found_bytes: length
            })
        );
    }
}

#[test]
fn handle_and_renegotiate_bodies() {
    for handle in [0, 1, u64::MAX] {
        assert_eq!(decode_handle(&encode_handle(handle)), Ok(handle));
    }
    assert_eq!(
        decode_handle(&[1, 2, 3]),
        Err(BodyError::WrongLength {
            expected_bytes: HANDLE_BODY_SIZE,
            found_bytes: 3
        })
    );
    let notice = RenegotiateBody {
        handle: 9,
        episode: 3,
        reserved_iops: 7_000,
        reserved_tokens_per_sec: 19_838,
        observed_iops: 21_000,
        reason: RenegotiateReason::DeviceSlower,
        granted_tokens_per_sec: 15_000,
    };
    assert_eq!(RenegotiateBody::decode(&notice.to_bytes()), Ok(notice));
    let mut unknown_reason = notice.to_bytes();
    unknown_reason[40] = 9;
    assert!(RenegotiateBody::decode(&unknown_reason).is_err());
    let mut reserved_bytes = notice.to_bytes();
    reserved_bytes[44] = 1;
    assert!(RenegotiateBody::decode(&reserved_bytes).is_err());
    let mut no_tenant = notice.to_bytes();
    no_tenant[..8].fill(0);
    assert!(matches!(
        RenegotiateBody::decode(&no_tenant),
        Err(BodyError::InvalidTenant { .. })
    ));
    assert!(RenegotiateBody::decode(&notice.to_bytes()[..55]).is_err());
}

#[test]
fn report_bodies_round_trip_and_refuse_other_lengths() {
    for report in [
        ReportBody::default(),
        ReportBody {
            reads: 612,
            read_p95_us: 487,
            backlog: 35,
        },
        ReportBody {
            reads: u32::MAX,
            read_p95_us: u32::MAX,
            backlog: u32::MAX,
        },
    ] {
        assert_eq!(ReportBody::decode(&report.to_bytes()), Ok(report));
    }
    assert_eq!(
        ReportBody {
            reads: 1,
            read_p95_us: 0x0102_0304,
            backlog: 0x0a0b_0c0d,
        }
        .to_bytes(),
        [1, 0, 0, 0, 4, 3, 2, 1, 0x0d, 0x0c, 0x0b, 0x0a, 0, 0, 0, 0]
    );
    // The first body, without the backlog, is still understood: a backlog of 0.
    assert_eq!(
        ReportBody::decode(&[1, 0, 0, 0, 4, 3, 2, 1]),
        Ok(ReportBody {
            reads: 1,
            read_p95_us: 0x0102_0304,
            backlog: 0,
        })
    );
    let mut reserved = ReportBody::default().to_bytes();
    reserved[15] = 1;
    assert_eq!(
        ReportBody::decode(&reserved),
        Err(BodyError::ReservedNotZero)
    );
    for length in [0, 7, 9, 15, 17] {
        assert_eq!(
            ReportBody::decode(&vec![0; length]),
            Err(BodyError::WrongLength {
                expected_bytes: REPORT_BODY_SIZE,
                found_bytes: length
            })
        );
    }
    let header = RequestHeader {
        length_bytes: REPORT_BODY_SIZE as u32,
        ..RequestHeader::new(Opcode::Report, 4)
    };
    assert_eq!(
        validate_request(&header, &ServerLimits::default(), &NAMESPACES[..]),
        Ok(ValidatedRequest::Control {
            op: ControlOp::Report,
            body_length_bytes: 16
        })
    );
    let oversized = RequestHeader {
        length_bytes: CONTROL_BODY_MAX_BYTES + 1,
        ..header
    };
    assert_eq!(
        validate_request(&oversized, &ServerLimits::default(), &NAMESPACES[..]),
        Err(Status::TooLarge)
    );
}

#[test]
fn control_requests_validate_without_a_namespace() {
    let body = RegisterBody {
        namespace_id: 99,
        class: TenantClassRequest::BestEffort,
        read_only: false,
        handle: 0,
    }
    .to_bytes();
    let header = RequestHeader {
        length_bytes: body.len() as u32,
        ..RequestHeader::new(Opcode::Register, 3)
    };
    // The body's namespace is the server's business, not the header's.
    assert_eq!(
        validate_request(&header, &ServerLimits::default(), &NAMESPACES[..]),
        Ok(ValidatedRequest::Control {
            op: ControlOp::Register,
            body_length_bytes: 32
        })
    );
    assert_eq!(header.payload_length_bytes(), 32);
}

#[test]
fn documented_register_example() {
    let header = RequestHeader {
        length_bytes: REGISTER_BODY_SIZE as u32,
        ..RequestHeader::new(Opcode::Register, 2)
    };
    let body = RegisterBody {
        namespace_id: 1,
        class: lc(500, 12_000, 100),
        read_only: false,
        handle: NO_TENANT_HANDLE,
    };
    assert_eq!(
        hex(&header.to_bytes()),
        "52 46 58 51 01 10 00 00 02 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 00 00 00 00 00 00 00"
    );
    assert_eq!(
        hex(&body.to_bytes()),
        "01 64 00 00 01 00 00 00 f4 01 00 00 00 00 00 00 e0 2e 00 00 00 00 00 00 00 00 00 00 00 00 00 00"
    );
    let accepted = ResponseHeader::for_request(&header, Status::Ok, HANDLE_BODY_SIZE as u32);
    assert_eq!(
        hex(&accepted.to_bytes()),
        "52 46 58 52 01 10 00 00 02 00 00 00 00 00 00 00 08 00 00 00 00 00 00 00"
    );
    assert_eq!(hex(&encode_handle(1)), "01 00 00 00 00 00 00 00");
    let reason = "needs 36K tokens/s, 5K left at 500 µs";
    let refused = ResponseHeader::for_request(&header, Status::Refused, reason.len() as u32);
    assert_eq!(
        hex(&refused.to_bytes()),
        "52 46 58 52 01 10 09 00 02 00 00 00 00 00 00 00 26 00 00 00 00 00 00 00"
    );
    let notice = ResponseHeader::notice(RENEGOTIATE_BODY_SIZE as u32);
    assert_eq!(
        hex(&notice.to_bytes()),
        "52 46 58 52 01 20 00 00 ff ff ff ff ff ff ff ff 38 00 00 00 00 00 00 00"
    );
    let body = RenegotiateBody {
        handle: 1,
        episode: 1,
        reserved_iops: 12_000,
        reserved_tokens_per_sec: 12_000,
        observed_iops: 20_000,
        reason: RenegotiateReason::DeficitLimit,
        granted_tokens_per_sec: 12_000,
    };
    assert_eq!(
        hex(&body.to_bytes()),
        "01 00 00 00 00 00 00 00 01 00 00 00 00 00 00 00 e0 2e 00 00 00 00 00 00 \
         e0 2e 00 00 00 00 00 00 20 4e 00 00 00 00 00 00 01 00 00 00 00 00 00 00 \
         e0 2e 00 00 00 00 00 00"
    );
}
