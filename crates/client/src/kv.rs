//! A client of reflexd's key-value port (`docs/KV.md`): blocking calls (`put`, `get`,
//! `delete`, `flush`) and pipelining (`send` several requests, then `receive` their answers).
//! reflexd answers pipelined requests as they finish, not necessarily in request order (each
//! answer echoes its request's id); operations on one key take effect in request order. Frames are encoded and decoded by `reflex_proto::kv`;
//! server bytes that break the framing are a [`KvClientError::Framing`], never a panic.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use reflex_proto::kv::{
    REQUEST_FRAME_SIZE_MAX, RESPONSE_FRAME_SIZE_MAX, Request, ResponseError, Status,
    decode_response_frame,
};

#[derive(Debug, thiserror::Error)]
pub enum KvClientError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("broken response framing: {0}")]
    Framing(#[from] ResponseError),
    #[error("the server closed the connection")]
    Closed,
    #[error("request too large to encode")]
    TooLarge,
    #[error("an answer to request {request_id}, which is not outstanding")]
    UnexpectedAnswer { request_id: u64 },
    /// The server answered with an error status (or one this client does not know).
    #[error("the server answered status {status_raw}")]
    Status { status_raw: u16 },
}

impl KvClientError {
    /// The wire status of a [`KvClientError::Status`].
    pub fn status(&self) -> Option<Status> {
        match self {
            KvClientError::Status { status_raw } => Status::from_u16(*status_raw).ok(),
            _ => None,
        }
    }
}

/// One answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvResponse {
    pub request_id: u64,
    pub opcode_raw: u8,
    pub status_raw: u16,
    /// A successful GET's value.
    pub value: Vec<u8>,
}

impl KvResponse {
    pub fn status(&self) -> Option<Status> {
        Status::from_u16(self.status_raw).ok()
    }
}

/// A connection to a KV port.
pub struct KvClient {
    stream: TcpStream,
    next_request_id: u64,
    /// Ids sent and not yet answered.
    outstanding: std::collections::HashSet<u64>,
    send_buffer: Vec<u8>,
    receive_buffer: Vec<u8>,
    received_bytes: usize,
}

impl KvClient {
    pub fn connect(addr: SocketAddr) -> Result<KvClient, KvClientError> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(KvClient {
            stream,
            next_request_id: 1,
            outstanding: std::collections::HashSet::new(),
            send_buffer: vec![0u8; REQUEST_FRAME_SIZE_MAX],
            receive_buffer: vec![0u8; 2 * RESPONSE_FRAME_SIZE_MAX],
            received_bytes: 0,
        })
    }

    /// How long a receive waits for the server before failing with an I/O error (`None`:
    /// forever, the default).
    pub fn set_timeout(
        &mut self,
        timeout: Option<std::time::Duration>,
    ) -> Result<(), KvClientError> {
        self.stream.set_read_timeout(timeout)?;
        self.stream.set_write_timeout(timeout)?;
        Ok(())
    }

    /// Sends `request` without waiting; returns its id.
    pub fn send(&mut self, request: &Request<'_>) -> Result<u64, KvClientError> {
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        let length = request
            .encode_into(request_id, &mut self.send_buffer)
            .map_err(|_| KvClientError::TooLarge)?;
        self.stream.write_all(&self.send_buffer[..length])?;
        self.outstanding.insert(request_id);
        Ok(request_id)
    }

    /// Sends raw bytes (tests of malformed frames); answers to them are not tracked.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), KvClientError> {
        self.stream.write_all(bytes)?;
        Ok(())
    }

    /// The next answer, whatever its status.
    pub fn receive_any(&mut self) -> Result<KvResponse, KvClientError> {
        loop {
            if let Some(frame) = decode_response_frame(&self.receive_buffer[..self.received_bytes])?
            {
                let response = KvResponse {
                    request_id: frame.header.request_id,
                    opcode_raw: frame.header.opcode_raw,
                    status_raw: frame.header.status_raw,
                    value: frame.value.to_vec(),
                };
                let length = frame.length_bytes;
                self.receive_buffer
                    .copy_within(length..self.received_bytes, 0);
                self.received_bytes -= length;
                return Ok(response);
            }
            let read = match self
                .stream
                .read(&mut self.receive_buffer[self.received_bytes..])
            {
                Ok(read) => read,
                // A signal is no error of the connection (a server in the same process, as in
                // the tests, uses them to wake its threads): read again.
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error.into()),
            };
            if read == 0 {
                return Err(KvClientError::Closed);
            }
            self.received_bytes += read;
        }
    }

    /// The next answer to a request sent with [`Self::send`] (any of them).
    pub fn receive(&mut self) -> Result<KvResponse, KvClientError> {
        let response = self.receive_any()?;
        if !self.outstanding.remove(&response.request_id) {
            return Err(KvClientError::UnexpectedAnswer {
                request_id: response.request_id,
            });
        }
        Ok(response)
    }

    /// Requests sent and not yet answered.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    fn call(&mut self, request: &Request<'_>) -> Result<KvResponse, KvClientError> {
        assert_eq!(
            self.outstanding.len(),
            0,
            "a blocking call with answers pending"
        );
        self.send(request)?;
        self.receive()
    }

    fn expect_ok(response: KvResponse) -> Result<KvResponse, KvClientError> {
        match response.status() {
            Some(Status::Ok) => Ok(response),
            _ => Err(KvClientError::Status {
                status_raw: response.status_raw,
            }),
        }
    }

    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvClientError> {
        let response = self.call(&Request::Put { key, value })?;
        Self::expect_ok(response).map(|_| ())
    }

    /// The key's value; `None` when it is absent.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvClientError> {
        let response = self.call(&Request::Get { key })?;
        if response.status() == Some(Status::NotFound) {
            return Ok(None);
        }
        Self::expect_ok(response).map(|response| Some(response.value))
    }

    /// Removes the key; `false` when it was absent.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, KvClientError> {
        let response = self.call(&Request::Delete { key })?;
        if response.status() == Some(Status::NotFound) {
            return Ok(false);
        }
        Self::expect_ok(response).map(|_| true)
    }

    /// Every PUT and DELETE answered before it survives a restart once this returns.
    pub fn flush(&mut self) -> Result<(), KvClientError> {
        let response = self.call(&Request::Flush)?;
        Self::expect_ok(response).map(|_| ())
    }

    /// Charges this connection's later requests to tenant `handle` (0: back to the port's
    /// tenant). `NO_TENANT`: no such tenant on the table's namespace; the old one stays.
    pub fn bind(&mut self, handle: u64) -> Result<(), KvClientError> {
        let key = handle.to_le_bytes();
        let response = self.call(&Request::Bind { key: &key })?;
        Self::expect_ok(response).map(|_| ())
    }
}
