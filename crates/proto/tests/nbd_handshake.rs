//! NBD handshake transcripts: byte-exact client and server sequences built from the spec
//! (`doc/proto.md`), with literal magic numbers and codes rather than the crate's constants, so
//! a wrong constant in the crate cannot make its own test pass. Every transcript is replayed
//! twice: all client bytes at once, and one byte at a time; both must produce the same output.

use std::sync::Arc;

use reflex_proto::nbd::*;

// Client side, from the spec.
const IHAVEOPT: [u8; 8] = *b"IHAVEOPT";
const CLIENT_FIXED_NEWSTYLE: u32 = 1;
const CLIENT_NO_ZEROES: u32 = 2;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;
const OPT_EXTENDED_HEADERS: u32 = 11;
const INFO_EXPORT: u16 = 0;
const INFO_NAME: u16 = 1;
const INFO_DESCRIPTION: u16 = 2;
const INFO_BLOCK_SIZE: u16 = 3;
// Server side, from the spec.
const GREETING: [u8; 18] = [
    b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T',
    0, 0b11,
];
const REPLY_MAGIC: [u8; 8] = [0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9];
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const REP_ERR_POLICY: u32 = 0x8000_0002;
const REP_ERR_INVALID: u32 = 0x8000_0003;
const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;
const REP_ERR_BLOCK_SIZE_REQD: u32 = 0x8000_0008;
const REP_ERR_TOO_BIG: u32 = 0x8000_0009;
// HAS_FLAGS | SEND_FLUSH | SEND_FUA | SEND_TRIM | SEND_WRITE_ZEROES | CAN_MULTI_CONN |
// SEND_CACHE | SEND_FAST_ZERO.
const FLAGS_WRITABLE: u16 = 0b1101_0110_1101;
// HAS_FLAGS | READ_ONLY | SEND_FLUSH | SEND_FUA | CAN_MULTI_CONN | SEND_CACHE.
const FLAGS_READ_ONLY: u16 = 0b0101_0000_1111;
const DISK_SIZE: u64 = 1 << 30;
const ARCHIVE_SIZE: u64 = 64 << 20;

fn exports() -> Arc<ExportTable> {
    let table = ExportTable::new(
        vec![
            Export::new("disk", DISK_SIZE).with_description("the main disk"),
            Export::new("archive", ARCHIVE_SIZE).read_only(),
        ],
        Some("disk"),
    )
    .unwrap();
    Arc::new(table)
}

fn client_flags(flags: u32) -> Vec<u8> {
    flags.to_be_bytes().to_vec()
}

fn opt(option: u32, data: &[u8]) -> Vec<u8> {
    [
        &IHAVEOPT[..],
        &option.to_be_bytes(),
        &(data.len() as u32).to_be_bytes(),
        data,
    ]
    .concat()
}

fn info_request(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for request in requests {
        data.extend_from_slice(&request.to_be_bytes());
    }
    data
}

fn rep(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    [
        &REPLY_MAGIC[..],
        &option.to_be_bytes(),
        &reply_type.to_be_bytes(),
        &(data.len() as u32).to_be_bytes(),
        data,
    ]
    .concat()
}

fn info_export(size: u64, flags: u16) -> Vec<u8> {
    [
        &INFO_EXPORT.to_be_bytes()[..],
        &size.to_be_bytes(),
        &flags.to_be_bytes(),
    ]
    .concat()
}

fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    [
        &INFO_BLOCK_SIZE.to_be_bytes()[..],
        &minimum.to_be_bytes(),
        &preferred.to_be_bytes(),
        &maximum.to_be_bytes(),
    ]
    .concat()
}

/// The spec's defaults, which reflexd serves: 1 / 4096 / 32 MiB.
fn default_block_sizes() -> Vec<u8> {
    info_block_size(1, 4096, 1 << 25)
}

/// What a run of the handshake produced.
#[derive(Debug, PartialEq)]
struct Run {
    output: Vec<u8>,
    /// Bytes consumed; `None` when the handshake failed (the driver then just closes).
    consumed: Option<usize>,
    outcome: Option<Outcome>,
    error: Option<HandshakeError>,
}

fn run_with(config: HandshakeConfig, input: &[u8], step: usize) -> Run {
    let mut handshake = Handshake::new(exports(), config);
    let mut output = Vec::new();
    let mut out = [0u8; 7];
    let mut consumed = 0;
    let mut error = None;
    loop {
        let end = (consumed + step).min(input.len());
        let result = handshake.handle_bytes(&input[consumed..end]);
        // Replies produced before a failure are drained too, so a split input and a whole one
        // can be compared.
        loop {
            let count = handshake.poll_transmit(&mut out);
            if count == 0 {
                break;
            }
            output.extend_from_slice(&out[..count]);
        }
        match result {
            Ok(count) => consumed += count,
            Err(failure) => {
                error = Some(failure);
                break;
            }
        }
        if handshake.outcome().is_some() || end == input.len() {
            break;
        }
    }
    let consumed = if error.is_some() {
        None
    } else {
        Some(consumed)
    };
    Run {
        output,
        consumed,
        outcome: handshake.outcome(),
        error,
    }
}

/// Replays `input` whole and byte by byte, asserts both agree and returns the result.
fn run(config: HandshakeConfig, input: &[u8]) -> Run {
    let whole = run_with(config, input, input.len().max(1));
    let bytewise = run_with(config, input, 1);
    assert_eq!(
        whole, bytewise,
        "splitting the input changed the transcript"
    );
    whole
}

/// Asserts a transcript: server bytes after the greeting, consumed bytes, outcome.
fn check(
    input: &[u8],
    expected_output: &[Vec<u8>],
    expected_consumed: usize,
    expected_outcome: Option<Outcome>,
) {
    let result = run(HandshakeConfig::default(), input);
    assert_eq!(result.error, None);
    let expected: Vec<u8> = [GREETING.to_vec(), expected_output.concat()].concat();
    assert_eq!(result.output, expected, "server bytes differ");
    assert_eq!(result.consumed, Some(expected_consumed));
    assert_eq!(result.outcome, expected_outcome);
}

fn session(index: usize, structured: bool) -> Session {
    let table = exports();
    Session::new(index, &table.exports()[index], structured)
}

/// A session whose client asked for the block sizes with GO (and must honour them).
fn agreed(index: usize, structured: bool) -> Session {
    session(index, structured).with_block_sizes_agreed(true)
}

#[test]
fn greeting_is_sent_before_anything_is_received() {
    let mut handshake = Handshake::new(exports(), HandshakeConfig::default());
    assert_eq!(handshake.pending_output(), GREETING);
    let mut out = [0u8; 64];
    assert_eq!(handshake.poll_transmit(&mut out), 18);
    assert_eq!(out[..18], GREETING);
    assert_eq!(handshake.poll_transmit(&mut out), 0);
    assert_eq!(handshake.outcome(), None);
}

#[test]
fn no_zeroes_then_go_with_block_size_request() {
    let go = opt(OPT_GO, &info_request("disk", &[INFO_BLOCK_SIZE]));
    // The client pipelines its first transmission request right after GO.
    let request = [
        0x25, 0x60, 0x95, 0x13, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        2, 0,
    ];
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        go.clone(),
        request.to_vec(),
    ]
    .concat();
    check(
        &input,
        &[
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        4 + go.len(),
        Some(Outcome::Transmission(agreed(0, false))),
    );
    // The unconsumed rest is a valid transmission request.
    let (header, _) = decode_request(&input[4 + go.len()..]).unwrap().unwrap();
    assert_eq!(header.cookie, 0x0102_0304_0506_0708);
}

#[test]
fn go_without_info_requests_still_advertises_block_sizes() {
    let go = opt(OPT_GO, &info_request("archive", &[]));
    let input = [client_flags(CLIENT_FIXED_NEWSTYLE), go.clone()].concat();
    check(
        &input,
        &[
            rep(
                OPT_GO,
                REP_INFO,
                &info_export(ARCHIVE_SIZE, FLAGS_READ_ONLY),
            ),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(session(1, false))),
    );
}

#[test]
fn info_with_name_and_description_then_go() {
    let info = opt(
        OPT_INFO,
        &info_request("", &[INFO_DESCRIPTION, INFO_NAME, 0x7777, INFO_BLOCK_SIZE]),
    );
    let go = opt(OPT_GO, &info_request("disk", &[INFO_NAME]));
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        info,
        go,
    ]
    .concat();
    let name = [&INFO_NAME.to_be_bytes()[..], b"disk"].concat();
    let description = [&INFO_DESCRIPTION.to_be_bytes()[..], b"the main disk"].concat();
    check(
        &input,
        &[
            rep(OPT_INFO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_INFO, REP_INFO, &name),
            rep(OPT_INFO, REP_INFO, &description),
            rep(OPT_INFO, REP_INFO, &default_block_sizes()),
            rep(OPT_INFO, REP_ACK, &[]),
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &name),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(session(0, false))),
    );
}

#[test]
fn list_then_abort() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_LIST, &[]),
        opt(OPT_ABORT, &[]),
    ]
    .concat();
    check(
        &input,
        &[
            rep(
                OPT_LIST,
                REP_SERVER,
                &[&4u32.to_be_bytes()[..], b"disk"].concat(),
            ),
            rep(
                OPT_LIST,
                REP_SERVER,
                &[&7u32.to_be_bytes()[..], b"archive"].concat(),
            ),
            rep(OPT_LIST, REP_ACK, &[]),
            rep(OPT_ABORT, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Aborted),
    );
}

#[test]
fn abort_with_data_is_acknowledged_and_data_ignored() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_ABORT, b"bye now"),
        b"trailing".to_vec(),
    ]
    .concat();
    check(
        &input,
        &[rep(OPT_ABORT, REP_ACK, &[])],
        input.len() - 8,
        Some(Outcome::Aborted),
    );
}

#[test]
fn unknown_options_are_unsupported_and_negotiation_continues() {
    let go = opt(OPT_GO, &info_request("disk", &[INFO_BLOCK_SIZE]));
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(0x1234_5678, b"whatever data"),
        opt(OPT_EXTENDED_HEADERS, &[]),
        opt(4, &[]),
        go,
    ]
    .concat();
    let unsupported = b"option not supported by reflexd";
    check(
        &input,
        &[
            rep(0x1234_5678, REP_ERR_UNSUP, unsupported),
            rep(OPT_EXTENDED_HEADERS, REP_ERR_UNSUP, unsupported),
            rep(4, REP_ERR_UNSUP, unsupported),
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(agreed(0, false))),
    );
}

#[test]
fn starttls_is_refused_by_policy() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_STARTTLS, &[]),
        opt(OPT_ABORT, &[]),
    ]
    .concat();
    check(
        &input,
        &[
            rep(
                OPT_STARTTLS,
                REP_ERR_POLICY,
                b"TLS is not available on this server",
            ),
            rep(OPT_ABORT, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Aborted),
    );
}

#[test]
fn structured_replies_are_negotiated_and_carried_into_the_session() {
    let go = opt(OPT_GO, &info_request("disk", &[]));
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_STRUCTURED_REPLY, b"x"),
        opt(OPT_STRUCTURED_REPLY, &[]),
        go,
    ]
    .concat();
    check(
        &input,
        &[
            rep(
                OPT_STRUCTURED_REPLY,
                REP_ERR_INVALID,
                b"malformed option data",
            ),
            rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]),
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(session(0, true))),
    );
}

#[test]
fn list_with_data_is_invalid() {
    let input = [client_flags(CLIENT_FIXED_NEWSTYLE), opt(OPT_LIST, b"disk")].concat();
    check(
        &input,
        &[rep(OPT_LIST, REP_ERR_INVALID, b"malformed option data")],
        input.len(),
        None,
    );
}

#[test]
fn go_for_a_missing_export_is_unknown_and_negotiation_continues() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_GO, &info_request("nope", &[INFO_BLOCK_SIZE])),
        opt(OPT_INFO, &info_request("Disk", &[])),
        opt(OPT_ABORT, &[]),
    ]
    .concat();
    check(
        &input,
        &[
            rep(OPT_GO, REP_ERR_UNKNOWN, b"no such export"),
            rep(OPT_INFO, REP_ERR_UNKNOWN, b"no such export"),
            rep(OPT_ABORT, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Aborted),
    );
}

#[test]
fn empty_name_without_a_default_export_is_unknown() {
    let table = Arc::new(ExportTable::new(vec![Export::new("disk", DISK_SIZE)], None).unwrap());
    let mut handshake = Handshake::new(table, HandshakeConfig::default());
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_GO, &info_request("", &[])),
    ]
    .concat();
    assert_eq!(handshake.handle_bytes(&input), Ok(input.len()));
    let expected = [
        GREETING.to_vec(),
        rep(OPT_GO, REP_ERR_UNKNOWN, b"no such export"),
    ]
    .concat();
    assert_eq!(handshake.pending_output(), expected);
    assert_eq!(handshake.outcome(), None);
}

#[test]
fn malformed_go_data_is_invalid() {
    let cases: [&[u8]; 6] = [
        &[],
        &[0, 0, 0, 0, 0],
        // Name length beyond the data.
        &[0, 0, 0, 9, b'd', b'i', b's', b'k', 0, 0],
        // Request count says 2 but one is present.
        &[0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 2, 0, 3],
        // One byte too many.
        &[0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 0, 0],
        // Name length u32::MAX.
        &[0xff, 0xff, 0xff, 0xff, 0, 0],
    ];
    for data in cases {
        let input = [client_flags(CLIENT_FIXED_NEWSTYLE), opt(OPT_GO, data)].concat();
        check(
            &input,
            &[rep(OPT_GO, REP_ERR_INVALID, b"malformed option data")],
            input.len(),
            None,
        );
    }
}

#[test]
fn oversized_option_data_is_skipped_not_buffered() {
    let huge = vec![0x55u8; 100_000];
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_GO, &huge),
        opt(0x99, &huge),
        opt(OPT_GO, &info_request("disk", &[])),
    ]
    .concat();
    let result = run(HandshakeConfig::default(), &input);
    let expected = [
        GREETING.to_vec(),
        rep(OPT_GO, REP_ERR_TOO_BIG, b"option data too long"),
        rep(0x99, REP_ERR_UNSUP, b"option not supported by reflexd"),
        rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
        rep(OPT_GO, REP_INFO, &default_block_sizes()),
        rep(OPT_GO, REP_ACK, &[]),
    ]
    .concat();
    assert_eq!(result.output, expected);
    assert_eq!(result.consumed, Some(input.len()));
    assert_eq!(
        result.outcome,
        Some(Outcome::Transmission(session(0, false)))
    );
}

#[test]
fn export_name_with_and_without_zeroes() {
    let name = opt(OPT_EXPORT_NAME, b"archive");
    let size_and_flags = [
        &ARCHIVE_SIZE.to_be_bytes()[..],
        &FLAGS_READ_ONLY.to_be_bytes(),
    ]
    .concat();
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        name.clone(),
    ]
    .concat();
    check(
        &input,
        std::slice::from_ref(&size_and_flags),
        input.len(),
        Some(Outcome::Transmission(session(1, false))),
    );
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        name.clone(),
        b"rest".to_vec(),
    ]
    .concat();
    check(
        &input,
        &[size_and_flags, vec![0; 124]],
        input.len() - 4,
        Some(Outcome::Transmission(session(1, false))),
    );
    // An old client (no fixed newstyle) with the empty name gets the default export.
    let input = [client_flags(0), opt(OPT_EXPORT_NAME, &[])].concat();
    let size_and_flags = [&DISK_SIZE.to_be_bytes()[..], &FLAGS_WRITABLE.to_be_bytes()].concat();
    check(
        &input,
        &[size_and_flags, vec![0; 124]],
        input.len(),
        Some(Outcome::Transmission(session(0, false))),
    );
}

#[test]
fn export_name_keeps_structured_replies_negotiated_before() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_STRUCTURED_REPLY, &[]),
        opt(OPT_EXPORT_NAME, b"disk"),
    ]
    .concat();
    let size_and_flags = [&DISK_SIZE.to_be_bytes()[..], &FLAGS_WRITABLE.to_be_bytes()].concat();
    check(
        &input,
        &[rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]), size_and_flags],
        input.len(),
        Some(Outcome::Transmission(session(0, true))),
    );
}

fn check_error(
    config: HandshakeConfig,
    input: &[u8],
    expected: HandshakeError,
    expected_output: &[Vec<u8>],
) {
    let result = run(config, input);
    assert_eq!(result.error, Some(expected));
    assert_eq!(
        result.output,
        [GREETING.to_vec(), expected_output.concat()].concat()
    );
    assert_eq!(result.outcome, None);
}

#[test]
fn violations_end_the_session() {
    let config = HandshakeConfig::default();
    check_error(
        config,
        &client_flags(4),
        HandshakeError::UnknownClientFlags { flags: 4 },
        &[],
    );
    check_error(
        config,
        &client_flags(0x8000_0003),
        HandshakeError::UnknownClientFlags { flags: 0x8000_0003 },
        &[],
    );
    let bad_magic = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        b"IHAVEOPU".to_vec(),
        vec![0; 8],
    ]
    .concat();
    check_error(
        config,
        &bad_magic,
        HandshakeError::BadOptionMagic {
            found: 0x4948_4156_454f_5055,
        },
        &[],
    );
    let unknown = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_EXPORT_NAME, b"nope"),
    ]
    .concat();
    check_error(
        config,
        &unknown,
        HandshakeError::UnknownExport {
            name: "nope".into(),
        },
        &[],
    );
    let long = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_EXPORT_NAME, &[b'a'; 4097]),
    ]
    .concat();
    check_error(
        config,
        &long,
        HandshakeError::ExportNameTooLong { length_bytes: 4097 },
        &[],
    );
    // After an error the handshake keeps failing and consumes nothing.
    let mut handshake = Handshake::new(exports(), config);
    assert!(handshake.handle_bytes(&client_flags(8)).is_err());
    assert!(handshake.handle_bytes(&[0; 16]).is_err());
}

#[test]
fn too_many_options_end_the_session() {
    let config = HandshakeConfig {
        options_max: 3,
        ..HandshakeConfig::default()
    };
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(99, &[]),
        opt(99, &[]),
        opt(99, &[]),
        opt(99, &[]),
    ]
    .concat();
    let unsupported = rep(99, REP_ERR_UNSUP, b"option not supported by reflexd");
    check_error(
        config,
        &input,
        HandshakeError::TooManyOptions { options_max: 3 },
        &[unsupported.clone(), unsupported.clone(), unsupported],
    );
}

#[test]
fn block_size_can_be_required() {
    let config = HandshakeConfig {
        block_size_required: true,
        ..HandshakeConfig::default()
    };
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_INFO, &info_request("disk", &[])),
        opt(OPT_GO, &info_request("disk", &[])),
        opt(OPT_GO, &info_request("disk", &[INFO_BLOCK_SIZE])),
    ]
    .concat();
    let result = run(config, &input);
    let export = rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE));
    let sizes = rep(OPT_GO, REP_INFO, &default_block_sizes());
    let expected = [
        GREETING.to_vec(),
        // INFO commits to nothing, so it succeeds without the request.
        rep(OPT_INFO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
        rep(OPT_INFO, REP_INFO, &default_block_sizes()),
        rep(OPT_INFO, REP_ACK, &[]),
        export.clone(),
        sizes.clone(),
        rep(
            OPT_GO,
            REP_ERR_BLOCK_SIZE_REQD,
            b"this export requires NBD_INFO_BLOCK_SIZE to be requested",
        ),
        export,
        sizes,
        rep(OPT_GO, REP_ACK, &[]),
    ]
    .concat();
    assert_eq!(result.output, expected);
    assert_eq!(
        result.outcome,
        Some(Outcome::Transmission(agreed(0, false)))
    );
}

#[test]
fn shutdown_refuses_options_but_honours_abort() {
    let mut handshake = Handshake::new(exports(), HandshakeConfig::default());
    handshake.begin_shutdown();
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_GO, &info_request("disk", &[])),
        opt(OPT_ABORT, &[]),
    ]
    .concat();
    assert_eq!(handshake.handle_bytes(&input), Ok(input.len()));
    let expected = [
        GREETING.to_vec(),
        rep(OPT_GO, REP_ERR_SHUTDOWN, b"server is shutting down"),
        rep(OPT_ABORT, REP_ACK, &[]),
    ]
    .concat();
    assert_eq!(handshake.pending_output(), expected);
    assert_eq!(handshake.outcome(), Some(Outcome::Aborted));
    let mut handshake = Handshake::new(exports(), HandshakeConfig::default());
    handshake.begin_shutdown();
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_EXPORT_NAME, b"disk"),
    ]
    .concat();
    assert_eq!(
        handshake.handle_bytes(&input),
        Err(HandshakeError::ShuttingDown)
    );
}

#[test]
fn end_of_stream_mid_handshake_is_a_disconnect() {
    let mut handshake = Handshake::new(exports(), HandshakeConfig::default());
    let partial = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_GO, &info_request("disk", &[]))[..10].to_vec(),
    ]
    .concat();
    assert_eq!(handshake.handle_bytes(&partial), Ok(partial.len()));
    assert_eq!(handshake.outcome(), None);
    handshake.handle_eof();
    assert_eq!(handshake.outcome(), Some(Outcome::Disconnected));
    assert_eq!(handshake.handle_bytes(b"more"), Ok(0));
    // EOF after the end changes nothing.
    let mut handshake = Handshake::new(exports(), HandshakeConfig::default());
    let input = [client_flags(CLIENT_FIXED_NEWSTYLE), opt(OPT_ABORT, &[])].concat();
    handshake.handle_bytes(&input).unwrap();
    handshake.handle_eof();
    assert_eq!(handshake.outcome(), Some(Outcome::Aborted));
}

#[test]
fn pending_output_applies_back_pressure_on_new_options() {
    // 256 exports with 200-byte names: one LIST reply is ~56 KiB; a second LIST pushes pending
    // output past the 64 KiB bound, so the third option is not read until output drains.
    let many: Vec<Export> = (0..256)
        .map(|index| Export::new(format!("{index:0>200}"), 1 << 20))
        .collect();
    let table = Arc::new(ExportTable::new(many, None).unwrap());
    let mut handshake = Handshake::new(table, HandshakeConfig::default());
    let list = opt(OPT_LIST, &[]);
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        list.clone(),
        list.clone(),
        list.clone(),
    ]
    .concat();
    let consumed = handshake.handle_bytes(&input).unwrap();
    assert_eq!(consumed, 4 + 2 * list.len());
    assert!(handshake.pending_output().len() >= OUTPUT_PENDING_MAX_BYTES);
    let pending = handshake.pending_output().len();
    handshake.consume_output(pending);
    assert_eq!(handshake.handle_bytes(&input[consumed..]), Ok(list.len()));
    assert_eq!(handshake.pending_output().len(), 256 * (20 + 4 + 200) + 20);
}

#[test]
fn export_table_rejects_bad_configuration() {
    let check = |exports: Vec<Export>, default: Option<&str>, expected: ExportError| {
        assert_eq!(ExportTable::new(exports, default), Err(expected));
    };
    check(
        vec![Export::new("a", 512), Export::new("a", 512)],
        None,
        ExportError::DuplicateName("a".into()),
    );
    check(
        vec![Export::new("a\0b", 512)],
        None,
        ExportError::Name("a\0b".into()),
    );
    check(
        vec![Export::new("x".repeat(4097), 512)],
        None,
        ExportError::Name("x".repeat(4097)),
    );
    let strict = BlockSizes {
        minimum_bytes: 512,
        preferred_bytes: 4096,
        maximum_bytes: 1 << 20,
    };
    check(
        vec![Export::new("a", 1000).with_block_sizes(strict)],
        None,
        ExportError::SizeNotAligned {
            name: "a".into(),
            size_bytes: 1000,
        },
    );
    // Fast zero needs write zeroes.
    let fast_alone = TransmissionFlags::HAS_FLAGS.union(TransmissionFlags::SEND_FAST_ZERO);
    check(
        vec![Export::new("a", 512).with_flags(fast_alone)],
        None,
        ExportError::Flags {
            name: "a".into(),
            flags: fast_alone.bits(),
        },
    );
    check(
        vec![Export::new("a", 512)],
        Some("b"),
        ExportError::UnknownDefault("b".into()),
    );
    let sizes = BlockSizes {
        minimum_bytes: 512,
        preferred_bytes: 256,
        maximum_bytes: 1 << 20,
    };
    check(
        vec![Export::new("a", 512).with_block_sizes(sizes)],
        None,
        ExportError::BlockSizes(sizes),
    );
    let no_has_flags = TransmissionFlags::SEND_FLUSH;
    check(
        vec![Export::new("a", 512).with_flags(no_has_flags)],
        None,
        ExportError::Flags {
            name: "a".into(),
            flags: no_has_flags.bits(),
        },
    );
    let with_df = TransmissionFlags::DEFAULT.union(TransmissionFlags::SEND_DF);
    check(
        vec![Export::new("a", 512).with_flags(with_df)],
        None,
        ExportError::Flags {
            name: "a".into(),
            flags: with_df.bits(),
        },
    );
    check(
        (0..257)
            .map(|index| Export::new(index.to_string(), 512))
            .collect(),
        None,
        ExportError::TooMany,
    );
    assert!(ExportTable::new(vec![Export::new("", 512)], None).is_ok());
}

/// LIST/SET_META_CONTEXT data: the export name and the queries.
fn meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

fn meta_context(id: u32) -> Vec<u8> {
    [&id.to_be_bytes()[..], b"base:allocation"].concat()
}

#[test]
fn base_allocation_is_listed_selected_and_carried_into_the_session() {
    let set = opt(
        OPT_SET_META_CONTEXT,
        &meta_request("disk", &["qemu:dirty-bitmap:x", "base:allocation", "base:"]),
    );
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_STRUCTURED_REPLY, &[]),
        // No query lists every context; `base:` is a wildcard when listing; another
        // namespace is ignored; the default export is named by the empty name.
        opt(OPT_LIST_META_CONTEXT, &meta_request("disk", &[])),
        opt(OPT_LIST_META_CONTEXT, &meta_request("", &["base:"])),
        opt(OPT_LIST_META_CONTEXT, &meta_request("disk", &["qemu:x"])),
        set,
        opt(OPT_GO, &info_request("disk", &[])),
    ]
    .concat();
    check(
        &input,
        &[
            rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]),
            rep(OPT_LIST_META_CONTEXT, REP_META_CONTEXT, &meta_context(0)),
            rep(OPT_LIST_META_CONTEXT, REP_ACK, &[]),
            rep(OPT_LIST_META_CONTEXT, REP_META_CONTEXT, &meta_context(0)),
            rep(OPT_LIST_META_CONTEXT, REP_ACK, &[]),
            rep(OPT_LIST_META_CONTEXT, REP_ACK, &[]),
            rep(OPT_SET_META_CONTEXT, REP_META_CONTEXT, &meta_context(1)),
            rep(OPT_SET_META_CONTEXT, REP_ACK, &[]),
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(
            session(0, true).with_base_allocation(true),
        )),
    );
    assert_eq!(
        session(0, true)
            .with_base_allocation(true)
            .base_allocation_context(),
        Some(1)
    );
}

#[test]
fn meta_context_refusals_and_selections_that_do_not_apply() {
    let set =
        |name: &str, queries: &[&str]| opt(OPT_SET_META_CONTEXT, &meta_request(name, queries));
    let invalid = b"malformed option data";
    // SET before structured replies: refused. `base:` alone selects nothing.
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        set("disk", &["base:allocation"]),
        opt(OPT_STRUCTURED_REPLY, &[]),
        set("disk", &["base:"]),
        set("nope", &["base:allocation"]),
        set("disk", &["allocation"]),
        opt(
            OPT_SET_META_CONTEXT,
            &[0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 0, 0, 1],
        ),
        opt(OPT_GO, &info_request("disk", &[])),
    ]
    .concat();
    check(
        &input,
        &[
            rep(
                OPT_SET_META_CONTEXT,
                REP_ERR_INVALID,
                b"metadata contexts need structured replies first",
            ),
            rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]),
            rep(OPT_SET_META_CONTEXT, REP_ACK, &[]),
            rep(OPT_SET_META_CONTEXT, REP_ERR_UNKNOWN, b"no such export"),
            rep(
                OPT_SET_META_CONTEXT,
                REP_ERR_INVALID,
                b"a metadata context query must be namespace:leaf",
            ),
            rep(OPT_SET_META_CONTEXT, REP_ERR_INVALID, invalid),
            rep(OPT_GO, REP_INFO, &info_export(DISK_SIZE, FLAGS_WRITABLE)),
            rep(OPT_GO, REP_INFO, &default_block_sizes()),
            rep(OPT_GO, REP_ACK, &[]),
        ],
        input.len(),
        Some(Outcome::Transmission(session(0, true))),
    );
    // Selected for one export, then GO for another: no block status. A later SET that fails
    // clears an earlier selection too.
    for (second, go_name, index) in [
        (None, "archive", 1),
        (Some(set("nope", &["base:allocation"])), "disk", 0),
    ] {
        let input = [
            client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
            opt(OPT_STRUCTURED_REPLY, &[]),
            set("disk", &["base:allocation"]),
            second.clone().unwrap_or_default(),
            opt(OPT_GO, &info_request(go_name, &[])),
        ]
        .concat();
        let result = run(HandshakeConfig::default(), &input);
        assert_eq!(
            result.outcome,
            Some(Outcome::Transmission(session(index, true)))
        );
    }
    // Too many queries.
    let many: Vec<&str> = std::iter::repeat_n("base:allocation", 65).collect();
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_STRUCTURED_REPLY, &[]),
        opt(OPT_LIST_META_CONTEXT, &meta_request("disk", &many)),
    ]
    .concat();
    let result = run(HandshakeConfig::default(), &input);
    let expected = [
        GREETING.to_vec(),
        rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]),
        rep(
            OPT_LIST_META_CONTEXT,
            REP_ERR_TOO_BIG,
            b"too many metadata context queries",
        ),
    ]
    .concat();
    assert_eq!(result.output, expected);
    // An export that does not offer it lists and selects nothing.
    let table = ExportTable::new(
        vec![Export::new("plain", 1 << 20).with_base_allocation(false)],
        None,
    )
    .unwrap();
    let mut handshake = Handshake::new(Arc::new(table), HandshakeConfig::default());
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_STRUCTURED_REPLY, &[]),
        opt(
            OPT_SET_META_CONTEXT,
            &meta_request("plain", &["base:allocation"]),
        ),
    ]
    .concat();
    assert_eq!(handshake.handle_bytes(&input), Ok(input.len()));
    let expected = [
        GREETING.to_vec(),
        rep(OPT_STRUCTURED_REPLY, REP_ACK, &[]),
        rep(OPT_SET_META_CONTEXT, REP_ACK, &[]),
    ]
    .concat();
    assert_eq!(handshake.pending_output(), &expected[..]);
}

#[test]
fn export_name_clients_and_go_without_block_size_get_the_defaults() {
    // A client that never asked for the block sizes is not bound by them.
    let strict = BlockSizes {
        minimum_bytes: 512,
        preferred_bytes: 4096,
        maximum_bytes: 1 << 20,
    };
    let table = Arc::new(
        ExportTable::new(
            vec![Export::new("disk", 1 << 30).with_block_sizes(strict)],
            None,
        )
        .unwrap(),
    );
    for (request, agreed) in [(vec![INFO_BLOCK_SIZE], true), (vec![], false)] {
        let mut handshake = Handshake::new(Arc::clone(&table), HandshakeConfig::default());
        let input = [
            client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
            opt(OPT_GO, &info_request("disk", &request)),
        ]
        .concat();
        assert_eq!(handshake.handle_bytes(&input), Ok(input.len()));
        let Some(Outcome::Transmission(session)) = handshake.outcome() else {
            panic!("no session");
        };
        assert_eq!(session.block_sizes_agreed(), agreed);
        let expected = if agreed { (512, 1 << 20) } else { (1, 1 << 25) };
        assert_eq!(session.enforced_block_sizes(), expected);
    }
}

const REP_ERR_TLS_REQD: u32 = 0x8000_0005;

fn tls(policy: TlsPolicy) -> HandshakeConfig {
    HandshakeConfig {
        tls: policy,
        ..HandshakeConfig::default()
    }
}

/// Feeds `input` until the handshake asks for TLS; returns the server bytes after the
/// greeting and the bytes consumed (what follows is the TLS stream).
fn until_starttls(handshake: &mut Handshake, input: &[u8]) -> (Vec<u8>, usize) {
    let consumed = handshake.handle_bytes(input).unwrap();
    let mut output = vec![0u8; handshake.pending_output().len()];
    let count = handshake.poll_transmit(&mut output);
    output.truncate(count);
    (output[GREETING.len()..].to_vec(), consumed)
}

#[test]
fn starttls_is_acknowledged_and_nothing_after_it_is_consumed() {
    let mut handshake = Handshake::new(exports(), tls(TlsPolicy::Optional));
    let before = [client_flags(CLIENT_FIXED_NEWSTYLE), opt(OPT_STARTTLS, &[])].concat();
    // A ClientHello's first bytes: they are TLS, not an option.
    let input = [before.clone(), vec![0x16, 0x03, 0x01]].concat();
    let (output, consumed) = until_starttls(&mut handshake, &input);
    assert_eq!(output, rep(OPT_STARTTLS, REP_ACK, &[]));
    assert_eq!(consumed, before.len());
    assert!(handshake.take_start_tls());
    assert!(!handshake.take_start_tls(), "TLS starts once");
    assert!(handshake.tls_active());
    // In TLS, negotiation goes on; a second STARTTLS is invalid.
    let after = [
        opt(OPT_STARTTLS, &[]),
        opt(OPT_GO, &info_request("disk", &[])),
    ]
    .concat();
    assert_eq!(handshake.handle_bytes(&after).unwrap(), after.len());
    let mut output = vec![0u8; handshake.pending_output().len()];
    handshake.poll_transmit(&mut output);
    assert!(output.starts_with(&rep(
        OPT_STARTTLS,
        REP_ERR_INVALID,
        b"TLS is already active"
    )));
    assert!(matches!(
        handshake.outcome(),
        Some(Outcome::Transmission(_))
    ));
}

#[test]
fn starttls_with_data_is_invalid() {
    let mut handshake = Handshake::new(exports(), tls(TlsPolicy::Optional));
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_STARTTLS, &[1, 2]),
    ]
    .concat();
    let (output, consumed) = until_starttls(&mut handshake, &input);
    assert_eq!(
        output,
        rep(OPT_STARTTLS, REP_ERR_INVALID, b"malformed option data")
    );
    assert_eq!(consumed, input.len());
    assert!(!handshake.take_start_tls());
}

#[test]
fn required_tls_refuses_every_other_option_until_starttls() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_LIST, &[]),
        opt(OPT_GO, &info_request("disk", &[])),
        opt(OPT_ABORT, &[]),
    ]
    .concat();
    let result = run(tls(TlsPolicy::Required), &input);
    let message = b"this server requires TLS: send NBD_OPT_STARTTLS first";
    assert_eq!(
        result.output,
        [
            GREETING.to_vec(),
            rep(OPT_LIST, REP_ERR_TLS_REQD, message),
            rep(OPT_GO, REP_ERR_TLS_REQD, message),
            rep(OPT_ABORT, REP_ACK, &[]),
        ]
        .concat()
    );
    assert_eq!(result.outcome, Some(Outcome::Aborted));
    // EXPORT_NAME cannot be refused with a reply: the session ends.
    check_error(
        tls(TlsPolicy::Required),
        &[
            client_flags(CLIENT_FIXED_NEWSTYLE),
            opt(OPT_EXPORT_NAME, b"disk"),
        ]
        .concat(),
        HandshakeError::TlsRequired,
        &[],
    );
}

#[test]
fn optional_tls_serves_plaintext_clients() {
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_GO, &info_request("disk", &[])),
    ]
    .concat();
    let result = run(tls(TlsPolicy::Optional), &input);
    assert_eq!(result.error, None);
    assert!(matches!(result.outcome, Some(Outcome::Transmission(_))));
}

#[test]
fn a_tls_only_export_needs_starttls_first() {
    let table = ExportTable::new(
        vec![
            Export::new("disk", DISK_SIZE),
            Export::new("secret", ARCHIVE_SIZE).tls_only(),
        ],
        Some("disk"),
    )
    .unwrap();
    let config = tls(TlsPolicy::Optional);
    let mut handshake = Handshake::new(Arc::new(table.clone()), config);
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES),
        opt(OPT_LIST, &[]),
        opt(OPT_INFO, &info_request("secret", &[])),
        opt(OPT_STARTTLS, &[]),
    ]
    .concat();
    let (output, consumed) = until_starttls(&mut handshake, &input);
    assert_eq!(consumed, input.len());
    let message = b"this export requires TLS: send NBD_OPT_STARTTLS first";
    assert_eq!(
        output,
        [
            // LIST leaves the TLS-only export out.
            rep(
                OPT_LIST,
                REP_SERVER,
                &[&4u32.to_be_bytes()[..], b"disk"].concat()
            ),
            rep(OPT_LIST, REP_ACK, &[]),
            rep(OPT_INFO, REP_ERR_TLS_REQD, message),
            rep(OPT_STARTTLS, REP_ACK, &[]),
        ]
        .concat()
    );
    assert!(handshake.take_start_tls());
    // In TLS it is served.
    let go = opt(OPT_GO, &info_request("secret", &[]));
    assert_eq!(handshake.handle_bytes(&go).unwrap(), go.len());
    assert!(matches!(
        handshake.outcome(),
        Some(Outcome::Transmission(_))
    ));
    // EXPORT_NAME for it without TLS ends the session.
    let mut plain = Handshake::new(Arc::new(table), config);
    let input = [
        client_flags(CLIENT_FIXED_NEWSTYLE),
        opt(OPT_EXPORT_NAME, b"secret"),
    ]
    .concat();
    assert_eq!(plain.handle_bytes(&input), Err(HandshakeError::TlsRequired));
}
