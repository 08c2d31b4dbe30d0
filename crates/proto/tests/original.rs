//! The original ReFlex block protocol: round trips, truncation, corruption, and the validation
//! table (including the original server's 1 MiB off-by-one, which must not recur).

use reflex_proto::original::*;

const GIB: u64 = 1 << 30;

fn header(opcode: Opcode, lba: u64, lba_count: u32) -> Header {
    Header {
        opcode,
        handle: *b"cookie!!",
        lba,
        lba_count,
    }
}

#[test]
fn headers_round_trip() {
    for header in [
        header(Opcode::Read, 0, 8),
        header(Opcode::Write, 123_456, 2048),
        Header {
            opcode: Opcode::Write,
            handle: [0xff; 8],
            lba: u64::MAX,
            lba_count: u32::MAX,
        },
    ] {
        let bytes = header.to_bytes();
        assert_eq!(Header::decode(&bytes), Ok(Some((header, HEADER_SIZE))));
        let mut out = [0u8; 30];
        assert_eq!(header.encode_into(&mut out), Ok(HEADER_SIZE));
        assert_eq!(out[..HEADER_SIZE], bytes);
    }
    assert!(
        header(Opcode::Read, 0, 1)
            .encode_into(&mut [0u8; 23])
            .is_err()
    );
}

#[test]
fn wire_layout_matches_the_packed_c_struct() {
    let bytes = Header {
        opcode: Opcode::Write,
        handle: [1, 2, 3, 4, 5, 6, 7, 8],
        lba: 0x1122,
        lba_count: 8,
    }
    .to_bytes();
    assert_eq!(
        bytes,
        [
            24, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0x22, 0x11, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0
        ]
    );
}

#[test]
fn every_truncated_header_needs_more() {
    let bytes = header(Opcode::Write, 7, 8).to_bytes();
    for length in 0..HEADER_SIZE {
        assert_eq!(Header::decode(&bytes[..length]), Ok(None), "{length}");
    }
}

#[test]
fn corrupted_fields_give_typed_errors() {
    let bytes = header(Opcode::Read, 7, 8).to_bytes();
    let mut magic = bytes;
    magic[0] = 25;
    assert_eq!(
        Header::decode(&magic),
        Err(DecodeError::BadMagic { found: 25 })
    );
    let mut magic_high = bytes;
    magic_high[1] = 1;
    assert_eq!(
        Header::decode(&magic_high),
        Err(DecodeError::BadMagic { found: 0x118 })
    );
    for opcode in [2u16, 3, 0x100, u16::MAX] {
        let mut corrupted = bytes;
        corrupted[2..4].copy_from_slice(&opcode.to_le_bytes());
        assert_eq!(
            Header::decode(&corrupted),
            Err(DecodeError::UnknownOpcode { found: opcode })
        );
    }
    // Magic is checked before the opcode.
    let mut both = bytes;
    both[0] = 0;
    both[2] = 9;
    assert_eq!(
        Header::decode(&both),
        Err(DecodeError::BadMagic { found: 0 })
    );
}

#[test]
fn payload_lengths() {
    assert_eq!(header(Opcode::Read, 0, 8).request_payload_length_bytes(), 0);
    assert_eq!(
        header(Opcode::Write, 0, 8).request_payload_length_bytes(),
        4096
    );
    assert_eq!(
        header(Opcode::Write, 0, u32::MAX).request_payload_length_bytes(),
        u64::from(u32::MAX) * 512
    );
    assert_eq!(
        header(Opcode::Read, 0, 8).response_payload_length_bytes(),
        4096
    );
    assert_eq!(
        header(Opcode::Write, 0, 8).response_payload_length_bytes(),
        0
    );
}

fn describe(result: Result<ValidatedIo, Invalid>) -> String {
    match result {
        Err(invalid) => format!("{invalid:?}"),
        Ok(io) => {
            let response = io.response_header();
            assert_eq!(response.handle, io.handle());
            format!(
                "{:?} {}+{} response_count={}",
                io.opcode(),
                io.offset_bytes(),
                io.length_bytes(),
                response.lba_count
            )
        }
    }
}

fn check(header: Header, limits: Limits, namespace_size_bytes: u64, expected: &str) {
    assert_eq!(
        describe(validate(&header, &limits, namespace_size_bytes)),
        expected,
        "{header:?}"
    );
}

#[test]
fn validation_table() {
    let limits = Limits::default();
    let cases = [
        (header(Opcode::Read, 0, 8), "Read 0+4096 response_count=8"),
        (
            header(Opcode::Write, 8, 8),
            "Write 4096+4096 response_count=0",
        ),
        (header(Opcode::Read, 1, 1), "Read 512+512 response_count=1"),
        // Exactly 1 MiB is allowed; one sector more is not (the original let it through).
        (
            header(Opcode::Read, 0, 2048),
            "Read 0+1048576 response_count=2048",
        ),
        (
            header(Opcode::Write, 0, 2049),
            "TooLarge { length_bytes: 1049088, io_size_max_bytes: 1048576 }",
        ),
        (
            header(Opcode::Read, 0, u32::MAX),
            "TooLarge { length_bytes: 2199023255040, io_size_max_bytes: 1048576 }",
        ),
        (header(Opcode::Read, 0, 0), "ZeroLength"),
        (header(Opcode::Write, 0, 0), "ZeroLength"),
        // The last sector, and one past it.
        (
            header(Opcode::Read, GIB / 512 - 1, 1),
            "Read 1073741312+512 response_count=1",
        ),
        (
            header(Opcode::Read, GIB / 512, 1),
            "OutOfRange { lba: 2097152, lba_count: 1, namespace_size_bytes: 1073741824 }",
        ),
        (
            header(Opcode::Read, GIB / 512 - 1, 2),
            "OutOfRange { lba: 2097151, lba_count: 2, namespace_size_bytes: 1073741824 }",
        ),
        // lba × 512 overflows u64.
        (
            header(Opcode::Read, u64::MAX / 256, 1),
            "OutOfRange { lba: 72057594037927935, lba_count: 1, namespace_size_bytes: 1073741824 }",
        ),
    ];
    for (header, expected) in cases {
        check(header, limits, GIB, expected);
    }
    // A backend that needs 4 KiB alignment (O_DIRECT on a 4Kn device).
    let aligned = Limits {
        io_size_max_bytes: 1 << 20,
        alignment_bytes: 4096,
    };
    check(
        header(Opcode::Read, 8, 8),
        aligned,
        GIB,
        "Read 4096+4096 response_count=8",
    );
    check(
        header(Opcode::Read, 1, 8),
        aligned,
        GIB,
        "Misaligned { offset_bytes: 512, length_bytes: 4096, alignment_bytes: 4096 }",
    );
    check(
        header(Opcode::Read, 8, 1),
        aligned,
        GIB,
        "Misaligned { offset_bytes: 4096, length_bytes: 512, alignment_bytes: 4096 }",
    );
    // A namespace whose size is not a whole number of sectors: the partial sector is unreachable.
    check(
        header(Opcode::Read, 0, 1),
        limits,
        1000,
        "Read 0+512 response_count=1",
    );
    check(
        header(Opcode::Read, 1, 1),
        limits,
        1000,
        "OutOfRange { lba: 1, lba_count: 1, namespace_size_bytes: 1000 }",
    );
}
