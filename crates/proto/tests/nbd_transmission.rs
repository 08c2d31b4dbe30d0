//! NBD transmission: request round trips, truncation, corruption, the validation table against
//! the spec's error rules, and byte-exact reply headers.

use reflex_proto::nbd::*;

const SIZE: u64 = 1 << 30;
const FUA: u16 = 1;
const NO_HOLE: u16 = 2;
const DF: u16 = 4;
const REQ_ONE: u16 = 8;
const FAST_ZERO: u16 = 16;

fn request(command_raw: u16, flags: u16, offset_bytes: u64, length_bytes: u32) -> RequestHeader {
    RequestHeader {
        flags,
        command_raw,
        cookie: 0xc0ff_ee00_0000_0001,
        offset_bytes,
        length_bytes,
    }
}

/// Constraints stricter than the defaults, which the client agreed to (GO with
/// `NBD_INFO_BLOCK_SIZE`): requests are held to them.
fn strict() -> BlockSizes {
    BlockSizes {
        minimum_bytes: 512,
        preferred_bytes: 4096,
        maximum_bytes: 1 << 20,
    }
}

fn writable() -> Session {
    let export = Export::new("disk", SIZE).with_block_sizes(strict());
    Session::new(0, &export, false).with_block_sizes_agreed(true)
}

fn read_only() -> Session {
    let export = Export::new("archive", SIZE)
        .with_block_sizes(strict())
        .read_only();
    Session::new(1, &export, false).with_block_sizes_agreed(true)
}

/// The default export, with a client that did not negotiate block sizes: any byte, up to
/// 32 MiB.
fn unnegotiated() -> Session {
    Session::new(0, &Export::new("disk", SIZE), false)
}

/// Structured replies and `base:allocation` selected.
fn with_block_status() -> Session {
    Session::new(0, &Export::new("disk", SIZE), true).with_base_allocation(true)
}

#[test]
fn request_headers_round_trip_and_match_the_spec_layout() {
    let header = request(1, FUA, 0x0102_0304_0506_0708, 0x1122_3344);
    let bytes = header.to_bytes();
    assert_eq!(
        bytes,
        [
            0x25, 0x60, 0x95, 0x13, 0x00, 0x01, 0x00, 0x01, 0xc0, 0xff, 0xee, 0, 0, 0, 0, 1, 1, 2,
            3, 4, 5, 6, 7, 8, 0x11, 0x22, 0x33, 0x44
        ]
    );
    assert_eq!(decode_request(&bytes), Ok(Some((header, 28))));
    let odd = RequestHeader {
        flags: u16::MAX,
        command_raw: u16::MAX,
        cookie: 0,
        offset_bytes: u64::MAX,
        length_bytes: 0,
    };
    assert_eq!(decode_request(&odd.to_bytes()), Ok(Some((odd, 28))));
}

#[test]
fn every_truncated_request_needs_more_and_a_bad_magic_is_framing() {
    let bytes = request(0, 0, 0, 4096).to_bytes();
    for length in 0..28 {
        assert_eq!(decode_request(&bytes[..length]), Ok(None), "{length}");
    }
    for index in 0..4 {
        let mut corrupted = bytes;
        corrupted[index] ^= 1;
        let found = u32::from_be_bytes(corrupted[..4].try_into().unwrap());
        assert_eq!(
            decode_request(&corrupted),
            Err(RequestError::BadMagic { found })
        );
    }
    // The historic request magic is not accepted.
    let mut historic = bytes;
    historic[..4].copy_from_slice(&0x1256_0953u32.to_be_bytes());
    assert!(decode_request(&historic).is_err());
}

#[test]
fn write_payload_is_announced_for_every_write_however_invalid() {
    for command_raw in 0..=20u16 {
        for flags in [0, FUA, 0xffff] {
            let header = request(command_raw, flags, u64::MAX, 12345);
            let expected = if command_raw == 1 { 12345 } else { 0 };
            assert_eq!(header.payload_length_bytes(), expected);
        }
    }
    // A write to a read-only export is refused, and its payload is still to be consumed.
    let header = request(1, 0, 0, 4096);
    assert_eq!(read_only().validate(&header), Err(Errno::Perm));
    assert_eq!(header.payload_length_bytes(), 4096);
}

fn describe(result: Result<ValidatedCommand, Errno>) -> String {
    match result {
        Err(errno) => format!("E{errno:?}"),
        Ok(validated) => {
            assert_eq!(validated.cookie(), 0xc0ff_ee00_0000_0001);
            format!("{:?}", validated.command())
        }
    }
}

fn check(session: Session, header: RequestHeader, expected: &str) {
    assert_eq!(describe(session.validate(&header)), expected, "{header:?}");
}

#[test]
fn validation_table() {
    let w = writable();
    let r = read_only();
    let mib = 1u32 << 20;
    let cases: Vec<(Session, RequestHeader, &str)> = vec![
        // Valid commands.
        (
            w,
            request(0, 0, 0, 4096),
            "Read { offset_bytes: 0, length_bytes: 4096 }",
        ),
        (
            w,
            request(0, FUA, 512, 512),
            "Read { offset_bytes: 512, length_bytes: 512 }",
        ),
        (
            w,
            request(0, 0, SIZE - 512, 512),
            "Read { offset_bytes: 1073741312, length_bytes: 512 }",
        ),
        (
            w,
            request(0, 0, 0, mib),
            "Read { offset_bytes: 0, length_bytes: 1048576 }",
        ),
        (
            w,
            request(1, 0, 4096, 8192),
            "Write { offset_bytes: 4096, length_bytes: 8192, fua: false }",
        ),
        (
            w,
            request(1, FUA, 4096, 8192),
            "Write { offset_bytes: 4096, length_bytes: 8192, fua: true }",
        ),
        (w, request(3, 0, 0, 0), "Flush"),
        (w, request(3, FUA, 0, 0), "Flush"),
        (
            w,
            request(4, 0, 0, 1 << 30),
            "Trim { offset_bytes: 0, length_bytes: 1073741824, fua: false }",
        ),
        (
            w,
            request(6, NO_HOLE | FUA, 512, 4 * mib),
            "WriteZeroes { offset_bytes: 512, length_bytes: 4194304, fua: true, no_hole: true, fast_zero: false }",
        ),
        (
            w,
            request(6, 0, 0, 512),
            "WriteZeroes { offset_bytes: 0, length_bytes: 512, fua: false, no_hole: false, fast_zero: false }",
        ),
        (
            r,
            request(0, 0, 0, 512),
            "Read { offset_bytes: 0, length_bytes: 512 }",
        ),
        (r, request(3, 0, 0, 0), "Flush"),
        // 1. DISC wins over everything.
        (w, request(2, 0xffff, 77, 77), "Disconnect"),
        (r, request(2, 0, 0, 0), "Disconnect"),
        (
            w,
            request(6, FAST_ZERO, 0, 512),
            "WriteZeroes { offset_bytes: 0, length_bytes: 512, fua: false, no_hole: false, fast_zero: true }",
        ),
        (
            w,
            request(5, 0, 0, 512),
            "Cache { offset_bytes: 0, length_bytes: 512 }",
        ),
        (
            r,
            request(5, FUA, 0, 512),
            "Cache { offset_bytes: 0, length_bytes: 512 }",
        ),
        // 2. Unknown and unsupported commands (BLOCK_STATUS without a metadata context).
        (w, request(7, 0, 0, 512), "EInval"),
        (w, request(8, 0, 0, 0), "EInval"),
        (w, request(9, 0, 0, 512), "EInval"),
        (w, request(0xffff, 0, 0, 512), "EInval"),
        // 3. Writes of any kind on a read-only export, before other checks.
        (r, request(1, 0, 0, 512), "EPerm"),
        (r, request(1, DF, SIZE, 0), "EPerm"),
        (r, request(4, 0, 0, 512), "EPerm"),
        (r, request(6, NO_HOLE, 0, 512), "EPerm"),
        // 5. Flags that do not apply.
        (w, request(0, NO_HOLE, 0, 512), "EInval"),
        (w, request(0, DF, 0, 512), "EInval"),
        (w, request(1, NO_HOLE, 0, 512), "EInval"),
        (w, request(4, NO_HOLE, 0, 512), "EInval"),
        (w, request(1, FAST_ZERO, 0, 512), "EInval"),
        (w, request(5, NO_HOLE, 0, 512), "EInval"),
        (w, request(0, REQ_ONE, 0, 512), "EInval"),
        (w, request(0, 1 << 15, 0, 512), "EInval"),
        // 6. FLUSH carries no range.
        (w, request(3, 0, 512, 0), "EInval"),
        (w, request(3, 0, 0, 512), "EInval"),
        // 7. Zero lengths.
        (w, request(0, 0, 0, 0), "EInval"),
        (w, request(1, 0, 0, 0), "EInval"),
        (w, request(4, 0, 0, 0), "EInval"),
        (w, request(6, 0, 0, 0), "EInval"),
        // 8. Longer than the maximum payload: READ/WRITE only.
        (w, request(0, 0, 0, mib + 512), "EInval"),
        (w, request(1, 0, 0, mib + 512), "EInval"),
        (
            w,
            request(6, 0, 0, 2 * mib),
            "WriteZeroes { offset_bytes: 0, length_bytes: 2097152, fua: false, no_hole: false, fast_zero: false }",
        ),
        // 9. Alignment to the minimum block size.
        (w, request(0, 0, 1, 512), "EInval"),
        (w, request(0, 0, 0, 511), "EInval"),
        (w, request(1, 0, 256, 512), "EInval"),
        (w, request(4, 0, 0, 100), "EInval"),
        // 10. Beyond the end: EINVAL for read/trim, ENOSPC for write/write-zeroes.
        (w, request(0, 0, SIZE, 512), "EInval"),
        (w, request(0, 0, SIZE - 512, 1024), "EInval"),
        (w, request(4, 0, SIZE - 512, 1024), "EInval"),
        (w, request(1, 0, SIZE, 512), "ENoSpc"),
        (w, request(6, 0, SIZE - 512, 1024), "ENoSpc"),
        (w, request(0, 0, u64::MAX - 511, 512), "EInval"),
        (w, request(1, 0, u64::MAX - 511, 1024), "ENoSpc"),
        (w, request(5, 0, SIZE - 512, 1024), "EInval"),
    ];
    for (session, header, expected) in cases {
        check(session, header, expected);
    }
}

#[test]
fn features_an_export_does_not_advertise_are_refused() {
    let bare = Session::new(
        0,
        &Export::new("bare", SIZE).with_flags(TransmissionFlags::HAS_FLAGS),
        false,
    );
    check(bare, request(3, 0, 0, 0), "EInval");
    check(bare, request(4, 0, 0, 512), "EInval");
    check(bare, request(6, 0, 0, 512), "EInval");
    check(bare, request(5, 0, 0, 512), "EInval");
    check(bare, request(1, FUA, 0, 512), "EInval");
    // FAST_ZERO needs SEND_FAST_ZERO, even with write zeroes advertised.
    let no_fast = Session::new(
        0,
        &Export::new("no-fast", SIZE)
            .with_flags(TransmissionFlags::DEFAULT.difference(TransmissionFlags::SEND_FAST_ZERO)),
        false,
    );
    check(no_fast, request(6, FAST_ZERO, 0, 512), "EInval");
    check(
        bare,
        request(1, 0, 0, 512),
        "Write { offset_bytes: 0, length_bytes: 512, fua: false }",
    );
    let sizes = BlockSizes {
        minimum_bytes: 4096,
        preferred_bytes: 4096,
        maximum_bytes: 64 << 10,
    };
    let big_blocks = Session::new(0, &Export::new("4k", SIZE).with_block_sizes(sizes), false)
        .with_block_sizes_agreed(true);
    check(big_blocks, request(0, 0, 512, 4096), "EInval");
    check(
        big_blocks,
        request(0, 0, 4096, 4096),
        "Read { offset_bytes: 4096, length_bytes: 4096 }",
    );
    check(big_blocks, request(0, 0, 0, 128 << 10), "EInval");
    // A client that did not agree to them is held to the spec's defaults instead.
    let defaults = Session::new(0, &Export::new("4k", SIZE).with_block_sizes(sizes), false);
    check(
        defaults,
        request(0, 0, 512, 4096),
        "Read { offset_bytes: 512, length_bytes: 4096 }",
    );
    check(
        defaults,
        request(0, 0, 0, 128 << 10),
        "Read { offset_bytes: 0, length_bytes: 131072 }",
    );
}

#[test]
fn clients_without_negotiated_block_sizes_address_bytes_and_32_mib() {
    let u = unnegotiated();
    assert_eq!(u.enforced_block_sizes(), (1, 1 << 25));
    assert_eq!(writable().enforced_block_sizes(), (512, 1 << 20));
    check(
        u,
        request(0, 0, 1, 3),
        "Read { offset_bytes: 1, length_bytes: 3 }",
    );
    check(
        u,
        request(1, 0, SIZE - 1, 1),
        "Write { offset_bytes: 1073741823, length_bytes: 1, fua: false }",
    );
    check(
        u,
        request(0, 0, 7, 32 << 20),
        "Read { offset_bytes: 7, length_bytes: 33554432 }",
    );
    check(
        u,
        request(1, FUA, 0, 32 << 20),
        "Write { offset_bytes: 0, length_bytes: 33554432, fua: true }",
    );
    check(u, request(0, 0, 0, (32 << 20) + 1), "EInval");
    check(u, request(1, 0, 0, (32 << 20) + 1), "EInval");
    check(u, request(1, 0, SIZE - 1, 2), "ENoSpc");
    check(
        u,
        request(6, FAST_ZERO | NO_HOLE, 3, 5),
        "WriteZeroes { offset_bytes: 3, length_bytes: 5, fua: false, no_hole: true, fast_zero: true }",
    );
    check(
        u,
        request(4, 0, 100, 1000),
        "Trim { offset_bytes: 100, length_bytes: 1000, fua: false }",
    );
}

#[test]
fn block_status_needs_a_selected_context() {
    let b = with_block_status();
    assert_eq!(b.base_allocation_context(), Some(1));
    assert_eq!(unnegotiated().base_allocation_context(), None);
    check(
        b,
        request(7, 0, 0, 1 << 30),
        "BlockStatus { offset_bytes: 0, length_bytes: 1073741824, req_one: false }",
    );
    check(
        b,
        request(7, REQ_ONE | FUA, 5, 7),
        "BlockStatus { offset_bytes: 5, length_bytes: 7, req_one: true }",
    );
    check(b, request(7, NO_HOLE, 0, 512), "EInval");
    check(b, request(7, 0, 0, 0), "EInval");
    check(b, request(7, 0, SIZE - 512, 1024), "EInval");
    // Not selected (or no structured replies): refused.
    check(unnegotiated(), request(7, 0, 0, 512), "EInval");
    let structured = Session::new(0, &Export::new("disk", SIZE), true);
    check(structured, request(7, 0, 0, 512), "EInval");
}

#[test]
fn errno_values_are_the_specs() {
    let pairs = [
        (Errno::Perm, 1),
        (Errno::Io, 5),
        (Errno::NoMem, 12),
        (Errno::Inval, 22),
        (Errno::NoSpc, 28),
        (Errno::Overflow, 75),
        (Errno::NotSup, 95),
        (Errno::Shutdown, 108),
    ];
    for (errno, value) in pairs {
        assert_eq!(errno.as_u32(), value);
        assert_eq!(Errno::from_u32(value), Ok(errno));
    }
    assert!(Errno::from_u32(2).is_err());
    let linux = [
        (1, Errno::Perm),
        (13, Errno::Perm),
        (30, Errno::Perm),
        (28, Errno::NoSpc),
        (27, Errno::NoSpc),
    ];
    let linux = [
        &linux[..],
        &[
            (122, Errno::NoSpc),
            (12, Errno::NoMem),
            (5, Errno::Io),
            (2, Errno::Io),
            (-1, Errno::Io),
        ],
    ]
    .concat();
    for (errno, expected) in linux {
        assert_eq!(Errno::from_linux_errno(errno), expected, "{errno}");
    }
    for value in 0..=9u16 {
        assert_eq!(
            CommandType::from_u16(value).map(CommandType::as_u16),
            if value <= 8 {
                Ok(value)
            } else {
                Err(UnknownCommand(value))
            }
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Replies.

const COOKIE: [u8; 8] = [0xc0, 0xff, 0xee, 0, 0, 0, 0, 1];

fn validated(session: Session, header: RequestHeader) -> ValidatedCommand {
    session.validate(&header).unwrap()
}

#[test]
fn simple_replies() {
    let session = writable();
    let read = validated(session, request(0, 0, 4096, 4096));
    let ok = session.reply_ok(&read).unwrap();
    assert_eq!(
        ok.as_bytes(),
        [&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 0][..], &COOKIE].concat()
    );
    let write = validated(session, request(1, 0, 0, 512));
    assert_eq!(session.reply_ok(&write).unwrap().as_bytes(), ok.as_bytes());
    let error = session.reply_error(0xc0ff_ee00_0000_0001, Errno::Inval);
    assert_eq!(
        error.as_bytes(),
        [&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22][..], &COOKIE].concat()
    );
    let disconnect = validated(session, request(2, 0, 0, 0));
    assert_eq!(session.reply_ok(&disconnect), None);
}

#[test]
fn structured_replies() {
    let session = Session::new(0, &Export::new("disk", SIZE), true);
    let read = validated(session, request(0, 0, 4096, 4096));
    let ok = session.reply_ok(&read).unwrap();
    let expected_read = [
        &[0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 1][..],
        &COOKIE,
        &(4096u32 + 8).to_be_bytes(),
        &4096u64.to_be_bytes(),
    ]
    .concat();
    assert_eq!(ok.as_bytes(), expected_read);
    // Non-read commands may still get a simple reply: they carry no payload.
    let flush = validated(session, request(3, 0, 0, 0));
    assert_eq!(
        session.reply_ok(&flush).unwrap().as_bytes(),
        [&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 0][..], &COOKIE].concat()
    );
    let error = session.reply_error(0xc0ff_ee00_0000_0001, Errno::Io);
    let expected_error = [
        &[0x66, 0x8e, 0x33, 0xef, 0, 1, 0x80, 1][..],
        &COOKIE,
        &[0, 0, 0, 6],
        &[0, 0, 0, 5],
        &[0, 0],
    ]
    .concat();
    assert_eq!(error.as_bytes(), expected_error);
    let none = none_chunk(7);
    assert_eq!(
        none.as_bytes(),
        [
            &[0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 0][..],
            &7u64.to_be_bytes(),
            &[0, 0, 0, 0]
        ]
        .concat()
    );
    let partial = offset_data_chunk(7, 0, 512, false);
    assert_eq!(partial.as_bytes()[4..8], [0, 0, 0, 1]);
}

#[test]
fn read_pieces_and_block_status_replies() {
    // Structured: one OFFSET_DATA chunk per piece, DONE on the last.
    let structured = Session::new(0, &Export::new("disk", SIZE), true);
    let first = structured.reply_read_piece(0xc0ff_ee00_0000_0001, 100, 1000, true, false);
    assert_eq!(
        first.as_bytes(),
        [
            &[0x66, 0x8e, 0x33, 0xef, 0, 0, 0, 1][..],
            &COOKIE,
            &1008u32.to_be_bytes(),
            &100u64.to_be_bytes(),
        ]
        .concat()
    );
    let last = structured.reply_read_piece(0xc0ff_ee00_0000_0001, 1100, 24, false, true);
    assert_eq!(last.as_bytes()[4..8], [0, 1, 0, 1]);
    // Simple: the reply before the first piece, nothing before the others.
    let simple = unnegotiated();
    let first = simple.reply_read_piece(0xc0ff_ee00_0000_0001, 100, 1000, true, false);
    assert_eq!(
        first.as_bytes(),
        [&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 0][..], &COOKIE].concat()
    );
    let later = simple.reply_read_piece(0xc0ff_ee00_0000_0001, 1100, 24, false, true);
    assert!(later.as_bytes().is_empty());
    // BLOCK_STATUS: a chunk header of type 5 with DONE, then the context id and descriptors.
    let session = with_block_status();
    let status = validated(session, request(7, 0, 0, 8192));
    let mut payload = [0u8; 64];
    let length = encode_block_status(1, [(4096, 3), (4096, 0)], &mut payload);
    assert_eq!(length, Some(20));
    assert_eq!(
        payload[..20],
        [0, 0, 0, 1, 0, 0, 16, 0, 0, 0, 0, 3, 0, 0, 16, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        session.reply_block_status(&status, 20).unwrap().as_bytes(),
        [
            &[0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 5][..],
            &COOKIE,
            &20u32.to_be_bytes(),
        ]
        .concat()
    );
    assert_eq!(
        session.reply_ok(&status),
        None,
        "block status carries a payload"
    );
    // Too small a buffer, no extent, an empty extent: nothing to encode.
    assert_eq!(
        encode_block_status(1, [(4096, 0)], &mut payload[..11]),
        None
    );
    assert_eq!(encode_block_status(1, [], &mut payload), None);
    assert_eq!(encode_block_status(1, [(0, 0)], &mut payload), None);
    let cache = validated(session, request(5, 0, 0, 512));
    assert_eq!(
        session.reply_ok(&cache).unwrap().as_bytes(),
        [&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 0][..], &COOKIE].concat()
    );
    assert_eq!(session.reply_block_status(&cache, 20), None);
}

#[test]
fn replies_decode_back() {
    let session = Session::new(0, &Export::new("disk", SIZE), true);
    let replies = [
        session.reply_error(1, Errno::Perm),
        writable().reply_error(2, Errno::NoSpc),
        offset_data_chunk(3, 4096, 512, true),
        none_chunk(4),
    ];
    let expected = [
        Reply::Chunk(ChunkHeader {
            flags: 1,
            chunk_type: 0x8001,
            cookie: 1,
            length_bytes: 6,
        }),
        Reply::Simple(SimpleReply {
            error: 28,
            cookie: 2,
        }),
        Reply::Chunk(ChunkHeader {
            flags: 1,
            chunk_type: 1,
            cookie: 3,
            length_bytes: 520,
        }),
        Reply::Chunk(ChunkHeader {
            flags: 1,
            chunk_type: 0,
            cookie: 4,
            length_bytes: 0,
        }),
    ];
    for (reply, expected) in replies.iter().zip(expected) {
        let (decoded, size) = Reply::decode(reply.as_bytes()).unwrap().unwrap();
        assert_eq!(decoded, expected);
        assert_eq!(
            &decoded.to_bytes().as_bytes()[..size],
            &reply.as_bytes()[..size]
        );
        for length in 0..size {
            assert_eq!(Reply::decode(&reply.as_bytes()[..length]), Ok(None));
        }
    }
    assert_eq!(
        Reply::decode(&[0, 0, 0, 0]),
        Err(ReplyError::BadMagic { found: 0 })
    );
    assert!(
        ChunkHeader {
            flags: 1,
            chunk_type: 0,
            cookie: 0,
            length_bytes: 0
        }
        .is_done()
    );
    assert!(
        !ChunkHeader {
            flags: 0,
            chunk_type: 1,
            cookie: 0,
            length_bytes: 9
        }
        .is_done()
    );
}

#[test]
fn pipelined_requests_parse_out_of_one_buffer() {
    let session = read_only();
    let mut stream = Vec::new();
    let headers = [
        request(0, 0, 0, 512),
        request(1, 0, 0, 1024),
        request(99, 0, 0, 4096),
        request(3, 0, 0, 0),
    ];
    for header in headers {
        stream.extend_from_slice(&header.to_bytes());
        stream.extend(std::iter::repeat_n(
            0xaa,
            header.payload_length_bytes() as usize,
        ));
    }
    let mut position = 0;
    let mut results = Vec::new();
    while let Some((header, size)) = decode_request(&stream[position..]).unwrap() {
        position += size + header.payload_length_bytes() as usize;
        results.push(describe(session.validate(&header)));
    }
    assert_eq!(position, stream.len());
    assert_eq!(
        results,
        [
            "Read { offset_bytes: 0, length_bytes: 512 }",
            "EPerm",
            "EInval",
            "Flush"
        ]
    );
}
