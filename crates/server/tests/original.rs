//! End to end: the original ReFlex block protocol port, next to the native one.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{config, namespace, pattern, start};
use reflex_client::Client;
use reflex_proto::original::{Header, Opcode};

fn connect(addr: std::net::SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap_or_else(|e| panic!("{e}"));
    stream
}

fn request(opcode: Opcode, handle: u8, lba: u64, lba_count: u32) -> Header {
    Header {
        opcode,
        handle: [handle; 8],
        lba,
        lba_count,
    }
}

fn receive_header(stream: &mut TcpStream) -> Header {
    let mut bytes = [0u8; 24];
    stream
        .read_exact(&mut bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    match Header::decode(&bytes) {
        Ok(Some((header, _))) => header,
        other => panic!("bad response header: {other:?}"),
    }
}

fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    loop {
        return match stream.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
    }
}

#[test]
fn original_port_reads_what_the_native_port_wrote_and_back() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("ns").display());
    let server = start(config(vec![namespace(1, &backend, Some(8 << 20))]));
    let original_addr = server.original_addrs()[0].1;
    assert_eq!(server.original_addrs()[0].0, 1);

    let mut native = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(99, 64 << 10);
    native
        .write(1, 1 << 20, &data)
        .unwrap_or_else(|e| panic!("{e}"));

    let mut stream = connect(original_addr);
    // Pipeline two reads; responses may come in any order, matched by handle.
    let first = request(Opcode::Read, 1, (1 << 20) / 512, 64);
    let second = request(Opcode::Read, 2, ((1 << 20) + 32768) / 512, 64);
    stream
        .write_all(&first.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    stream
        .write_all(&second.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..2 {
        let header = receive_header(&mut stream);
        assert_eq!(header.opcode, Opcode::Read);
        assert_eq!(header.lba_count, 64);
        let mut block = vec![0u8; 32768];
        stream
            .read_exact(&mut block)
            .unwrap_or_else(|e| panic!("{e}"));
        let start = if header.handle == [1; 8] { 0 } else { 32768 };
        assert_eq!(header.lba, ((1 << 20) + start as u64) / 512);
        assert!(
            block == data[start..start + 32768],
            "handle {:?}",
            header.handle
        );
    }

    // A write through the original port: bare header back with lba_count 0.
    let written = pattern(7, 4096);
    let write = request(Opcode::Write, 3, 8, 8);
    stream
        .write_all(&write.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    stream.write_all(&written).unwrap_or_else(|e| panic!("{e}"));
    let header = receive_header(&mut stream);
    assert_eq!(
        (header.opcode, header.handle, header.lba_count),
        (Opcode::Write, [3; 8], 0)
    );
    let mut back = vec![0u8; 4096];
    native
        .read(1, 4096, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back == written);

    // Out of range: the protocol has no status, so the connection is closed...
    let beyond = request(Opcode::Read, 4, (8 << 20) / 512, 8);
    stream
        .write_all(&beyond.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(closed_by_server(&mut stream));
    // ...and so is one with a bad magic; the server and other connections carry on.
    let mut junk = connect(original_addr);
    junk.write_all(&[0xAB; 24])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(closed_by_server(&mut junk));
    let mut again = connect(original_addr);
    again
        .write_all(&request(Opcode::Read, 5, 8, 8).to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let header = receive_header(&mut again);
    assert_eq!(header.handle, [5; 8]);
    let mut block = vec![0u8; 4096];
    again
        .read_exact(&mut block)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(block == written);
    native.flush(1).unwrap_or_else(|e| panic!("{e}"));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}
