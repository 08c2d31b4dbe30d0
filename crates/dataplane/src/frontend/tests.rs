//! Front-end decoding and encoding, one `check` per protocol.

use std::sync::Arc;

use reflex_proto::native::{self, Status};
use reflex_proto::nbd::{self, Errno};
use reflex_proto::original;

use super::*;

fn namespaces() -> NamespaceSet {
    let device: Arc<dyn reflex_flash::Device> =
        Arc::new(reflex_flash::null::NullDevice::new(1 << 20));
    NamespaceSet::new(vec![(7, device, false)])
}

fn check(mut frontend: Frontend, input: &[u8], expected: Decoded) {
    assert_eq!(frontend.decode(input, &namespaces()), expected);
}

fn io(kind: IoKind, offset_bytes: u64, length_bytes: u32) -> Action {
    Action::Io(IoRequest {
        kind,
        namespace_index: 0,
        offset_bytes,
        length_bytes,
        tenant: TenantRef::NONE,
    })
}

impl Action {
    fn with_tenant(self, tenant: TenantRef) -> Action {
        match self {
            Action::Io(io) => Action::Io(IoRequest { tenant, ..io }),
            other => other,
        }
    }
}

#[test]
fn native_requests() {
    let read = native::RequestHeader::read(5, 7, 4096, 4096).to_bytes();
    check(Frontend::Native, &read[..10], Decoded::NeedMore);
    check(
        Frontend::Native,
        &read,
        Decoded::Request {
            header_bytes: 32,
            payload_bytes: 0,
            tag: Tag::Native {
                opcode_raw: 2,
                request_id: 5,
            },
            action: io(IoKind::Read, 4096, 4096),
        },
    );
    let write = native::RequestHeader::write(6, 7, 1 << 20, 512, false).to_bytes();
    check(
        Frontend::Native,
        &write,
        Decoded::Request {
            header_bytes: 32,
            payload_bytes: 512,
            tag: Tag::Native {
                opcode_raw: 3,
                request_id: 6,
            },
            action: Action::Reply(Answer::Native(Status::OutOfRange)),
        },
    );
    let mut bad = read;
    bad[0] = b'X';
    assert!(matches!(
        Frontend::Native.decode(&bad, &namespaces()),
        Decoded::Close(_)
    ));
    let hello = native::RequestHeader::hello(9).to_bytes();
    check(Frontend::Native, &hello, Decoded::NeedMore);
    let mut with_body = hello.to_vec();
    with_body.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    check(
        Frontend::Native,
        &with_body,
        Decoded::Request {
            header_bytes: 48,
            payload_bytes: 0,
            tag: Tag::Native {
                opcode_raw: 1,
                request_id: 9,
            },
            action: Action::Hello { io_priority: 0 },
        },
    );
    // The client's ionice (best effort, level 7) travels with the HELLO.
    with_body[34] = 0x07;
    with_body[35] = 0x40;
    check(
        Frontend::Native,
        &with_body,
        Decoded::Request {
            header_bytes: 48,
            payload_bytes: 0,
            tag: Tag::Native {
                opcode_raw: 1,
                request_id: 9,
            },
            action: Action::Hello {
                io_priority: (2 << 13) | 7,
            },
        },
    );
}

#[test]
fn original_requests() {
    let mut frontend = Frontend::Original {
        namespace_index: 0,
        tenant: TenantRef::NONE,
        device_queue: None,
    };
    let header = original::Header {
        opcode: original::Opcode::Write,
        handle: [1; 8],
        lba: 8,
        lba_count: 8,
    };
    let decoded = frontend.decode(&header.to_bytes(), &namespaces());
    assert!(matches!(
        decoded,
        Decoded::Request {
            payload_bytes: 4096,
            ..
        }
    ));
    let beyond = original::Header {
        lba: 1 << 20,
        ..header
    };
    assert!(matches!(
        frontend.decode(&beyond.to_bytes(), &namespaces()),
        Decoded::Close(_)
    ));
    let tag = Tag::Original { response: header };
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    let failure = Answer::DeviceError { errno: libc::EIO };
    assert_eq!(frontend.encode_response(&tag, failure, 0, &mut out), None);
    assert_eq!(
        frontend.encode_response(&tag, Answer::Ok, 0, &mut out),
        Some(24)
    );
}

// ----- NBD -----------------------------------------------------------------------------

const TENANT: TenantRef = TenantRef { handle: 7, id: 3 };

fn nbd_frontend() -> Frontend {
    let exports = NbdExports::new(
        vec![
            (
                nbd::Export::new("ns7", 1 << 20),
                ExportBinding {
                    namespace_index: 0,
                    tenant: TENANT,
                    device_queue: None,
                },
            ),
            (
                nbd::Export::new("ro", 1 << 20).read_only(),
                ExportBinding {
                    namespace_index: 0,
                    tenant: TenantRef::NONE,
                    device_queue: None,
                },
            ),
        ],
        Some("ns7"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    Frontend::new(Protocol::Nbd, Some(&Arc::new(exports)), None)
}

fn option(code: u32, data: &[u8]) -> Vec<u8> {
    let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&code.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn go(name: &str) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    option(nbd::option::GO, &data)
}

fn request(command: nbd::CommandType, flags: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    nbd::RequestHeader {
        flags,
        command_raw: command.as_u16(),
        cookie,
        offset_bytes: offset,
        length_bytes: len,
    }
    .to_bytes()
    .to_vec()
}

/// Decodes `input` to the end, collecting output and returning the first request found.
fn drive(frontend: &mut Frontend, mut input: &[u8], output: &mut Vec<u8>) -> Decoded {
    let namespaces = namespaces();
    loop {
        match frontend.decode(input, &namespaces) {
            Decoded::Consumed(count) => input = &input[count..],
            Decoded::Request {
                action: Action::Output,
                header_bytes: 0,
                ..
            } => {
                let mut run = vec![0u8; frontend.pending_output_bytes()];
                assert!(!run.is_empty());
                let written = frontend.write_output(&mut run);
                assert_eq!(written, run.len());
                output.extend_from_slice(&run);
            }
            other => return other,
        }
    }
}

fn client_start(name: &str, structured: bool) -> Vec<u8> {
    let mut input = nbd::client_flags::FIXED_NEWSTYLE.to_be_bytes().to_vec();
    if structured {
        input.extend_from_slice(&option(nbd::option::STRUCTURED_REPLY, &[]));
    }
    input.extend_from_slice(&go(name));
    input
}

#[test]
fn nbd_handshake_then_pipelined_requests() {
    let mut frontend = nbd_frontend();
    let mut output = Vec::new();
    // Nothing received yet: the greeting goes out first.
    assert_eq!(drive(&mut frontend, &[], &mut output), Decoded::NeedMore);
    assert_eq!(output.len(), nbd::GREETING_SIZE);
    assert_eq!(output[..8], nbd::NBD_MAGIC.to_be_bytes());
    let mut input = client_start("", false);
    let read = request(nbd::CommandType::Read, 0, 42, 4096, 8192);
    input.extend_from_slice(&read);
    let before = output.len();
    let decoded = drive(&mut frontend, &input, &mut output);
    // INFO_EXPORT, INFO_BLOCK_SIZE, ACK: three option replies.
    assert!(output.len() > before + 3 * nbd::OPTION_REPLY_HEADER_SIZE);
    let Decoded::Request {
        header_bytes,
        payload_bytes,
        tag,
        action,
    } = decoded
    else {
        panic!("expected the pipelined READ, got {decoded:?}");
    };
    assert_eq!((header_bytes, payload_bytes), (nbd::REQUEST_HEADER_SIZE, 0));
    assert_eq!(
        action,
        Action::Io(IoRequest {
            kind: IoKind::Read,
            namespace_index: 0,
            offset_bytes: 4096,
            length_bytes: 8192,
            tenant: TENANT,
        })
    );
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    let length = frontend.encode_response(&tag, Answer::Ok, 8192, &mut out);
    assert_eq!(length, Some(nbd::SIMPLE_REPLY_SIZE));
    assert_eq!(out[..4], nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
    assert_eq!(out[8..16], 42u64.to_be_bytes());
    // A device error becomes an NBD errno in a simple reply.
    let failure = Answer::DeviceError {
        errno: libc::ENOSPC,
    };
    assert_eq!(
        frontend.encode_response(&tag, failure, 0, &mut out),
        Some(16)
    );
    assert_eq!(out[4..8], (Errno::NoSpc as u32).to_be_bytes());
}

#[test]
fn nbd_structured_reads_and_refusals() {
    let mut frontend = nbd_frontend();
    let mut output = Vec::new();
    let mut input = client_start("ro", true);
    let trim = request(nbd::CommandType::Trim, 0, 7, 0, 4096);
    input.extend_from_slice(&trim);
    let Decoded::Request {
        header_bytes,
        tag,
        action,
        ..
    } = drive(&mut frontend, &input, &mut output)
    else {
        panic!("expected a request");
    };
    assert_eq!(header_bytes, nbd::REQUEST_HEADER_SIZE);
    assert_eq!(tag, Tag::NbdRefused { cookie: 7 });
    assert_eq!(action, Action::Reply(Answer::Nbd(Errno::Perm)));
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    let length = frontend.encode_response(&tag, Answer::Nbd(Errno::Perm), 0, &mut out);
    assert_eq!(length, Some(nbd::CHUNK_HEADER_SIZE + 6));
    assert_eq!(out[..4], nbd::STRUCTURED_REPLY_MAGIC.to_be_bytes());

    let read = request(nbd::CommandType::Read, 0, 8, 512, 512);
    let Decoded::Request { tag, .. } = drive(&mut frontend, &read, &mut output) else {
        panic!("expected a request");
    };
    let length = frontend.encode_response(&tag, Answer::Ok, 512, &mut out);
    assert_eq!(length, Some(nbd::CHUNK_HEADER_SIZE + 8));
    assert_eq!(out[6..8], nbd::chunk::TYPE_OFFSET_DATA.to_be_bytes());
    assert_eq!(out[20..28], 512u64.to_be_bytes());

    // A WRITE refused (read-only) still declares its payload so the stream stays in step.
    let write = request(nbd::CommandType::Write, 0, 9, 0, 1024);
    let Decoded::Request { payload_bytes, .. } = drive(&mut frontend, &write, &mut output) else {
        panic!("expected a request");
    };
    assert_eq!(payload_bytes, 1024);

    // Shutdown: ESHUTDOWN for new requests, DISC still ends the session.
    assert!(frontend.begin_shutdown());
    let Decoded::Request { action, .. } = drive(&mut frontend, &read, &mut output) else {
        panic!("expected a request");
    };
    assert_eq!(action, Action::Reply(Answer::Nbd(Errno::Shutdown)));
    let disc = request(nbd::CommandType::Disc, 0, 10, 0, 0);
    assert_eq!(
        drive(&mut frontend, &disc, &mut output),
        Decoded::Finish {
            consumed_bytes: nbd::REQUEST_HEADER_SIZE
        }
    );
    assert_eq!(drive(&mut frontend, &read, &mut output), Decoded::NeedMore);
}

#[test]
fn nbd_abort_and_broken_handshakes() {
    let mut frontend = nbd_frontend();
    let mut output = Vec::new();
    let mut input = nbd::client_flags::FIXED_NEWSTYLE.to_be_bytes().to_vec();
    input.extend_from_slice(&option(nbd::option::ABORT, &[]));
    assert_eq!(
        drive(&mut frontend, &input, &mut output),
        Decoded::Finish { consumed_bytes: 0 }
    );
    // Greeting, then the ACK to ABORT.
    assert_eq!(
        output.len(),
        nbd::GREETING_SIZE + nbd::OPTION_REPLY_HEADER_SIZE
    );
    assert!(!frontend.begin_shutdown());

    let mut frontend = nbd_frontend();
    let unknown_flags = 0x80u32.to_be_bytes();
    assert!(matches!(
        drive(&mut frontend, &unknown_flags, &mut output),
        Decoded::Close(_)
    ));
    let mut frontend = nbd_frontend();
    let mut input = client_start("ns7", false);
    input.extend_from_slice(b"not an NBD request, long enough to decode");
    assert!(matches!(
        drive(&mut frontend, &input, &mut output),
        Decoded::Close(_)
    ));
}

#[test]
fn nbd_error_mapping() {
    let errno = |linux| Answer::DeviceError { errno: linux }.nbd_errno();
    assert_eq!(errno(libc::EIO), Errno::Io);
    assert_eq!(errno(libc::ENOSPC), Errno::NoSpc);
    assert_eq!(errno(libc::EDQUOT), Errno::NoSpc);
    assert_eq!(errno(libc::EROFS), Errno::Perm);
    assert_eq!(errno(libc::EINVAL), Errno::Inval);
    // Values the spec asks servers not to send here.
    for linux in [
        libc::ENOMEM,
        libc::EOVERFLOW,
        libc::EOPNOTSUPP,
        libc::ESHUTDOWN,
    ] {
        assert_eq!(errno(linux), Errno::Io, "errno {linux}");
    }
    assert_eq!(Answer::Unsupported.nbd_errno(), Errno::Io);
    assert_eq!(Answer::Nbd(Errno::Perm).nbd_errno(), Errno::Perm);
    assert_eq!(Answer::Unsupported.native_status(), Status::Invalid);
    assert_eq!(
        Answer::DeviceError { errno: libc::EIO }.native_status(),
        Status::IoError
    );
}

#[test]
fn out_of_space_has_its_own_native_status() {
    let status = |linux| Answer::DeviceError { errno: linux }.native_status();
    assert_eq!(status(libc::ENOSPC), Status::NoSpace);
    assert_eq!(status(libc::EDQUOT), Status::NoSpace);
    assert_eq!(status(libc::EIO), Status::IoError);
    assert_eq!(status(libc::EROFS), Status::IoError);
}

/// SET_META_CONTEXT data selecting `base:allocation` on `name`.
fn set_base_allocation(name: &str) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&1u32.to_be_bytes());
    data.extend_from_slice(&(nbd::meta_context::BASE_ALLOCATION.len() as u32).to_be_bytes());
    data.extend_from_slice(nbd::meta_context::BASE_ALLOCATION.as_bytes());
    option(nbd::option::SET_META_CONTEXT, &data)
}

#[test]
fn nbd_cache_fast_zero_block_status_and_read_pieces() {
    let mut frontend = nbd_frontend();
    let mut output = Vec::new();
    let mut input = nbd::client_flags::FIXED_NEWSTYLE.to_be_bytes().to_vec();
    input.extend_from_slice(&option(nbd::option::STRUCTURED_REPLY, &[]));
    input.extend_from_slice(&set_base_allocation("ns7"));
    input.extend_from_slice(&go("ns7"));
    // CACHE: success at once, nothing to do.
    input.extend_from_slice(&request(nbd::CommandType::Cache, 0, 1, 0, 4096));
    let Decoded::Request { tag, action, .. } = drive(&mut frontend, &input, &mut output) else {
        panic!("expected CACHE");
    };
    assert_eq!(action, Action::Reply(Answer::Ok));
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    assert_eq!(
        frontend.encode_response(&tag, Answer::Ok, 0, &mut out),
        Some(nbd::SIMPLE_REPLY_SIZE)
    );
    // WRITE_ZEROES with FAST_ZERO.
    let flags = nbd::command_flags::FAST_ZERO;
    let zeroes = request(nbd::CommandType::WriteZeroes, flags, 2, 100, 50);
    let Decoded::Request { action, .. } = drive(&mut frontend, &zeroes, &mut output) else {
        panic!("expected WRITE_ZEROES");
    };
    assert_eq!(
        action,
        io(
            IoKind::WriteZeroes {
                fua: false,
                no_hole: false,
                fast: true
            },
            100,
            50
        )
        .with_tenant(TENANT)
    );
    // BLOCK_STATUS: its payload is the context id and one descriptor per extent.
    let flags = nbd::command_flags::REQ_ONE;
    let status = request(nbd::CommandType::BlockStatus, flags, 3, 0, 8192);
    let Decoded::Request { tag, action, .. } = drive(&mut frontend, &status, &mut output) else {
        panic!("expected BLOCK_STATUS");
    };
    assert_eq!(
        action,
        io(IoKind::BlockStatus { req_one: true }, 0, 8192).with_tenant(TENANT)
    );
    let extents = [
        reflex_flash::Extent {
            length_bytes: 4096,
            allocation: reflex_flash::Allocation::Hole,
        },
        reflex_flash::Extent {
            length_bytes: 4096,
            allocation: reflex_flash::Allocation::Data,
        },
    ];
    let mut body = [0u8; BLOCK_STATUS_BODY_BYTES_MAX];
    let length = frontend.write_block_status(&extents, &mut body);
    assert_eq!(length, 20);
    assert_eq!(
        body[..4],
        nbd::meta_context::BASE_ALLOCATION_ID.to_be_bytes()
    );
    assert_eq!(body[8..12], 3u32.to_be_bytes(), "a hole reads as zeroes");
    assert_eq!(body[16..20], 0u32.to_be_bytes());
    assert_eq!(
        frontend.encode_response(&tag, Answer::Ok, 20, &mut out),
        Some(nbd::CHUNK_HEADER_SIZE)
    );
    assert_eq!(out[6..8], nbd::chunk::TYPE_BLOCK_STATUS.to_be_bytes());
    assert_eq!(out[16..20], 20u32.to_be_bytes());
    // A READ in pieces: structured, one OFFSET_DATA chunk each, DONE on the last.
    let read = request(nbd::CommandType::Read, 0, 4, 7, 100_000);
    let Decoded::Request { tag, .. } = drive(&mut frontend, &read, &mut output) else {
        panic!("expected READ");
    };
    assert!(!frontend.read_pieces_exclusive());
    let piece = |first, last| ReadPiece {
        offset_bytes: 7,
        length_bytes: 1000,
        first,
        last,
    };
    let length = frontend.encode_read_piece(&tag, piece(true, false), &mut out);
    assert_eq!(length, Some(nbd::CHUNK_HEADER_SIZE + 8));
    assert_eq!(out[4..6], [0, 0], "not DONE");
    frontend.encode_read_piece(&tag, piece(false, true), &mut out);
    assert_eq!(out[4..6], nbd::chunk::FLAG_DONE.to_be_bytes());
}

#[test]
fn nbd_simple_read_pieces_share_one_reply() {
    let mut frontend = nbd_frontend();
    let mut output = Vec::new();
    let mut input = client_start("ns7", false);
    input.extend_from_slice(&request(nbd::CommandType::Read, 0, 5, 1, (1 << 20) - 1));
    let Decoded::Request { tag, action, .. } = drive(&mut frontend, &input, &mut output) else {
        panic!("expected READ");
    };
    // Unnegotiated block sizes: a READ of any byte range is valid.
    assert_eq!(
        action,
        io(IoKind::Read, 1, (1 << 20) - 1).with_tenant(TENANT)
    );
    assert!(frontend.read_pieces_exclusive());
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    let piece = |first, last| ReadPiece {
        offset_bytes: 1,
        length_bytes: 4096,
        first,
        last,
    };
    assert_eq!(
        frontend.encode_read_piece(&tag, piece(true, false), &mut out),
        Some(nbd::SIMPLE_REPLY_SIZE)
    );
    assert_eq!(
        frontend.encode_read_piece(&tag, piece(false, false), &mut out),
        Some(0)
    );
    assert_eq!(
        frontend.encode_read_piece(&tag, piece(false, true), &mut out),
        Some(0)
    );
    // BLOCK_STATUS without a selected context is refused.
    let status = request(nbd::CommandType::BlockStatus, 0, 6, 0, 512);
    let Decoded::Request { action, .. } = drive(&mut frontend, &status, &mut output) else {
        panic!("expected BLOCK_STATUS");
    };
    assert_eq!(action, Action::Reply(Answer::Nbd(Errno::Inval)));
    // Pieces are NBD's: the native protocol cannot split a READ.
    let native = Tag::Native {
        opcode_raw: 2,
        request_id: 1,
    };
    assert_eq!(
        Frontend::Native.encode_read_piece(&native, piece(true, false), &mut out),
        None
    );
}

#[test]
fn kv_requests_statuses_and_broken_framing() {
    use reflex_proto::kv::{self, Opcode};
    let frontend = || Frontend::Kv {
        namespace_index: 0,
        tenant: TenantRef::NONE,
    };
    let put = kv::RequestHeader::new(Opcode::Put, 9, 3, 100);
    let bytes = put.to_bytes();
    check(frontend(), &bytes[..23], Decoded::NeedMore);
    check(
        frontend(),
        &bytes,
        Decoded::Request {
            header_bytes: kv::REQUEST_HEADER_SIZE,
            payload_bytes: 103,
            tag: Tag::Kv {
                opcode_raw: Opcode::Put.as_u8(),
                request_id: 9,
            },
            action: io(
                IoKind::Kv {
                    opcode: Opcode::Put,
                    key_bytes: 3,
                },
                0,
                103,
            ),
        },
    );
    // An invalid header is answered with its status; its payload is still counted.
    let oversize = kv::RequestHeader::new(Opcode::Get, 10, 300, 0);
    check(
        frontend(),
        &oversize.to_bytes(),
        Decoded::Request {
            header_bytes: kv::REQUEST_HEADER_SIZE,
            payload_bytes: 300,
            tag: Tag::Kv {
                opcode_raw: Opcode::Get.as_u8(),
                request_id: 10,
            },
            action: Action::Reply(Answer::Kv(kv::Status::TooLarge)),
        },
    );
    let unknown = kv::RequestHeader {
        opcode_raw: 0x7f,
        ..kv::RequestHeader::new(Opcode::Get, 11, 1, 0)
    };
    let Decoded::Request { action, tag, .. } =
        frontend().decode(&unknown.to_bytes(), &namespaces())
    else {
        panic!("an unknown opcode is a request to refuse");
    };
    assert_eq!(action, Action::Reply(Answer::Kv(kv::Status::Invalid)));
    // The answer echoes the raw opcode, with the status the answer maps to.
    let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
    let length = frontend().encode_response(&tag, Answer::Kv(kv::Status::Invalid), 0, &mut out);
    assert_eq!(length, Some(kv::RESPONSE_HEADER_SIZE));
    let Ok(Some((header, _))) = kv::decode_response(&out) else {
        panic!("the answer does not decode");
    };
    assert_eq!(header.opcode_raw, 0x7f);
    assert_eq!(header.request_id, 11);
    assert_eq!(header.status(), Ok(kv::Status::Invalid));
    // Device failures and refusals map onto the protocol's statuses.
    assert_eq!(
        kv_frontend::status(Answer::DeviceError { errno: libc::EIO }),
        kv::Status::IoError
    );
    assert_eq!(
        kv_frontend::status(Answer::Permission),
        kv::Status::Permission
    );
    // A BIND waits for its 8-byte key, then becomes `KvBind` with the handle, key consumed
    // with the header and nothing left to skip.
    let handle: u64 = 0x0102_0304_0506_0708;
    let key = handle.to_le_bytes();
    let mut bind = vec![0u8; kv::REQUEST_HEADER_SIZE + key.len()];
    let encoded = kv::Request::Bind { key: &key }.encode_into(12, &mut bind);
    assert_eq!(encoded, Ok(bind.len()));
    assert!(matches!(
        frontend().decode(&bind[..bind.len() - 1], &namespaces()),
        Decoded::NeedMore
    ));
    let decoded = frontend().decode(&bind, &namespaces());
    assert_eq!(
        decoded,
        Decoded::Request {
            header_bytes: bind.len(),
            payload_bytes: 0,
            tag: Tag::Kv {
                opcode_raw: kv::Opcode::Bind.as_u8(),
                request_id: 12,
            },
            action: Action::KvBind { handle },
        }
    );
    // A wrong magic is broken framing: the connection closes.
    let mut garbage = bytes;
    garbage[0] ^= 0xff;
    assert!(matches!(
        frontend().decode(&garbage, &namespaces()),
        Decoded::Close(_)
    ));
}
