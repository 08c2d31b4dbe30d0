//! Unit tests of the connection core without a socket: every expected frame is built with
//! `reflex-proto`'s encoders, so the client and the codec of record agree byte for byte.

use reflex_proto::native::{
    Capabilities as WireCapabilities, HelloBody, NOTICE_REQUEST_ID, Namespace, Opcode,
    RequestFlags, RequestHeader, ResponseError, ResponseHeader, Status,
};

use crate::core::{ConnectionCore, CoreOptions, InterruptedRequest};
use crate::error::{ClientError, ProtocolError, SubmitError};

fn core_with_window(window_assumed: u32) -> ConnectionCore {
    ConnectionCore::new(CoreOptions { window_assumed })
}

/// Takes everything the core wants to send, as one send would.
fn sent_bytes(core: &mut ConnectionCore) -> Vec<u8> {
    let bytes = core
        .transmit_start()
        .map(<[u8]>::to_vec)
        .unwrap_or_default();
    if core.transmit_in_flight() {
        core.transmit_done(bytes.len());
    }
    bytes
}

fn response(opcode: Opcode, status: Status, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = ResponseHeader::new(opcode.as_u8(), status, request_id, payload.len() as u32)
        .to_bytes()
        .to_vec();
    bytes.extend_from_slice(payload);
    bytes
}

fn feed(core: &mut ConnectionCore, bytes: &[u8]) {
    let mut offset = 0;
    while offset < bytes.len() {
        let taken = core.handle_received_bytes(&bytes[offset..]);
        assert!(taken > 0, "receive buffer full");
        offset += taken;
    }
}

/// Completions as (id, opcode, status, data) until none is buffered.
fn drain(core: &mut ConnectionCore) -> Vec<(u64, Opcode, u16, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some(completion) = core.poll_completion().expect("no protocol error") {
        out.push((
            completion.request_id,
            completion.opcode,
            completion.status_raw,
            completion.data.to_vec(),
        ));
    }
    out
}

fn capabilities_body(window_requests: u32, io_size_max_bytes: u32) -> Vec<u8> {
    let namespaces = [
        Namespace {
            id: 0,
            size_bytes: 1 << 30,
            read_only: false,
        },
        Namespace {
            id: 9,
            size_bytes: 1 << 20,
            read_only: true,
        },
    ];
    let fixed = WireCapabilities {
        version: 1,
        block_size_bytes: 512,
        io_size_max_bytes,
        window_requests,
    };
    let mut body = vec![0u8; WireCapabilities::encoded_size(namespaces.len())];
    let written = fixed.encode_into(&namespaces, &mut body).expect("sized");
    assert_eq!(written, body.len());
    body
}

#[test]
fn hello_frame_and_capabilities_set_window_and_limits() {
    let mut core = core_with_window(1);
    core.submit_hello(0, (2 << 13) | 4).expect("accepted");
    let mut expected = RequestHeader {
        length_bytes: 16,
        ..RequestHeader::new(Opcode::Hello, 0)
    }
    .to_bytes()
    .to_vec();
    expected.extend_from_slice(
        &HelloBody {
            version_max: 1,
            io_priority: (2 << 13) | 4,
        }
        .to_bytes(),
    );
    assert_eq!(sent_bytes(&mut core), expected);
    assert!(core.capabilities().is_none());

    feed(
        &mut core,
        &response(
            Opcode::Hello,
            Status::Ok,
            0,
            &capabilities_body(64, 128 * 1024),
        ),
    );
    let completions = drain(&mut core);
    assert_eq!(completions.len(), 1);
    assert_eq!(completions[0].0, 0);
    assert_eq!(core.window(), 64);
    assert_eq!(core.max_io_size(), 128 * 1024);
    let capabilities = core.capabilities().expect("learnt");
    assert_eq!(capabilities.namespaces.len(), 2);
    assert_eq!(capabilities.namespace(9).map(|ns| ns.read_only), Some(true));
    assert_eq!(core.outstanding_count(), 0);
}

#[test]
fn read_write_flush_trim_frames_are_byte_exact() {
    let mut core = core_with_window(8);
    core.submit_read(1, 3, 4096, 8192).expect("read");
    core.submit_write(2, 3, 512, &[0xAB; 1024], true)
        .expect("write");
    core.submit_flush(3, 3).expect("flush");
    core.submit_trim(4, 3, 1 << 20, 65536).expect("trim");

    let mut expected = Vec::new();
    expected.extend_from_slice(&RequestHeader::read(1, 3, 4096, 8192).to_bytes());
    expected.extend_from_slice(
        &RequestHeader {
            flags: RequestFlags::FUA,
            offset_bytes: 512,
            length_bytes: 1024,
            namespace_id: 3,
            ..RequestHeader::new(Opcode::Write, 2)
        }
        .to_bytes(),
    );
    expected.extend_from_slice(&[0xAB; 1024]);
    expected.extend_from_slice(
        &RequestHeader {
            namespace_id: 3,
            ..RequestHeader::new(Opcode::Flush, 3)
        }
        .to_bytes(),
    );
    expected.extend_from_slice(
        &RequestHeader {
            offset_bytes: 1 << 20,
            length_bytes: 65536,
            namespace_id: 3,
            ..RequestHeader::new(Opcode::Trim, 4)
        }
        .to_bytes(),
    );
    assert_eq!(sent_bytes(&mut core), expected);
    assert_eq!(core.outstanding_count(), 4);
    assert_eq!(core.transmit_pending_bytes(), 0);
}

#[test]
fn submit_write_with_fills_payload_in_place() {
    let mut core = core_with_window(1);
    core.submit_write_with(7, 0, 0, 16, false, |payload| {
        for (index, byte) in payload.iter_mut().enumerate() {
            *byte = index as u8;
        }
    })
    .expect("write");
    let bytes = sent_bytes(&mut core);
    assert_eq!(bytes.len(), 32 + 16);
    assert_eq!(&bytes[32..], &(0u8..16).collect::<Vec<_>>()[..]);
}

#[test]
fn out_of_order_completions_match_by_id() {
    let mut core = core_with_window(4);
    for id in 10..13u64 {
        core.submit_read(id, 0, id * 512, 512).expect("read");
    }
    sent_bytes(&mut core);
    let mut input = Vec::new();
    for id in [12u64, 10, 11] {
        input.extend(response(Opcode::Read, Status::Ok, id, &[id as u8; 512]));
    }
    // Byte by byte: framing must not depend on how the stream is cut.
    for byte in &input {
        feed(&mut core, std::slice::from_ref(byte));
    }
    let completions = drain(&mut core);
    let ids: Vec<u64> = completions.iter().map(|c| c.0).collect();
    assert_eq!(ids, vec![12, 10, 11]);
    for (id, opcode, status, data) in completions {
        assert_eq!(opcode, Opcode::Read);
        assert_eq!(status, 0);
        assert_eq!(data, vec![id as u8; 512]);
    }
    assert_eq!(core.outstanding_count(), 0);
}

#[test]
fn window_duplicate_reserved_and_size_limits_refuse_without_trace() {
    let mut core = core_with_window(2);
    core.submit_read(1, 0, 0, 512).expect("first");
    assert_eq!(
        core.submit_read(1, 0, 0, 512),
        Err(SubmitError::DuplicateId(1))
    );
    assert_eq!(
        core.submit_read(NOTICE_REQUEST_ID, 0, 0, 512),
        Err(SubmitError::ReservedId(NOTICE_REQUEST_ID))
    );
    assert!(matches!(
        core.submit_read(2, 0, 0, (1 << 20) + 512),
        Err(SubmitError::TooLarge { .. })
    ));
    core.submit_flush(2, 0).expect("second");
    let pending = core.transmit_pending_bytes();
    assert_eq!(
        core.submit_write(3, 0, 0, &[0; 512], false),
        Err(SubmitError::WindowFull { window_requests: 2 })
    );
    assert_eq!(core.transmit_pending_bytes(), pending, "refusal left bytes");
    assert_eq!(core.outstanding_count(), 2);

    sent_bytes(&mut core);
    feed(&mut core, &response(Opcode::Flush, Status::Ok, 2, &[]));
    assert_eq!(drain(&mut core).len(), 1);
    core.submit_write(3, 0, 0, &[0; 512], false)
        .expect("room again");
}

#[test]
fn error_status_becomes_typed_error_with_reason() {
    let mut core = core_with_window(4);
    core.submit_read(5, 0, 1 << 40, 4096).expect("read");
    core.submit_write(6, 0, 0, &[1; 512], false).expect("write");
    sent_bytes(&mut core);
    let mut input = response(Opcode::Read, Status::OutOfRange, 5, b"beyond the end");
    input.extend(response(Opcode::Write, Status::Ok, 6, &[]));
    feed(&mut core, &input);

    let completion = core.poll_completion().expect("ok").expect("buffered");
    assert!(!completion.is_ok());
    match completion.result() {
        Err(ClientError::Status {
            opcode: Opcode::Read,
            status: Status::OutOfRange,
            reason: Some(reason),
        }) => assert_eq!(reason, "beyond the end"),
        other => panic!("unexpected {other:?}"),
    }
    let completion = core.poll_completion().expect("ok").expect("buffered");
    assert_eq!(completion.result().expect("ok"), &[] as &[u8]);
}

#[test]
fn out_of_space_is_a_typed_status_error() {
    let mut core = core_with_window(1);
    core.submit_write(7, 0, 0, &[1; 512], false).expect("write");
    sent_bytes(&mut core);
    feed(&mut core, &response(Opcode::Write, Status::NoSpace, 7, &[]));
    let completion = core.poll_completion().expect("ok").expect("buffered");
    let error = completion.result().expect_err("no space is an error");
    assert_eq!(error.status(), Some(Status::NoSpace));
    assert!(matches!(
        error,
        ClientError::Status {
            opcode: Opcode::Write,
            status: Status::NoSpace,
            reason: None,
        }
    ));
}

#[test]
fn unknown_status_is_an_error_not_a_protocol_violation() {
    let mut core = core_with_window(1);
    core.submit_flush(1, 0).expect("flush");
    sent_bytes(&mut core);
    let mut bytes = response(Opcode::Flush, Status::Ok, 1, &[]);
    bytes[6..8].copy_from_slice(&77u16.to_le_bytes());
    feed(&mut core, &bytes);
    let completion = core.poll_completion().expect("ok").expect("buffered");
    assert!(matches!(
        completion.result(),
        Err(ClientError::UnknownStatus { status_raw: 77, .. })
    ));
}

#[test]
fn notices_are_reported_without_a_request() {
    let mut core = core_with_window(1);
    feed(
        &mut core,
        &response(
            Opcode::Renegotiate,
            Status::Ok,
            NOTICE_REQUEST_ID,
            b"slow down",
        ),
    );
    let completion = core.poll_completion().expect("ok").expect("buffered");
    assert!(completion.is_notice());
    assert_eq!(completion.data, b"slow down");
}

/// Feeds `bytes` after one outstanding READ of 512 bytes (id 1) and returns the error.
fn protocol_error_after(bytes: &[u8]) -> ProtocolError {
    let mut core = core_with_window(2);
    core.submit_read(1, 0, 0, 512).expect("read");
    sent_bytes(&mut core);
    feed(&mut core, bytes);
    let error = core.poll_completion().expect_err("violation");
    // The connection stays broken: same error again, and no more submits.
    assert_eq!(core.poll_completion().expect_err("still broken"), error);
    assert_eq!(core.submit_flush(2, 0), Err(SubmitError::Broken));
    error
}

#[test]
fn server_violations_break_the_connection_without_panicking() {
    assert_eq!(
        protocol_error_after(&response(Opcode::Read, Status::Ok, 99, &[0; 512])),
        ProtocolError::UnknownRequestId(99)
    );
    assert!(matches!(
        protocol_error_after(&response(Opcode::Write, Status::Ok, 1, &[])),
        ProtocolError::OpcodeMismatch {
            expected: Opcode::Read,
            got: 0x03
        }
    ));
    assert!(matches!(
        protocol_error_after(&response(Opcode::Read, Status::Ok, 1, &[0; 511])),
        ProtocolError::UnexpectedLength { got: 511, .. }
    ));
    let mut bad_magic = response(Opcode::Read, Status::Ok, 1, &[0; 512]);
    bad_magic[0] = b'X';
    assert!(matches!(
        protocol_error_after(&bad_magic),
        ProtocolError::Header(ResponseError::BadMagic { .. })
    ));
    let mut bad_version = response(Opcode::Read, Status::Ok, 1, &[0; 512]);
    bad_version[4] = 2;
    assert!(matches!(
        protocol_error_after(&bad_version),
        ProtocolError::Header(ResponseError::UnsupportedVersion { found: 2 })
    ));
    // An error reason longer than any control body is refused before it is buffered.
    let mut huge_reason = ResponseHeader::new(Opcode::Read.as_u8(), Status::IoError, 1, u32::MAX)
        .to_bytes()
        .to_vec();
    huge_reason.extend_from_slice(&[0; 16]);
    assert!(matches!(
        protocol_error_after(&huge_reason),
        ProtocolError::UnexpectedLength { .. }
    ));
}

#[test]
fn write_ok_with_payload_and_malformed_capabilities_are_violations() {
    let mut core = core_with_window(2);
    core.submit_write(1, 0, 0, &[0; 512], false).expect("write");
    sent_bytes(&mut core);
    feed(&mut core, &response(Opcode::Write, Status::Ok, 1, &[0; 4]));
    assert!(matches!(
        core.poll_completion(),
        Err(ProtocolError::UnexpectedLength {
            opcode: Opcode::Write,
            ..
        })
    ));

    let mut core = core_with_window(1);
    core.submit_hello(0, 0).expect("hello");
    sent_bytes(&mut core);
    let body = capabilities_body(0, 1 << 20);
    feed(&mut core, &response(Opcode::Hello, Status::Ok, 0, &body));
    assert!(matches!(
        core.poll_completion(),
        Err(ProtocolError::Capabilities(_))
    ));
}

#[test]
fn lent_buffers_never_move() {
    let mut core = core_with_window(64);
    core.submit_read(1, 0, 0, 512).expect("read");
    let lent = core.transmit_start().expect("pending").as_ptr();
    // A write larger than the spare transmit capacity would have to move the lent bytes.
    let big = vec![0u8; 1 << 20];
    assert_eq!(
        core.submit_write(2, 0, 0, &big, false),
        Err(SubmitError::BuffersBusy)
    );
    core.transmit_done(32);
    core.submit_write(2, 0, 0, &big, false)
        .expect("after the send");
    assert!(!lent.is_null());

    // The same for the receive side: a READ larger than the receive buffer.
    let space = core.receive_start().expect("space").len();
    assert!(space < (1 << 20));
    assert_eq!(
        core.submit_read(3, 0, 0, 1 << 20),
        Err(SubmitError::BuffersBusy)
    );
    core.receive_done(0);
    core.submit_read(3, 0, 0, 1 << 20)
        .expect("after the receive");
}

#[test]
fn large_reads_and_compaction_keep_frames_whole() {
    let mut core = core_with_window(8);
    core.reserve(8, 1 << 20);
    for id in 0..4u64 {
        core.submit_read(id, 0, 0, 1 << 20).expect("read");
    }
    core.submit_read(4, 0, 0, 4096).expect("small");
    sent_bytes(&mut core);
    let mut input = Vec::new();
    for id in [4u64, 2, 0, 3, 1] {
        let length = if id == 4 { 4096 } else { 1 << 20 };
        let payload: Vec<u8> = (0..length).map(|i| (i as u64 ^ id) as u8).collect();
        input.extend(response(Opcode::Read, Status::Ok, id, &payload));
    }
    // Feed in odd-sized pieces, draining in between, so frames straddle compactions.
    let mut seen = Vec::new();
    for piece in input.chunks(300_007) {
        let mut offset = 0;
        while offset < piece.len() {
            offset += core.handle_received_bytes(&piece[offset..]);
            for (id, _, _, data) in drain(&mut core) {
                assert!(
                    data.iter()
                        .enumerate()
                        .all(|(i, byte)| *byte == (i as u64 ^ id) as u8)
                );
                seen.push(id);
            }
        }
    }
    assert_eq!(seen, vec![4, 2, 0, 3, 1]);
    assert_eq!(core.outstanding_count(), 0);
}

#[test]
fn mutated_server_streams_never_panic() {
    // Deterministic xorshift; each case mutates a valid answer stream in a few places.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _case in 0..2000 {
        let mut core = core_with_window(8);
        core.submit_read(1, 0, 0, 4096).expect("read");
        core.submit_write(2, 0, 0, &[0; 512], false).expect("write");
        core.submit_flush(3, 0).expect("flush");
        core.submit_hello(4, 0).expect("hello");
        sent_bytes(&mut core);
        let mut stream = response(Opcode::Flush, Status::Ok, 3, &[]);
        stream.extend(response(Opcode::Read, Status::Ok, 1, &[9; 4096]));
        stream.extend(response(Opcode::Write, Status::IoError, 2, b"bad"));
        stream.extend(response(
            Opcode::Hello,
            Status::Ok,
            4,
            &capabilities_body(4, 1 << 20),
        ));
        for _ in 0..(next() % 4) {
            let at = (next() as usize) % stream.len();
            stream[at] = next() as u8;
        }
        if next() % 4 == 0 {
            let cut = (next() as usize) % stream.len();
            stream.truncate(cut);
        }
        let mut offset = 0;
        'feed: while offset < stream.len() {
            let piece = 1 + (next() as usize) % 700;
            let end = (offset + piece).min(stream.len());
            offset += core.handle_received_bytes(&stream[offset..end]);
            loop {
                match core.poll_completion() {
                    Ok(Some(completion)) => {
                        let _ = completion.result();
                    }
                    Ok(None) => break,
                    Err(_) => break 'feed,
                }
            }
        }
        assert!(core.outstanding_count() <= 4);
    }
}

#[test]
fn tenant_requests_encode_their_bodies_and_decode_their_answers() {
    use reflex_proto::native::{
        RegisterBody, RenegotiateBody, TenantClassRequest, decode_handle, encode_handle,
    };
    let mut core = core_with_window(4);
    let body = RegisterBody {
        namespace_id: 1,
        class: TenantClassRequest::LatencyCritical {
            latency_us_p95: 500,
            iops: 12_000,
            read_percent: 100,
        },
        read_only: false,
        handle: 0,
    };
    core.submit_register(1, &body).expect("register");
    core.submit_bind(2, 9).expect("bind");
    core.submit_unregister(3, 9).expect("unregister");
    let sent = sent_bytes(&mut core);
    let (header, used) = reflex_proto::native::decode_request(&sent)
        .expect("framing")
        .expect("whole");
    assert_eq!(header.opcode(), Ok(Opcode::Register));
    assert_eq!(
        RegisterBody::decode(&sent[used..used + 32]),
        Ok(body),
        "the body follows the header"
    );
    let rest = &sent[used + 32..];
    let (bind, used) = reflex_proto::native::decode_request(rest)
        .expect("framing")
        .expect("whole");
    assert_eq!(bind.opcode(), Ok(Opcode::Bind));
    assert_eq!(decode_handle(&rest[used..used + 8]), Ok(9));

    let mut answers = response(Opcode::Register, Status::Ok, 1, &encode_handle(42));
    answers.extend(response(Opcode::Bind, Status::Ok, 2, &[]));
    answers.extend(response(
        Opcode::Unregister,
        Status::Refused,
        3,
        b"needs 36K tokens/s, 5K left at 500 \xc2\xb5s",
    ));
    let notice = RenegotiateBody {
        handle: 42,
        episode: 1,
        reserved_iops: 12_000,
        reserved_tokens_per_sec: 12_000,
        observed_iops: 20_000,
        reason: reflex_proto::native::RenegotiateReason::DeficitLimit,
        granted_tokens_per_sec: 12_000,
    };
    answers.extend(response(
        Opcode::Renegotiate,
        Status::Ok,
        NOTICE_REQUEST_ID,
        &notice.to_bytes(),
    ));
    feed(&mut core, &answers);
    let completion = core.poll_completion().expect("ok").expect("register");
    assert_eq!(completion.tenant_handle().expect("handle"), 42);
    let completion = core.poll_completion().expect("ok").expect("bind");
    assert!(completion.result().is_ok());
    let completion = core.poll_completion().expect("ok").expect("refused");
    match completion.result() {
        Err(ClientError::Refused { reason }) => {
            assert_eq!(reason, "needs 36K tokens/s, 5K left at 500 µs")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let completion = core.poll_completion().expect("ok").expect("notice");
    assert_eq!(completion.notice(), Some(notice));
}

#[test]
fn a_register_answer_without_a_handle_breaks_the_connection() {
    let mut core = core_with_window(1);
    core.submit_register(
        1,
        &reflex_proto::native::RegisterBody {
            namespace_id: 1,
            class: reflex_proto::native::TenantClassRequest::BestEffort,
            read_only: false,
            handle: 0,
        },
    )
    .expect("register");
    sent_bytes(&mut core);
    feed(
        &mut core,
        &response(Opcode::Register, Status::Ok, 1, &[1, 2, 3]),
    );
    assert!(matches!(
        core.poll_completion(),
        Err(ProtocolError::UnexpectedLength { .. })
    ));
}

/// One of each request, with a distinct id, namespace and range.
fn submit_one_of_each(core: &mut ConnectionCore) {
    core.submit_write(10, 1, 4096, &[5u8; 1024], true)
        .expect("write");
    core.submit_read(11, 2, 8192, 512).expect("read");
    core.submit_flush(12, 3).expect("flush");
    core.submit_trim(13, 1, 1 << 20, 4096).expect("trim");
    core.submit_bind(14, 77).expect("bind");
    core.submit_unregister(15, 78).expect("unregister");
}

#[test]
fn a_lost_connection_returns_unanswered_requests_in_submission_order() {
    let mut core = core_with_window(16);
    submit_one_of_each(&mut core);
    sent_bytes(&mut core);
    // The READ and the UNREGISTER were answered before the break: they are not interrupted.
    let mut answers = response(Opcode::Read, Status::Ok, 11, &[3u8; 512]);
    answers.extend(response(Opcode::Unregister, Status::Ok, 15, &[]));
    // Half a header of the next answer: not an answer.
    answers.extend(&response(Opcode::Write, Status::Ok, 10, &[])[..10]);
    feed(&mut core, &answers);
    let answered: Vec<u64> = drain(&mut core).iter().map(|answer| answer.0).collect();
    assert_eq!(answered, vec![11, 15]);

    let interrupted = core.handle_connection_lost();
    let request = |request_id, opcode, namespace, offset_bytes, length_bytes| InterruptedRequest {
        request_id,
        opcode,
        namespace,
        offset_bytes,
        length_bytes,
        fua: false,
        handle: None,
    };
    assert_eq!(
        interrupted,
        vec![
            InterruptedRequest {
                fua: true,
                ..request(10, Opcode::Write, 1, 4096, 1024)
            },
            request(12, Opcode::Flush, 3, 0, 0),
            request(13, Opcode::Trim, 1, 1 << 20, 4096),
            InterruptedRequest {
                handle: Some(77),
                ..request(14, Opcode::Bind, 0, 0, 0)
            },
        ]
    );
    let repeatable: Vec<bool> = interrupted
        .iter()
        .map(InterruptedRequest::is_safe_to_repeat)
        .collect();
    assert_eq!(repeatable, vec![false, true, false, true]);
    assert!(core.is_disconnected());
    assert_eq!(core.outstanding_count(), 0);
    assert_eq!(
        core.submit_read(20, 1, 0, 512),
        Err(SubmitError::Disconnected)
    );
    assert!(core.transmit_start().is_none());
    assert!(core.receive_start().is_none());
    assert_eq!(core.poll_completion(), Ok(None));
    assert!(
        core.handle_connection_lost().is_empty(),
        "a second call finds nothing"
    );
}

#[test]
fn repeated_requests_are_byte_identical_on_the_new_connection() {
    let mut old = core_with_window(16);
    submit_one_of_each(&mut old);
    let first_bytes = sent_bytes(&mut old);
    let repeatable: Vec<_> = old
        .handle_connection_lost()
        .into_iter()
        .filter(|request| request.is_safe_to_repeat())
        .collect();
    assert_eq!(
        repeatable.iter().map(|r| r.request_id).collect::<Vec<_>>(),
        vec![11, 12, 14]
    );
    let mut new = core_with_window(16);
    for request in &repeatable {
        new.resubmit(request).expect("resubmit");
    }
    let mut expected = core_with_window(16);
    expected.submit_read(11, 2, 8192, 512).expect("read");
    expected.submit_flush(12, 3).expect("flush");
    expected.submit_bind(14, 77).expect("bind");
    assert_eq!(sent_bytes(&mut new), sent_bytes(&mut expected));
    assert_ne!(first_bytes.len(), 0);
    assert_eq!(new.outstanding_count(), 3);
}

#[test]
fn the_bound_handle_follows_answered_binds_only() {
    let mut core = core_with_window(4);
    assert_eq!(core.bound_handle(), 0);
    core.submit_bind(1, 42).expect("bind");
    sent_bytes(&mut core);
    assert_eq!(core.bound_handle(), 0, "not bound before the answer");
    feed(&mut core, &response(Opcode::Bind, Status::Ok, 1, &[]));
    drain(&mut core);
    assert_eq!(core.bound_handle(), 42);
    core.submit_bind(2, 43).expect("bind");
    sent_bytes(&mut core);
    feed(&mut core, &response(Opcode::Bind, Status::Invalid, 2, &[]));
    drain(&mut core);
    assert_eq!(core.bound_handle(), 42, "a refused BIND changes nothing");
    core.submit_bind(3, 0).expect("bind");
    sent_bytes(&mut core);
    feed(&mut core, &response(Opcode::Bind, Status::Ok, 3, &[]));
    drain(&mut core);
    assert_eq!(core.bound_handle(), 0, "back to the default tenant");
}
