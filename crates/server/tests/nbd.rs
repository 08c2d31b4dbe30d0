//! NBD end to end over loopback TCP: a byte-level client (request headers and reply decoding
//! from `reflex_proto::nbd`, option traffic spelled out here) against the real server, on
//! memory and real files. What real clients (nbdinfo, nbdcopy, qemu, fio, nbdfuse) make of the
//! same server is `nbd_interop.rs`; this file pins down the protocol cases one by one.

mod common;

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{config, namespace, pattern, start};
use reflex_client::Client;
use reflex_proto::nbd::{
    self, CommandType, Errno, Reply, RequestHeader, TransmissionFlags, chunk, command_flags, info,
    option, reply,
};
use reflex_server::{Config, NamespaceConfig, ServerHandle};

const MIB: u32 = 1 << 20;

// ---------------------------------------------------------------------------------------------
// A byte-level NBD client.

/// One option reply: its type and data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct OptionReply {
    option: u32,
    reply_type: u32,
    data: Vec<u8>,
}

/// What INFO/GO reported about an export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ExportInfo {
    size_bytes: u64,
    flags: u16,
    name: Option<String>,
    /// minimum, preferred, maximum
    block_sizes: Option<(u32, u32, u32)>,
}

/// A reply in transmission: the cookie and either the READ data (empty for other commands)
/// or the error value.
type Answer = (u64, Result<Vec<u8>, u32>);

struct Nbd {
    stream: TcpStream,
    structured: bool,
    /// READs in flight, by cookie: offset and length (a simple reply does not say how much
    /// data follows; structured chunks say where their piece goes).
    reads: HashMap<u64, (u64, u32)>,
    /// Structured replies being assembled, by cookie.
    partial: HashMap<u64, Partial>,
    /// Chunks of the last structured reply returned.
    last_chunks: usize,
}

/// A structured reply whose DONE chunk has not arrived.
#[derive(Default)]
struct Partial {
    data: Vec<u8>,
    /// Bytes of READ data received (pieces never overlap).
    filled: u64,
    error: Option<u32>,
    chunks: usize,
}

impl Nbd {
    /// Connects, checks the greeting, sends the client flags.
    fn connect(addr: SocketAddr) -> Nbd {
        let mut nbd = Nbd::connect_greeted(addr);
        let flags = nbd::client_flags::FIXED_NEWSTYLE | nbd::client_flags::NO_ZEROES;
        nbd.send(&flags.to_be_bytes());
        nbd
    }

    /// Connects and reads the greeting only.
    fn connect_greeted(addr: SocketAddr) -> Nbd {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{e}"));
        stream.set_nodelay(true).unwrap_or_else(|e| panic!("{e}"));
        let mut nbd = Nbd {
            stream,
            structured: false,
            reads: HashMap::new(),
            partial: HashMap::new(),
            last_chunks: 0,
        };
        let greeting = nbd.receive(nbd::GREETING_SIZE);
        assert_eq!(greeting[..8], nbd::NBD_MAGIC.to_be_bytes());
        assert_eq!(greeting[8..16], nbd::IHAVEOPT.to_be_bytes());
        let flags = u16::from_be_bytes([greeting[16], greeting[17]]);
        assert_eq!(
            flags,
            nbd::handshake_flags::FIXED_NEWSTYLE | nbd::handshake_flags::NO_ZEROES
        );
        nbd
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream
            .write_all(bytes)
            .unwrap_or_else(|e| panic!("send: {e}"));
    }

    fn receive(&mut self, count: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; count];
        self.stream
            .read_exact(&mut bytes)
            .unwrap_or_else(|e| panic!("receive {count} bytes: {e}"));
        bytes
    }

    fn send_option(&mut self, code: u32, data: &[u8]) {
        let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
        bytes.extend_from_slice(&code.to_be_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        self.send(&bytes);
    }

    fn option_reply(&mut self) -> OptionReply {
        let header = self.receive(nbd::OPTION_REPLY_HEADER_SIZE);
        assert_eq!(header[..8], nbd::OPTION_REPLY_MAGIC.to_be_bytes());
        let word = |at: usize| {
            u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        let (option, reply_type, length) = (word(8), word(12), word(16));
        let data = self.receive(length as usize);
        OptionReply {
            option,
            reply_type,
            data,
        }
    }

    /// Sends an option and collects its replies up to the final one (ACK or an error).
    fn option(&mut self, code: u32, data: &[u8]) -> Vec<OptionReply> {
        self.send_option(code, data);
        let mut replies = Vec::new();
        loop {
            let reply = self.option_reply();
            assert_eq!(reply.option, code, "reply to another option: {reply:?}");
            let last =
                ![reply::INFO, reply::SERVER, reply::META_CONTEXT].contains(&reply.reply_type);
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// INFO or GO data: the name and the information requests.
    fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for request in requests {
            data.extend_from_slice(&request.to_be_bytes());
        }
        data
    }

    /// INFO or GO for `name`; the export's information, or the final error reply type.
    fn info_or_go(&mut self, code: u32, name: &str, requests: &[u16]) -> Result<ExportInfo, u32> {
        let replies = self.option(code, &Nbd::info_data(name, requests));
        let Some(last) = replies.last() else {
            panic!("no reply");
        };
        if last.reply_type != reply::ACK {
            return Err(last.reply_type);
        }
        let mut export = ExportInfo::default();
        for reply in &replies[..replies.len() - 1] {
            assert_eq!(reply.reply_type, reply::INFO);
            let data = &reply.data;
            match u16::from_be_bytes([data[0], data[1]]) {
                info::EXPORT => {
                    assert_eq!(data.len(), 12);
                    export.size_bytes =
                        u64::from_be_bytes(data[2..10].try_into().unwrap_or_default());
                    export.flags = u16::from_be_bytes([data[10], data[11]]);
                }
                info::NAME => export.name = Some(String::from_utf8_lossy(&data[2..]).into_owned()),
                info::BLOCK_SIZE => {
                    assert_eq!(data.len(), 14);
                    let word = |at: usize| {
                        u32::from_be_bytes(data[at..at + 4].try_into().unwrap_or_default())
                    };
                    export.block_sizes = Some((word(2), word(6), word(10)));
                }
                other => panic!("unexpected information type {other}"),
            }
        }
        Ok(export)
    }

    /// Negotiates (structured replies or not) and enters transmission on `name`.
    fn open(addr: SocketAddr, name: &str, structured: bool) -> (Nbd, ExportInfo) {
        let mut nbd = Nbd::connect(addr);
        if structured {
            let replies = nbd.option(option::STRUCTURED_REPLY, &[]);
            assert_eq!(replies.len(), 1);
            assert_eq!(replies[0].reply_type, reply::ACK);
            nbd.structured = true;
        }
        let export = nbd
            .info_or_go(option::GO, name, &[info::BLOCK_SIZE])
            .unwrap_or_else(|e| panic!("GO {name:?} refused with {e:#x}"));
        (nbd, export)
    }

    /// Negotiates like a client that did not ask for the block sizes (so it is not bound by
    /// them), optionally selecting `base:allocation` (which needs structured replies).
    fn open_unnegotiated(
        addr: SocketAddr,
        name: &str,
        structured: bool,
        block_status: bool,
    ) -> (Nbd, ExportInfo) {
        let mut nbd = Nbd::connect(addr);
        if structured {
            let replies = nbd.option(option::STRUCTURED_REPLY, &[]);
            assert_eq!(replies[0].reply_type, reply::ACK);
            nbd.structured = true;
        }
        if block_status {
            let replies = nbd.option(
                option::SET_META_CONTEXT,
                &meta_request(name, &["base:allocation"]),
            );
            assert_eq!(replies.len(), 2, "{replies:?}");
            assert_eq!(replies[0].reply_type, reply::META_CONTEXT);
            assert_eq!(replies[0].data[4..], *b"base:allocation");
            assert_eq!(replies[1].reply_type, reply::ACK);
        }
        let export = nbd
            .info_or_go(option::GO, name, &[])
            .unwrap_or_else(|e| panic!("GO {name:?} refused with {e:#x}"));
        (nbd, export)
    }

    /// A BLOCK_STATUS answer: its descriptors (length, flags).
    fn block_status(&mut self, flags: u16, offset: u64, length: u32) -> Vec<(u32, u32)> {
        let payload = self
            .call(CommandType::BlockStatus, flags, offset, length, &[])
            .unwrap_or_else(|e| panic!("BLOCK_STATUS {offset}+{length}: error {e}"));
        assert_eq!(self.last_chunks, 1, "one chunk per context");
        assert_eq!(
            payload[..4],
            nbd::meta_context::BASE_ALLOCATION_ID.to_be_bytes()
        );
        assert_eq!((payload.len() - 4) % 8, 0);
        payload[4..]
            .chunks_exact(8)
            .map(|d| {
                (
                    u32::from_be_bytes([d[0], d[1], d[2], d[3]]),
                    u32::from_be_bytes([d[4], d[5], d[6], d[7]]),
                )
            })
            .collect()
    }

    fn request(
        &mut self,
        command: CommandType,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let header = RequestHeader {
            flags,
            command_raw: command.as_u16(),
            cookie,
            offset_bytes: offset,
            length_bytes: length,
        };
        self.request_raw(&header, payload);
    }

    fn request_raw(&mut self, header: &RequestHeader, payload: &[u8]) {
        if header.command_raw == CommandType::Read.as_u16() {
            self.expect_read(header.cookie, header.offset_bytes, header.length_bytes);
        }
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend_from_slice(payload);
        self.send(&bytes);
    }

    /// Notes a READ sent by other means (raw bytes), so its reply can be read.
    fn expect_read(&mut self, cookie: u64, offset: u64, length: u32) {
        self.reads.insert(cookie, (offset, length));
    }

    /// Reads one complete reply: a simple reply (with its READ data), or the chunks of
    /// structured replies until one has DONE (READ pieces put back in place; a BLOCK_STATUS
    /// chunk's payload is returned as the data).
    fn reply(&mut self) -> Answer {
        loop {
            let first = self.receive(4);
            let magic = u32::from_be_bytes([first[0], first[1], first[2], first[3]]);
            let size = if magic == nbd::SIMPLE_REPLY_MAGIC {
                nbd::SIMPLE_REPLY_SIZE
            } else {
                nbd::CHUNK_HEADER_SIZE
            };
            let mut header = first;
            header.extend_from_slice(&self.receive(size - 4));
            let decoded = Reply::decode(&header).unwrap_or_else(|e| panic!("reply: {e}"));
            let Some((decoded, _)) = decoded else {
                panic!("short reply header");
            };
            let header = match decoded {
                Reply::Simple(simple) => {
                    let read = self.reads.remove(&simple.cookie);
                    // With structured replies, READs and errors must be chunks; a simple
                    // reply is allowed for other successful commands.
                    assert!(
                        !self.structured || (read.is_none() && simple.error == 0),
                        "simple reply {simple:?} after STRUCTURED_REPLY"
                    );
                    if simple.error != 0 {
                        return (simple.cookie, Err(simple.error));
                    }
                    let data = self.receive(read.map_or(0, |(_, length)| length) as usize);
                    return (simple.cookie, Ok(data));
                }
                Reply::Chunk(header) => header,
            };
            assert!(self.structured, "structured reply without negotiation");
            let payload = self.receive(header.length_bytes as usize);
            let read = self.reads.get(&header.cookie).copied();
            let partial = self.partial.entry(header.cookie).or_default();
            partial.chunks += 1;
            match header.chunk_type {
                chunk::TYPE_OFFSET_DATA => {
                    let Some((offset, length)) = read else {
                        panic!("data for cookie {} which is no READ", header.cookie);
                    };
                    let at = u64::from_be_bytes(payload[..8].try_into().unwrap_or_default());
                    let piece = &payload[8..];
                    assert!(!piece.is_empty(), "an empty data chunk");
                    assert!(
                        at >= offset && at + piece.len() as u64 <= offset + u64::from(length),
                        "a piece outside the READ"
                    );
                    if partial.data.is_empty() {
                        partial.data = vec![0; length as usize];
                    }
                    let start = (at - offset) as usize;
                    partial.data[start..start + piece.len()].copy_from_slice(piece);
                    partial.filled += piece.len() as u64;
                }
                chunk::TYPE_ERROR => {
                    let error =
                        u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    assert_eq!(payload[4..6], [0, 0], "no message");
                    partial.error = Some(error);
                }
                chunk::TYPE_BLOCK_STATUS => partial.data = payload,
                chunk::TYPE_NONE => {}
                other => panic!("unexpected chunk type {other}"),
            }
            if !header.is_done() {
                continue;
            }
            let Some(partial) = self.partial.remove(&header.cookie) else {
                panic!("no reply in progress");
            };
            self.reads.remove(&header.cookie);
            self.last_chunks = partial.chunks;
            if let Some(error) = partial.error {
                return (header.cookie, Err(error));
            }
            if let Some((_, length)) = read {
                assert_eq!(
                    partial.filled,
                    u64::from(length),
                    "the READ's data is not whole"
                );
            }
            return (header.cookie, Ok(partial.data));
        }
    }

    /// One request and its reply.
    fn call(
        &mut self,
        command: CommandType,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<Vec<u8>, u32> {
        let cookie = 0xC0FFEE;
        self.request(command, flags, cookie, offset, length, payload);
        let (answered, result) = self.reply();
        assert_eq!(answered, cookie);
        result
    }

    fn read(&mut self, offset: u64, length: u32) -> Vec<u8> {
        self.call(CommandType::Read, 0, offset, length, &[])
            .unwrap_or_else(|e| panic!("READ {offset}+{length}: error {e}"))
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let result = self.call(CommandType::Write, 0, offset, data.len() as u32, data);
        assert_eq!(result, Ok(Vec::new()), "WRITE {offset}+{}", data.len());
    }

    /// True when the server closed the connection (EOF or reset) rather than sending more.
    fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            return match self.stream.read(&mut byte) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
                ),
            };
        }
    }
}

/// SET/LIST_META_CONTEXT data.
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

fn errno(error: Errno) -> Result<Vec<u8>, u32> {
    Err(error.as_u32())
}

fn flag(flags: u16, wanted: TransmissionFlags) -> bool {
    TransmissionFlags::from_bits_retain(flags).contains(wanted)
}

/// A one-thread server (so every connection shares one dataplane loop) with the given
/// namespaces, NBD on a free port.
fn nbd_config(namespaces: Vec<NamespaceConfig>) -> Config {
    Config {
        threads: 1,
        ..config(namespaces)
    }
}

fn nbd_addr(server: &ServerHandle) -> SocketAddr {
    server
        .nbd_addr()
        .unwrap_or_else(|| panic!("NBD is enabled"))
}

fn named(id: u32, backend: &str, name: &str) -> NamespaceConfig {
    NamespaceConfig {
        name: Some(name.to_string()),
        ..namespace(id, backend, None)
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake.

#[test]
fn handshake_list_info_unknown_options_and_go() {
    let mut read_only = named(2, "mem:4M", "archive");
    read_only.read_only = true;
    let server = start(nbd_config(vec![namespace(1, "mem:16M", None), read_only]));
    let mut nbd = Nbd::connect(nbd_addr(&server));

    // An unknown option is refused, its data skipped, and negotiation continues.
    let replies = nbd.option(0x4242, b"some data the server must skip");
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, reply::ERR_UNSUP);
    let replies = nbd.option(option::EXTENDED_HEADERS, &[]);
    assert_eq!(replies[0].reply_type, reply::ERR_UNSUP);

    // LIST names every export.
    let replies = nbd.option(option::LIST, &[]);
    let names: Vec<String> = replies
        .iter()
        .filter(|reply| reply.reply_type == reply::SERVER)
        .map(|reply| String::from_utf8_lossy(&reply.data[4..]).into_owned())
        .collect();
    assert_eq!(names, vec!["ns1".to_string(), "archive".to_string()]);
    assert_eq!(replies.last().map(|r| r.reply_type), Some(reply::ACK));

    // INFO with block sizes and the name.
    let export = nbd
        .info_or_go(option::INFO, "ns1", &[info::BLOCK_SIZE, info::NAME])
        .unwrap_or_else(|e| panic!("INFO refused: {e:#x}"));
    assert_eq!(export.size_bytes, 16 << 20);
    assert_eq!(export.name.as_deref(), Some("ns1"));
    // Any byte, 4 KiB without read-modify-write, up to 32 MiB.
    assert_eq!(export.block_sizes, Some((1, 4096, 32 * MIB)));
    for wanted in [
        TransmissionFlags::HAS_FLAGS,
        TransmissionFlags::SEND_FLUSH,
        TransmissionFlags::SEND_FUA,
        TransmissionFlags::SEND_TRIM,
        TransmissionFlags::SEND_WRITE_ZEROES,
        TransmissionFlags::CAN_MULTI_CONN,
        TransmissionFlags::SEND_CACHE,
        TransmissionFlags::SEND_FAST_ZERO,
    ] {
        assert!(
            flag(export.flags, wanted),
            "{wanted:?} in {:#x}",
            export.flags
        );
    }
    assert!(!flag(export.flags, TransmissionFlags::READ_ONLY));
    let archive = nbd
        .info_or_go(option::INFO, "archive", &[])
        .unwrap_or_else(|e| panic!("INFO refused: {e:#x}"));
    assert_eq!(archive.size_bytes, 4 << 20);
    assert!(flag(archive.flags, TransmissionFlags::READ_ONLY));
    assert!(!flag(archive.flags, TransmissionFlags::SEND_TRIM));
    assert!(!flag(archive.flags, TransmissionFlags::SEND_FAST_ZERO));
    assert!(flag(archive.flags, TransmissionFlags::SEND_CACHE));
    // Block sizes are sent even when not asked for.
    assert_eq!(archive.block_sizes, Some((1, 4096, 32 * MIB)));
    assert_eq!(
        nbd.info_or_go(option::INFO, "nope", &[]),
        Err(reply::ERR_UNKNOWN)
    );
    assert_eq!(
        nbd.info_or_go(option::GO, "nope", &[]),
        Err(reply::ERR_UNKNOWN)
    );

    // GO on the empty name selects the default export (the first namespace), and the bytes
    // pipelined right after GO are already requests.
    let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
    let data = Nbd::info_data("", &[]);
    bytes.extend_from_slice(&option::GO.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(&data);
    let read = RequestHeader {
        flags: 0,
        command_raw: CommandType::Read.as_u16(),
        cookie: 7,
        offset_bytes: (16 << 20) - 4096,
        length_bytes: 4096,
    };
    bytes.extend_from_slice(&read.to_bytes());
    nbd.expect_read(7, read.offset_bytes, 4096);
    nbd.send(&bytes);
    let mut export = ExportInfo::default();
    loop {
        let reply = nbd.option_reply();
        if reply.reply_type == reply::ACK {
            break;
        }
        assert_eq!(reply.reply_type, reply::INFO);
        if u16::from_be_bytes([reply.data[0], reply.data[1]]) == info::EXPORT {
            export.size_bytes =
                u64::from_be_bytes(reply.data[2..10].try_into().unwrap_or_default());
        }
    }
    assert_eq!(export.size_bytes, 16 << 20, "the default export is ns1");
    assert_eq!(nbd.reply(), (7, Ok(vec![0u8; 4096])));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn abort_and_export_name() {
    let server = start(nbd_config(vec![named(1, "mem:8M", "disk")]));
    let addr = nbd_addr(&server);
    let mut nbd = Nbd::connect(addr);
    let replies = nbd.option(option::ABORT, &[]);
    assert_eq!(replies[0].reply_type, reply::ACK);
    assert!(nbd.is_closed_by_server());

    // The old EXPORT_NAME option: size and flags, no padding with NO_ZEROES.
    let mut nbd = Nbd::connect(addr);
    nbd.send_option(option::EXPORT_NAME, b"disk");
    let answer = nbd.receive(10);
    assert_eq!(
        u64::from_be_bytes(answer[..8].try_into().unwrap_or_default()),
        8 << 20
    );
    nbd.write(4096, &pattern(3, 4096));
    assert_eq!(nbd.read(4096, 4096), pattern(3, 4096));

    // EXPORT_NAME for an unknown export cannot be refused politely: hard disconnect.
    let mut nbd = Nbd::connect(addr);
    nbd.send_option(option::EXPORT_NAME, b"nope");
    assert!(nbd.is_closed_by_server());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Transmission.

/// Blocks the file system allocates for `path`.
fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{e}"))
        .blocks()
        * 512
}

#[test]
fn round_trips_with_and_without_structured_replies() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("disk");
    let backend = format!("file:{}", path.display());
    let server = start(nbd_config(vec![
        NamespaceConfig {
            size_bytes: Some(32 << 20),
            ..named(1, &backend, "file")
        },
        named(2, "mem:32M", "memory"),
    ]));
    let addr = nbd_addr(&server);
    for structured in [false, true] {
        for name in ["file", "memory"] {
            let (mut nbd, export) = Nbd::open(addr, name, structured);
            assert_eq!(export.size_bytes, 32 << 20);
            let base = if structured { 16 << 20 } else { 0 };
            let context = format!("{name}, structured {structured}");

            // WRITE then READ, 512 bytes to 1 MiB.
            for (index, length) in [512u32, 4096, 65536, MIB].into_iter().enumerate() {
                let offset = base + index as u64 * u64::from(MIB);
                let data = pattern(index as u64 + base, length as usize);
                nbd.write(offset, &data);
                assert!(
                    nbd.read(offset, length) == data,
                    "{context}: {length} bytes"
                );
            }
            // FLUSH, and FUA on a write.
            assert_eq!(nbd.call(CommandType::Flush, 0, 0, 0, &[]), Ok(Vec::new()));
            let data = pattern(99, 8192);
            let fua = nbd.call(CommandType::Write, command_flags::FUA, base, 8192, &data);
            assert_eq!(fua, Ok(Vec::new()));

            // TRIM (with FUA) leaves zeroes.
            let trimmed = base + 2 * u64::from(MIB);
            let trim = nbd.call(CommandType::Trim, command_flags::FUA, trimmed, 65536, &[]);
            assert_eq!(trim, Ok(Vec::new()), "{context}");
            assert_eq!(nbd.read(trimmed, 65536), vec![0u8; 65536], "{context}");

            // WRITE_ZEROES punches (files lose the allocation) ...
            let zeroed = base + 3 * u64::from(MIB);
            let before = allocated_bytes(&path);
            let punch = nbd.call(CommandType::WriteZeroes, 0, zeroed, MIB, &[]);
            assert_eq!(punch, Ok(Vec::new()), "{context}");
            assert_eq!(nbd.read(zeroed, MIB), vec![0u8; MIB as usize], "{context}");
            if name == "file" {
                assert!(
                    allocated_bytes(&path) < before,
                    "{context}: the hole was punched"
                );
            }
            // ... and with NO_HOLE writes them (the range stays allocated), here over more
            // than the maximum payload, with FUA.
            let length = 3 * MIB + 4096;
            let offset = base + 4 * u64::from(MIB);
            nbd.write(offset + u64::from(length) - 4096, &pattern(5, 4096));
            let before = allocated_bytes(&path);
            let flags = command_flags::NO_HOLE | command_flags::FUA;
            let fill = nbd.call(CommandType::WriteZeroes, flags, offset, length, &[]);
            assert_eq!(fill, Ok(Vec::new()), "{context}");
            for chunk in 0..4u64 {
                let at = offset + chunk * u64::from(MIB);
                let size = if chunk == 3 { 4096 } else { MIB };
                assert!(
                    nbd.read(at, size) == vec![0u8; size as usize],
                    "{context}: {at}"
                );
            }
            if name == "file" {
                assert!(
                    allocated_bytes(&path) >= before + u64::from(3 * MIB),
                    "{context}: NO_HOLE allocated the range"
                );
            }
            nbd.request(CommandType::Disc, 0, 1, 0, 0, &[]);
            assert!(nbd.is_closed_by_server());
        }
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn invalid_requests_get_errors_and_the_connection_lives_on() {
    let server = start(nbd_config(vec![namespace(1, "mem:8M", None)]));
    for structured in [false, true] {
        let (mut nbd, _) = Nbd::open(nbd_addr(&server), "ns1", structured);
        let end = 8u64 << 20;
        // READ and TRIM past the end: EINVAL; WRITE and WRITE_ZEROES: ENOSPC (the payload is
        // consumed: the next request is understood).
        assert_eq!(
            nbd.call(CommandType::Read, 0, end - 4096, 8192, &[]),
            errno(Errno::Inval)
        );
        assert_eq!(
            nbd.call(CommandType::Read, 0, u64::MAX - 511, 512, &[]),
            errno(Errno::Inval)
        );
        assert_eq!(
            nbd.call(CommandType::Trim, 0, end, 4096, &[]),
            errno(Errno::Inval)
        );
        let payload = pattern(1, 8192);
        assert_eq!(
            nbd.call(CommandType::Write, 0, end - 4096, 8192, &payload),
            errno(Errno::NoSpc)
        );
        assert_eq!(
            nbd.call(CommandType::WriteZeroes, 0, end, 512, &[]),
            errno(Errno::NoSpc)
        );
        // Empty, too long (a WRITE's payload is skipped), unknown command, unknown flag:
        // EINVAL.
        assert_eq!(
            nbd.call(CommandType::Read, 0, 0, 0, &[]),
            errno(Errno::Inval)
        );
        assert_eq!(
            nbd.call(CommandType::Read, 0, 0, 32 * MIB + 1, &[]),
            errno(Errno::Inval)
        );
        let too_long = vec![0x5a; 32 * MIB as usize + 1];
        assert_eq!(
            nbd.call(CommandType::Write, 0, 0, too_long.len() as u32, &too_long),
            errno(Errno::Inval)
        );
        assert_eq!(
            nbd.call(CommandType::BlockStatus, 0, 0, 4096, &[]),
            errno(Errno::Inval)
        );
        let unknown = RequestHeader {
            flags: 0,
            command_raw: 99,
            cookie: 5,
            offset_bytes: 0,
            length_bytes: 512,
        };
        nbd.request_raw(&unknown, &[]);
        assert_eq!(nbd.reply(), (5, errno(Errno::Inval)));
        assert_eq!(
            nbd.call(CommandType::Read, command_flags::DF, 0, 512, &[]),
            errno(Errno::Inval)
        );
        assert_eq!(
            nbd.call(CommandType::Flush, 0, 512, 0, &[]),
            errno(Errno::Inval)
        );
        // The connection still works.
        nbd.write(0, &pattern(3, 4096));
        assert_eq!(nbd.read(0, 4096), pattern(3, 4096));
        // A bad magic is broken framing: the server closes this connection.
        nbd.send(&[0xAB; nbd::REQUEST_HEADER_SIZE]);
        assert!(nbd.is_closed_by_server());
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_read_only_export_refuses_writes_with_eperm() {
    let mut read_only = namespace(1, "mem:8M", None);
    read_only.read_only = true;
    let server = start(nbd_config(vec![read_only]));
    let (mut nbd, export) = Nbd::open(nbd_addr(&server), "ns1", false);
    assert!(flag(export.flags, TransmissionFlags::READ_ONLY));
    assert_eq!(
        nbd.call(CommandType::Write, 0, 0, 4096, &pattern(1, 4096)),
        errno(Errno::Perm)
    );
    assert_eq!(
        nbd.call(CommandType::Trim, 0, 0, 4096, &[]),
        errno(Errno::Perm)
    );
    assert_eq!(
        nbd.call(CommandType::WriteZeroes, 0, 0, 4096, &[]),
        errno(Errno::Perm)
    );
    // FLUSH and READ are fine.
    assert_eq!(nbd.call(CommandType::Flush, 0, 0, 0, &[]), Ok(Vec::new()));
    assert_eq!(nbd.read(0, 4096), vec![0u8; 4096]);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn disc_answers_what_came_before_then_closes() {
    let server = start(nbd_config(vec![namespace(1, "mem:8M", None)]));
    let (mut nbd, _) = Nbd::open(nbd_addr(&server), "ns1", true);
    let data = pattern(4, 65536);
    let mut bytes = Vec::new();
    for cookie in 0..8u64 {
        let header = RequestHeader {
            flags: 0,
            command_raw: CommandType::Write.as_u16(),
            cookie,
            offset_bytes: cookie * 65536,
            length_bytes: 65536,
        };
        bytes.extend_from_slice(&header.to_bytes());
        bytes.extend_from_slice(&data);
    }
    let disc = RequestHeader {
        flags: 0,
        command_raw: CommandType::Disc.as_u16(),
        cookie: 100,
        offset_bytes: 0,
        length_bytes: 0,
    };
    bytes.extend_from_slice(&disc.to_bytes());
    nbd.send(&bytes);
    let mut answered: Vec<u64> = (0..8)
        .map(|_| {
            let (cookie, result) = nbd.reply();
            assert_eq!(result, Ok(Vec::new()));
            cookie
        })
        .collect();
    answered.sort_unstable();
    assert_eq!(answered, (0..8).collect::<Vec<u64>>());
    // Nothing for DISC itself; the server closes.
    assert!(nbd.is_closed_by_server());
    // The writes happened.
    let (mut nbd, _) = Nbd::open(nbd_addr(&server), "ns1", false);
    assert!(nbd.read(7 * 65536, 65536) == data);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn pipelined_requests_are_answered_out_of_order_by_cookie() {
    let server = start(nbd_config(vec![namespace(1, "mem:128M", None)]));
    let (mut nbd, _) = Nbd::open(nbd_addr(&server), "ns1", true);
    let small = pattern(6, 4096);
    nbd.write(0, &small);
    // A WRITE_ZEROES with NO_HOLE over 64 MiB takes 64 device writes, one after the other;
    // a 4 KiB READ pipelined behind it in the same segment finishes long before.
    let mut bytes = Vec::new();
    let zeroes = RequestHeader {
        flags: command_flags::NO_HOLE,
        command_raw: CommandType::WriteZeroes.as_u16(),
        cookie: 1,
        offset_bytes: 64 << 20,
        length_bytes: 64 << 20,
    };
    let read = RequestHeader {
        flags: 0,
        command_raw: CommandType::Read.as_u16(),
        cookie: 2,
        offset_bytes: 0,
        length_bytes: 4096,
    };
    bytes.extend_from_slice(&zeroes.to_bytes());
    bytes.extend_from_slice(&read.to_bytes());
    nbd.expect_read(2, 0, 4096);
    nbd.send(&bytes);
    assert_eq!(nbd.reply(), (2, Ok(small.clone())));
    assert_eq!(nbd.reply(), (1, Ok(Vec::new())));

    // Many requests of mixed kinds in flight: each answered once, matched by cookie.
    let mut expected: HashMap<u64, Result<Vec<u8>, u32>> = HashMap::new();
    let mut bytes = Vec::new();
    for cookie in 0..48u64 {
        let offset = (cookie % 16) * 65536;
        let length = 4096 * (1 + (cookie % 4) as u32);
        let (command, payload, result) = match cookie % 3 {
            0 => {
                let data = pattern(cookie, length as usize);
                (CommandType::Write, data, Ok(Vec::new()))
            }
            1 => (CommandType::Read, Vec::new(), Ok(Vec::new())),
            _ => (CommandType::Read, Vec::new(), errno(Errno::Inval)),
        };
        let offset = if cookie % 3 == 2 {
            (128 << 20) + offset
        } else {
            (32 << 20) + offset
        };
        let header = RequestHeader {
            flags: 0,
            command_raw: command.as_u16(),
            cookie: 1000 + cookie,
            offset_bytes: offset,
            length_bytes: length,
        };
        if command == CommandType::Read {
            nbd.expect_read(1000 + cookie, offset, length);
        }
        bytes.extend_from_slice(&header.to_bytes());
        bytes.extend_from_slice(&payload);
        expected.insert(1000 + cookie, result);
    }
    nbd.send(&bytes);
    for _ in 0..48 {
        let (cookie, result) = nbd.reply();
        let Some(wanted) = expected.remove(&cookie) else {
            panic!("cookie {cookie} answered twice or never asked");
        };
        match (wanted, result) {
            (Err(wanted), Err(got)) => assert_eq!(wanted, got),
            (Ok(_), Ok(_)) => {}
            (wanted, got) => panic!("cookie {cookie}: expected {wanted:?}, got {got:?}"),
        }
    }
    assert!(expected.is_empty());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn nbd_and_native_see_the_same_data_and_connections_share_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("shared").display());
    let server = start(config(vec![namespace(1, &backend, Some(16 << 20))]));
    let addr = nbd_addr(&server);
    let (mut first, _) = Nbd::open(addr, "ns1", false);
    let (mut second, _) = Nbd::open(addr, "ns1", true);
    let data = pattern(8, 256 << 10);
    first.write(1 << 20, &data);
    // CAN_MULTI_CONN: a FLUSH on another connection covers the acknowledged write, and that
    // connection reads it.
    assert_eq!(
        second.call(CommandType::Flush, 0, 0, 0, &[]),
        Ok(Vec::new())
    );
    assert!(second.read(1 << 20, 256 << 10) == data);
    // The native protocol reads what NBD wrote, and the other way round.
    let mut native = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 256 << 10];
    native
        .read(1, 1 << 20, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back == data);
    let other = pattern(9, 4096);
    native
        .write(1, 8 << 20, &other)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.read(8 << 20, 4096), other);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Shutdown.

/// Waits until the listener at `addr` refuses connections: the server has begun draining.
fn wait_refused(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match TcpStream::connect(addr) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => return,
            _ => {
                assert!(Instant::now() < deadline, "the listener never closed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

#[test]
fn shutdown_closes_handshakes_finishes_sessions_and_refuses_newcomers() {
    // More READ data in flight than the loopback socket buffers hold (tcp_rmem max 32 MiB +
    // tcp_wmem max 4 MiB here), so the session is still busy when the shutdown begins.
    const READS: u64 = 48;
    let config = Config {
        window: 64,
        arena_bytes_per_thread: 64 << 20,
        // All 48 READs in flight at once: this connection may use the whole arena.
        connection_arena_percent: 100,
        requests_per_thread_max: 256,
        ..nbd_config(vec![namespace(1, "mem:8M", None)])
    };
    let server = start(config);
    let addr = nbd_addr(&server);
    let data = pattern(10, MIB as usize);
    let (mut session, _) = Nbd::open(addr, "ns1", false);
    session.write(0, &data);
    let mut handshaking = Nbd::connect_greeted(addr);

    let mut bytes = Vec::new();
    for cookie in 0..READS {
        let header = RequestHeader {
            flags: 0,
            command_raw: CommandType::Read.as_u16(),
            cookie,
            offset_bytes: 0,
            length_bytes: MIB,
        };
        session.expect_read(cookie, 0, MIB);
        bytes.extend_from_slice(&header.to_bytes());
    }
    session.send(&bytes);
    // Let the server take the requests in before shutting down: the first reply arrives
    // only once they are parsed (they all came in one send).
    let mut peek = [0u8; 1];
    let peeked = loop {
        match session.stream.peek(&mut peek) {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            peeked => break peeked.unwrap_or_else(|e| panic!("{e}")),
        }
    };
    assert_eq!(peeked, 1);

    server.begin_shutdown();
    wait_refused(addr);
    // The handshake is closed.
    assert!(handshaking.is_closed_by_server());
    // Requests after the shutdown began: ESHUTDOWN, a WRITE's payload skipped.
    session.request(CommandType::Read, 0, 500, 0, 4096, &[]);
    session.request(CommandType::Write, 0, 501, 0, 4096, &pattern(11, 4096));
    session.request(CommandType::Flush, 0, 502, 0, 0, &[]);
    let mut data_replies = 0;
    let mut refused = Vec::new();
    for _ in 0..READS + 3 {
        match session.reply() {
            (cookie, Ok(back)) => {
                assert!(cookie < READS, "cookie {cookie} should have been refused");
                assert!(back == data, "cookie {cookie}");
                data_replies += 1;
            }
            (cookie, Err(error)) => {
                assert_eq!(error, Errno::Shutdown.as_u32(), "cookie {cookie}");
                refused.push(cookie);
            }
        }
    }
    assert_eq!(data_replies, READS, "every in-flight READ finished");
    refused.sort_unstable();
    assert_eq!(refused, vec![500, 501, 502]);
    // Nothing outstanding: the server closes the session and exits cleanly.
    assert!(session.is_closed_by_server());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Large and unaligned requests, CACHE, FAST_ZERO, block status (issue 9).

/// A file export and a memory export of `size_bytes` each, named "file" and "memory".
fn file_and_memory(dir: &std::path::Path, size_bytes: u64) -> Config {
    let backend = format!("file:{}", dir.join("disk").display());
    nbd_config(vec![
        NamespaceConfig {
            size_bytes: Some(size_bytes),
            ..named(1, &backend, "file")
        },
        named(2, &format!("mem:{size_bytes}"), "memory"),
    ])
}

#[test]
fn requests_up_to_32_mib_go_in_parts_with_and_without_structured_replies() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let server = start(file_and_memory(dir.path(), 80 << 20));
    let addr = nbd_addr(&server);
    let length = 32 * MIB;
    for name in ["file", "memory"] {
        for structured in [false, true] {
            let context = format!("{name}, structured {structured}");
            let (mut nbd, _) = Nbd::open_unnegotiated(addr, name, structured, false);
            let offset = u64::from(3 * MIB) + 5 + u64::from(structured) * 7;
            let data = pattern(u64::from(structured) + 40, length as usize);
            nbd.write(offset, &data);
            // The big READ, with a small READ and WRITE pipelined behind it: with a simple
            // reply the 32 MiB follow their header without anything in between (the reply
            // parser would lose its place otherwise); structured, they come in pieces.
            let small = pattern(41, 4096);
            nbd.write(70 << 20, &small);
            nbd.request(CommandType::Read, 0, 1, offset, length, &[]);
            nbd.request(CommandType::Read, 0, 2, 70 << 20, 4096, &[]);
            let other = pattern(42, 1000);
            nbd.request(CommandType::Write, 0, 3, (72 << 20) + 1, 1000, &other);
            let mut answers = HashMap::new();
            for _ in 0..3 {
                let (cookie, result) = nbd.reply();
                if cookie == 1 && structured {
                    assert!(
                        nbd.last_chunks >= 32,
                        "{context}: {} chunks",
                        nbd.last_chunks
                    );
                }
                answers.insert(cookie, result);
            }
            let big = answers.remove(&1).unwrap_or_else(|| panic!("no big READ"));
            assert!(
                big == Ok(data.clone()),
                "{context}: the 32 MiB READ differs"
            );
            assert_eq!(answers.remove(&2), Some(Ok(small.clone())), "{context}");
            assert_eq!(answers.remove(&3), Some(Ok(Vec::new())), "{context}");
            assert!(nbd.read((72 << 20) + 1, 1000) == other, "{context}");
            // One byte more than 32 MiB is refused, payload skipped.
            let too_long = vec![1u8; length as usize + 1];
            assert_eq!(
                nbd.call(CommandType::Write, 0, 0, length + 1, &too_long),
                errno(Errno::Inval),
                "{context}"
            );
            assert!(nbd.read(offset, 4096) == data[..4096], "{context}");
        }
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn unaligned_reads_and_writes_match_a_model() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let size = 4u64 << 20;
    let server = start(file_and_memory(dir.path(), size));
    let addr = nbd_addr(&server);
    for name in ["file", "memory"] {
        let mut model = vec![0u8; size as usize];
        for structured in [false, true] {
            let (mut nbd, _) = Nbd::open_unnegotiated(addr, name, structured, false);
            let mut state = 0x5eed_u64 + u64::from(structured);
            let mut next = |bound: u64| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state % bound
            };
            // Edges first: single bytes at both ends and around sector boundaries.
            let mut cases: Vec<(u64, u32)> = vec![
                (0, 1),
                (size - 1, 1),
                (511, 2),
                (1023, 1),
                (4095, 4098),
                (u64::from(MIB) - 3, 7),
            ];
            for _ in 0..150 {
                let bound = if next(4) == 0 { 300_000 } else { 3000 };
                let length = 1 + next(bound) as u32;
                cases.push((next(size - u64::from(length)), length));
            }
            for (round, (offset, length)) in cases.into_iter().enumerate() {
                let context = format!("{name}, structured {structured}: {offset}+{length}");
                let range = offset as usize..(offset + u64::from(length)) as usize;
                if round % 2 == 0 {
                    let data = pattern(round as u64 + 500, length as usize);
                    nbd.write(offset, &data);
                    model[range].copy_from_slice(&data);
                } else {
                    assert!(nbd.read(offset, length) == model[range], "{context}");
                }
            }
            assert!(
                nbd.read(0, size as u32) == model,
                "{name}: the whole export"
            );
        }
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// Many connections (on both dataplane threads) write, all at once and pipelined, byte
/// ranges that share sectors; every byte must survive the read-modify-writes of its
/// neighbours.
#[test]
fn concurrent_unaligned_writes_to_the_same_sectors_keep_every_byte() {
    const CONNECTIONS: u64 = 8;
    const STRIPE: u64 = 100;
    const REGION: u64 = 64 << 10;
    const ROUNDS: u64 = 3;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = Config {
        threads: 2,
        ..file_and_memory(dir.path(), 1 << 20)
    };
    let server = start(config);
    let addr = nbd_addr(&server);
    // Connection c owns the 100-byte stripes c, c + 8, c + 16, ...: every sector holds bytes
    // of several connections, and stripes cross sector boundaries.
    let value = |stripe: u64, round: u64| pattern(stripe * 1000 + round, STRIPE as usize);
    for name in ["file", "memory"] {
        std::thread::scope(|scope| {
            for connection in 0..CONNECTIONS {
                scope.spawn(move || {
                    let (mut nbd, _) =
                        Nbd::open_unnegotiated(addr, name, connection % 2 == 0, false);
                    let stripes: Vec<u64> = (connection..REGION / STRIPE)
                        .step_by(CONNECTIONS as usize)
                        .collect();
                    for round in 0..ROUNDS {
                        // Up to 16 in flight (the window).
                        for batch in stripes.chunks(16) {
                            for &stripe in batch {
                                let data = value(stripe, round);
                                let offset = stripe * STRIPE;
                                nbd.request(
                                    CommandType::Write,
                                    0,
                                    stripe,
                                    offset,
                                    STRIPE as u32,
                                    &data,
                                );
                            }
                            for _ in batch {
                                let (cookie, result) = nbd.reply();
                                assert_eq!(result, Ok(Vec::new()), "stripe {cookie}");
                            }
                        }
                    }
                });
            }
        });
        let (mut nbd, _) = Nbd::open_unnegotiated(addr, name, false, false);
        let back = nbd.read(0, REGION as u32);
        for stripe in 0..REGION / STRIPE {
            let at = (stripe * STRIPE) as usize;
            assert!(
                back[at..at + STRIPE as usize] == value(stripe, ROUNDS - 1),
                "{name}: stripe {stripe} lost bytes"
            );
        }
    }
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        stats.iter().map(|s| s.gate_waits).sum::<u64>() > 0,
        "no write ever waited at the gate: the test did not overlap"
    );
}

#[test]
fn cache_fast_zero_and_unaligned_zeroes_and_trims() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("disk");
    let server = start(file_and_memory(dir.path(), 8 << 20));
    let addr = nbd_addr(&server);
    for name in ["file", "memory"] {
        let (mut nbd, _) = Nbd::open_unnegotiated(addr, name, false, false);
        let mut model = pattern(60, 1 << 20);
        nbd.write(0, &model);
        // CACHE: advisory, answered with success; past the end it is refused.
        assert_eq!(nbd.call(CommandType::Cache, 0, 0, MIB, &[]), Ok(Vec::new()));
        assert_eq!(
            nbd.call(CommandType::Cache, 0, 8 << 20, 512, &[]),
            errno(Errno::Inval)
        );
        // FAST_ZERO where a discard does it: success, zeroes.
        let fast = command_flags::FAST_ZERO;
        let before = allocated_bytes(&path);
        assert_eq!(
            nbd.call(CommandType::WriteZeroes, fast, 0, 65536, &[]),
            Ok(Vec::new())
        );
        model[..65536].fill(0);
        if name == "file" {
            assert!(
                allocated_bytes(&path) < before,
                "the fast zero punched a hole"
            );
        }
        // Where zeroing would need writes (NO_HOLE, unaligned edges): ENOTSUP, unchanged.
        for (flags, offset, length) in [
            (fast | command_flags::NO_HOLE, 65536, 65536),
            (fast, 131072 + 1, 4096),
            (fast, 131072, 100),
        ] {
            assert_eq!(
                nbd.call(CommandType::WriteZeroes, flags, offset, length, &[]),
                errno(Errno::NotSup),
                "{name}: {offset}+{length}"
            );
        }
        assert!(
            nbd.read(0, MIB) == model,
            "{name}: a refused fast zero changed data"
        );
        // Unaligned WRITE_ZEROES: exactly its bytes, edges by read-modify-write.
        for (offset, length, flags) in [
            (200_001u64, 5000u32, 0),
            (300_100, 100, 0),
            (400_000, 70_001, command_flags::NO_HOLE),
        ] {
            assert_eq!(
                nbd.call(CommandType::WriteZeroes, flags, offset, length, &[]),
                Ok(Vec::new())
            );
            model[offset as usize..offset as usize + length as usize].fill(0);
        }
        assert!(nbd.read(0, MIB) == model, "{name}: unaligned zeroes");
        // Unaligned TRIM: the sectors it covers whole are discarded, the edges keep their
        // bytes.
        assert_eq!(
            nbd.call(CommandType::Trim, 0, 600_001, 3000, &[]),
            Ok(Vec::new())
        );
        let back = nbd.read(0, MIB);
        let (inner_start, inner_end) = (600_064usize, 602_624usize);
        assert!(
            back[..inner_start] == model[..inner_start],
            "{name}: head edge"
        );
        assert!(back[inner_end..] == model[inner_end..], "{name}: tail edge");
        assert!(
            back[inner_start..inner_end].iter().all(|&b| b == 0),
            "{name}"
        );
        // A TRIM within one sector does nothing, successfully.
        assert_eq!(
            nbd.call(CommandType::Trim, 0, 700_001, 10, &[]),
            Ok(Vec::new())
        );
        assert!(nbd.read(700_000, 512) == model[700_000..700_512], "{name}");
    }
    // CACHE works on a read-only export too.
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let mut read_only = named(1, "mem:1M", "ro");
    read_only.read_only = true;
    let server = start(nbd_config(vec![read_only]));
    let (mut nbd, _) = Nbd::open_unnegotiated(nbd_addr(&server), "ro", true, false);
    assert_eq!(
        nbd.call(CommandType::Cache, 0, 0, 4096, &[]),
        Ok(Vec::new())
    );
    assert_eq!(
        nbd.call(CommandType::WriteZeroes, 0, 0, 4096, &[]),
        errno(Errno::Perm)
    );
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn block_status_reports_the_holes_of_files_and_memory() {
    const HOLE_ZERO: u32 = 3;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let size = 16u32 << 20;
    let server = start(file_and_memory(dir.path(), u64::from(size)));
    let addr = nbd_addr(&server);
    for name in ["file", "memory"] {
        let (mut nbd, _) = Nbd::open_unnegotiated(addr, name, true, true);
        assert_eq!(
            nbd.block_status(0, 0, size),
            vec![(size, HOLE_ZERO)],
            "{name}: new"
        );
        nbd.write(u64::from(MIB), &pattern(70, 65536));
        nbd.write(8 << 20, &pattern(71, 4096));
        let extents = nbd.block_status(0, 0, size);
        // Consecutive, covering the range, data exactly where written.
        assert_eq!(
            extents.iter().map(|e| e.0).sum::<u32>(),
            size,
            "{name}: {extents:?}"
        );
        let mut at = 0u32;
        for &(length, flags) in &extents {
            let written = [(MIB, MIB + 65536), (8 << 20, (8 << 20) + 4096)]
                .iter()
                .any(|&(start, end)| at < end && start < at + length);
            assert_eq!(flags == 0, written, "{name}: {extents:?} at {at}");
            at += length;
        }
        assert_eq!(extents[0], (MIB, HOLE_ZERO), "{name}: {extents:?}");
        // Unaligned, and REQ_ONE: one extent, no longer than asked.
        assert_eq!(nbd.block_status(0, u64::from(MIB) + 100, 10), vec![(10, 0)]);
        let one = nbd.block_status(command_flags::REQ_ONE, 0, size);
        assert_eq!(one, vec![(MIB, HOLE_ZERO)], "{name}");
        let one = nbd.block_status(command_flags::REQ_ONE, u64::from(MIB) - 512, 1024);
        assert_eq!(one, vec![(512, HOLE_ZERO)], "{name}");
        // A trimmed range is a hole again.
        assert_eq!(
            nbd.call(CommandType::Trim, 0, u64::from(MIB), 65536, &[]),
            Ok(Vec::new())
        );
        let extents = nbd.block_status(0, 0, 4 << 20);
        assert_eq!(extents, vec![(4 << 20, HOLE_ZERO)], "{name}: after TRIM");
        // Past the end: EINVAL.
        assert_eq!(
            nbd.call(
                CommandType::BlockStatus,
                0,
                u64::from(size) - 512,
                1024,
                &[]
            ),
            errno(Errno::Inval)
        );
    }
    // Without the context selected (or without structured replies, which SET needs), no
    // block status.
    let (mut nbd, _) = Nbd::open_unnegotiated(addr, "memory", true, false);
    assert_eq!(
        nbd.call(CommandType::BlockStatus, 0, 0, 4096, &[]),
        errno(Errno::Inval)
    );
    let mut nbd = Nbd::connect(addr);
    let replies = nbd.option(
        option::SET_META_CONTEXT,
        &meta_request("memory", &["base:allocation"]),
    );
    assert_eq!(replies[0].reply_type, reply::ERR_INVALID);
    let replies = nbd.option(option::LIST_META_CONTEXT, &meta_request("memory", &[]));
    assert_eq!(replies[0].reply_type, reply::META_CONTEXT);
    assert_eq!(replies[0].data[..4], [0, 0, 0, 0]);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// A device error in the middle of a large request: a structured READ ends with an ERROR chunk
/// after the parts that were read; a simple READ, whose header already said success, can only
/// be cut off (the spec's hard disconnect); a WRITE is answered with the error and the rest of
/// its payload is skipped, so the connection goes on.
#[test]
fn a_device_error_inside_a_large_request() {
    // Block 4096 (byte 2 MiB) fails reads and writes: the third part of a READ from 0.
    let faulty = "fault(read_error_lba=4096;write_error_lba=4096):mem:64M";
    let server = start(nbd_config(vec![named(1, faulty, "faulty")]));
    let addr = nbd_addr(&server);
    let length = 8 * MIB;

    let (mut nbd, _) = Nbd::open_unnegotiated(addr, "faulty", true, false);
    assert_eq!(
        nbd.call(CommandType::Read, 0, 0, length, &[]),
        errno(Errno::Io)
    );
    assert_eq!(nbd.last_chunks, 3, "two parts of data, then the error");
    let data = pattern(90, length as usize);
    assert_eq!(
        nbd.call(CommandType::Write, 0, 0, length, &data),
        errno(Errno::Io)
    );
    // The rest of the payload was skipped: the next requests are understood.
    nbd.write(16 << 20, &data[..5000]);
    assert!(nbd.read(16 << 20, 5000) == data[..5000]);
    // What came before the failing part was written.
    assert!(nbd.read(0, 2 * MIB) == data[..2 * MIB as usize]);

    let (mut nbd, _) = Nbd::open_unnegotiated(addr, "faulty", false, false);
    nbd.request(CommandType::Read, 0, 9, 0, length, &[]);
    let header = nbd.receive(nbd::SIMPLE_REPLY_SIZE);
    assert_eq!(header[4..8], [0, 0, 0, 0], "the reply began as a success");
    let mut received = 0usize;
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        match nbd.stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(count) => received += count,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => panic!("reading the cut-off READ: {e}"),
        }
    }
    assert_eq!(
        received,
        2 * MIB as usize,
        "the parts read before the error, then EOF"
    );
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}
