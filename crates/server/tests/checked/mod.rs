//! A native-protocol connection for the loopback tests that check every answer: driven
//! through the client library's sans-IO core, each request's answer must come once, succeed
//! and (for a read) carry the bytes the block holds. Blocks hold `pattern(block, version)`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;

use reflex_client::{ConnectionCore, CoreOptions};

pub const NAMESPACE: u32 = 1;
pub const BLOCK: usize = 4096;
/// The server's window per connection (`common::config`).
pub const WINDOW: usize = 16;

pub fn pattern(block: u64, version: u32, i: usize) -> u8 {
    (block.wrapping_mul(31) as usize + version as usize * 7 + i) as u8 ^ (i >> 8) as u8
}

pub fn block_bytes(block: u64, version: u32) -> Vec<u8> {
    (0..BLOCK).map(|i| pattern(block, version, i)).collect()
}

pub enum Expect {
    Write,
    Read(Vec<u8>),
    /// A REGISTER (its handle is kept) or a BIND.
    Control,
}

/// One connection driven through the client library's sans-IO core, checking every answer.
pub struct Connection {
    pub stream: TcpStream,
    pub core: ConnectionCore,
    pub outstanding: HashMap<u64, Expect>,
    pub buffer: Vec<u8>,
    pub answered: u64,
    /// The handle the last REGISTER answered.
    pub handle: Option<u64>,
    /// Ids of writes answered since the caller last looked.
    pub writes_done: Vec<u64>,
}

impl Connection {
    pub fn connect(addr: std::net::SocketAddr) -> Connection {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
        stream.set_nodelay(true).unwrap_or_else(|e| panic!("{e}"));
        Connection {
            stream,
            core: ConnectionCore::new(CoreOptions {
                window_assumed: WINDOW as u32,
            }),
            outstanding: HashMap::new(),
            buffer: vec![0; 1 << 16],
            answered: 0,
            handle: None,
            writes_done: Vec::new(),
        }
    }

    pub fn read(&mut self, id: u64, offset: u64, expected: Vec<u8>) {
        self.core
            .submit_read(id, NAMESPACE, offset, expected.len() as u32)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            self.outstanding
                .insert(id, Expect::Read(expected))
                .is_none()
        );
    }

    pub fn write(&mut self, id: u64, block: u64, version: u32) {
        self.core
            .submit_write(
                id,
                NAMESPACE,
                block * BLOCK as u64,
                &block_bytes(block, version),
                false,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(self.outstanding.insert(id, Expect::Write).is_none());
    }

    pub fn transmit(&mut self) {
        while let Some(bytes) = self.core.transmit_start() {
            let length = bytes.len();
            self.stream
                .write_all(bytes)
                .unwrap_or_else(|e| panic!("send: {e}"));
            self.core.transmit_done(length);
        }
    }

    /// Blocks for at least one answer and checks every answer that came.
    pub fn receive(&mut self) {
        assert!(!self.outstanding.is_empty());
        let received = self
            .stream
            .read(&mut self.buffer)
            .unwrap_or_else(|e| panic!("receive: {e}"));
        assert!(received > 0, "the server closed the connection");
        let mut offered = &self.buffer[..received];
        loop {
            let taken = self.core.handle_received_bytes(offered);
            offered = &offered[taken..];
            while let Some(completion) = self
                .core
                .poll_completion()
                .unwrap_or_else(|e| panic!("{e}"))
            {
                let id = completion.request_id;
                let Some(expected) = self.outstanding.remove(&id) else {
                    panic!("answer for {id}, not outstanding (duplicate or unknown)");
                };
                assert!(
                    completion.is_ok(),
                    "request {id} failed: status {}",
                    completion.status_raw
                );
                match expected {
                    Expect::Read(bytes) => {
                        assert!(completion.data == &bytes[..], "request {id}: wrong bytes")
                    }
                    Expect::Write => self.writes_done.push(id),
                    Expect::Control => {
                        if let Ok(handle) = completion.tenant_handle() {
                            self.handle.get_or_insert(handle);
                        }
                    }
                }
                self.answered += 1;
            }
            if offered.is_empty() || taken == 0 {
                break;
            }
        }
    }

    pub fn drain(&mut self) {
        while !self.outstanding.is_empty() {
            self.receive();
        }
    }
}

impl Connection {
    /// Sends everything but the last `held_bytes` of what is queued (a request cut in two).
    pub fn transmit_holding(&mut self, held_bytes: usize) {
        if let Some(bytes) = self.core.transmit_start() {
            let length = bytes.len().saturating_sub(held_bytes);
            self.stream
                .write_all(&bytes[..length])
                .unwrap_or_else(|e| panic!("send: {e}"));
            self.core.transmit_done(length);
        }
    }
}
