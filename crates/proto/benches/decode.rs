//! Hot-path cost of the codecs: decode + validate + response header per request, over a buffer
//! of pipelined requests as a server sees it. A measurement, not a test: it prints ns/request
//! and asserts nothing about time. Run with `cargo bench -p reflex-proto`.

use std::hint::black_box;
use std::time::Instant;

use reflex_proto::{native, nbd, original};

const REQUESTS_PER_BUFFER: usize = 64;
const ROUNDS: usize = 200_000;

fn measure(name: &str, mut one_buffer: impl FnMut() -> usize) {
    // Warm up, then time.
    for _ in 0..ROUNDS / 10 {
        black_box(one_buffer());
    }
    let start = Instant::now();
    let mut handled = 0;
    for _ in 0..ROUNDS {
        handled += black_box(one_buffer());
    }
    let elapsed = start.elapsed();
    assert_eq!(handled, ROUNDS * REQUESTS_PER_BUFFER);
    let ns_per_request = elapsed.as_nanos() as f64 / handled as f64;
    println!(
        "{name:<40} {ns_per_request:6.2} ns/request  ({:.1} M requests/s)",
        1e3 / ns_per_request
    );
}

fn main() {
    let namespaces = [native::Namespace {
        id: 1,
        size_bytes: 1 << 30,
        read_only: false,
    }];
    let limits = native::ServerLimits::default();
    let mut stream = Vec::new();
    for index in 0..REQUESTS_PER_BUFFER as u64 {
        stream.extend_from_slice(
            &native::RequestHeader::read(index, 1, index * 4096, 4096).to_bytes(),
        );
    }
    measure("native decode+validate+response", || {
        let mut rest = black_box(&stream[..]);
        let mut count = 0;
        while let Ok(Some((header, size))) = native::decode_request(rest) {
            rest = &rest[size + header.payload_length_bytes() as usize..];
            let status = match native::validate_request(&header, &limits, &namespaces[..]) {
                Ok(_) => native::Status::Ok,
                Err(status) => status,
            };
            black_box(
                native::ResponseHeader::for_request(&header, status, header.length_bytes)
                    .to_bytes(),
            );
            count += 1;
        }
        count
    });

    let mut stream = Vec::new();
    for index in 0..REQUESTS_PER_BUFFER as u64 {
        let header = original::Header {
            opcode: original::Opcode::Read,
            handle: index.to_le_bytes(),
            lba: index * 8,
            lba_count: 8,
        };
        stream.extend_from_slice(&header.to_bytes());
    }
    let original_limits = original::Limits::default();
    measure("original decode+validate+response", || {
        let mut rest = black_box(&stream[..]);
        let mut count = 0;
        while let Ok(Some((header, size))) = original::Header::decode(rest) {
            rest = &rest[size..];
            if let Ok(io) = original::validate(&header, &original_limits, 1 << 30) {
                black_box(io.response_header().to_bytes());
            }
            count += 1;
        }
        count
    });

    let session = nbd::Session::new(0, &nbd::Export::new("disk", 1 << 30), true);
    let mut stream = Vec::new();
    for index in 0..REQUESTS_PER_BUFFER as u64 {
        let header = nbd::RequestHeader {
            flags: 0,
            command_raw: 0,
            cookie: index,
            offset_bytes: index * 4096,
            length_bytes: 4096,
        };
        stream.extend_from_slice(&header.to_bytes());
    }
    measure("nbd decode+validate+structured reply", || {
        let mut rest = black_box(&stream[..]);
        let mut count = 0;
        while let Ok(Some((header, size))) = nbd::decode_request(rest) {
            rest = &rest[size + header.payload_length_bytes() as usize..];
            let reply = match session.validate(&header) {
                Ok(command) => session.reply_ok(&command),
                Err(errno) => Some(session.reply_error(header.cookie, errno)),
            };
            black_box(reply);
            count += 1;
        }
        count
    });
}
