//! Raw bytes as a receive buffer of NBD transmission requests: decoded headers re-encode to the
//! same bytes, validation never panics and its commands stay inside the export, and every reply
//! header decodes back with the request's cookie.
#![no_main]

use libfuzzer_sys::fuzz_target;
use reflex_proto::nbd::{Command, Export, Reply, Session, decode_request};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, mut rest)) = data.split_first() else {
        return;
    };
    let export = if selector & 1 == 0 {
        Export::new("disk", 1 << 30)
    } else {
        Export::new("ro", 1 << 20).read_only()
    };
    let structured = selector & 2 != 0;
    let session = Session::new(0, &export, structured)
        .with_block_sizes_agreed(selector & 4 != 0)
        .with_base_allocation(structured && selector & 8 != 0);
    while let Ok(Some((header, header_bytes))) = decode_request(rest) {
        assert_eq!(header.to_bytes()[..], rest[..header_bytes]);
        rest = &rest[header_bytes..];
        let reply = match session.validate(&header) {
            Ok(command) => {
                let range = match command.command() {
                    Command::Read {
                        offset_bytes,
                        length_bytes,
                    }
                    | Command::Write {
                        offset_bytes,
                        length_bytes,
                        ..
                    }
                    | Command::Trim {
                        offset_bytes,
                        length_bytes,
                        ..
                    }
                    | Command::WriteZeroes {
                        offset_bytes,
                        length_bytes,
                        ..
                    }
                    | Command::Cache {
                        offset_bytes,
                        length_bytes,
                    }
                    | Command::BlockStatus {
                        offset_bytes,
                        length_bytes,
                        ..
                    } => Some((offset_bytes, length_bytes)),
                    Command::Flush | Command::Disconnect => None,
                };
                if let Some((offset_bytes, length_bytes)) = range {
                    assert!(length_bytes > 0);
                    assert!(offset_bytes + u64::from(length_bytes) <= session.size_bytes());
                }
                match command.command() {
                    Command::BlockStatus { .. } => session.reply_block_status(&command, 12),
                    _ => session.reply_ok(&command),
                }
            }
            Err(errno) => Some(session.reply_error(header.cookie, errno)),
        };
        if let Some(reply) = reply {
            let (decoded, _) = Reply::decode(reply.as_bytes()).unwrap().unwrap();
            let cookie = match decoded {
                Reply::Simple(simple) => simple.cookie,
                Reply::Chunk(chunk) => chunk.cookie,
            };
            assert_eq!(cookie, header.cookie);
        }
        let payload_bytes = (header.payload_length_bytes() as usize).min(rest.len());
        rest = &rest[payload_bytes..];
    }
});
