//! `reflex bench` against NBD servers: the `nbd://HOST[:PORT][/EXPORT]` target, the blocking
//! handshake that opens each connection, and a blocking queue-depth-1 client for the probe.
//!
//! Why in the bench: fio's nbd engine (libnbd, one connection) tops out near 65K IOPS on its
//! core, so it cannot tell fast NBD servers apart. Driving NBD from the bench engine gives the
//! same load (threads × connections, queue depth, open or closed loop, `--verify`) that the
//! native protocol gets, batched into one send per loop iteration. The handshake runs on a
//! plain blocking socket before the load starts (bounded by [`HANDSHAKE_TIMEOUT`]), then the
//! socket and an [`NbdCore`] go to the engine's io_uring loop. The protocol logic is
//! `reflex_proto::nbd::ClientHandshake`; this module only moves its bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use reflex_proto::nbd::{ClientHandshake, NegotiatedExport};

use super::nbd_core::NbdCore;

/// The IANA port of NBD, used when the URI names none.
pub const NBD_PORT_DEFAULT: u16 = 10809;
/// Longest handshake (connect, greeting, option replies), and longest wait for one probe reply.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const URI_SCHEME: &str = "nbd://";

/// A parsed `nbd://` server spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// `HOST:PORT` as given (the port defaulted), for resolving and for reports.
    pub authority: String,
    /// The export name, percent-decoded; empty: the server's default export.
    pub export: String,
}

impl NbdUri {
    /// Whether a `--server` value asks for NBD.
    pub fn is_nbd(spec: &str) -> bool {
        spec.starts_with(URI_SCHEME)
    }

    /// Parses `nbd://HOST[:PORT][/EXPORT]` (HOST may be `[IPv6]`; EXPORT is percent-decoded,
    /// as in the NBD URI specification). Query strings, TLS (`nbds://`) and Unix sockets
    /// (`nbd+unix://`) are not supported.
    pub fn parse(spec: &str) -> Result<NbdUri> {
        let Some(rest) = spec.strip_prefix(URI_SCHEME) else {
            bail!("{spec:?} is not an nbd:// URI");
        };
        if rest.contains('?') || rest.contains('#') {
            bail!("{spec:?}: query strings and fragments are not supported");
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() {
            bail!("{spec:?} names no host");
        }
        let has_port = match authority.strip_prefix('[') {
            Some(bracketed) => bracketed.contains("]:"),
            None => authority.contains(':'),
        };
        let authority = if has_port {
            authority.to_string()
        } else {
            format!("{authority}:{NBD_PORT_DEFAULT}")
        };
        let export = percent_decode(path).with_context(|| format!("export name in {spec:?}"))?;
        Ok(NbdUri { authority, export })
    }

    pub fn resolve(&self) -> Result<SocketAddr> {
        super::resolve_server(&self.authority)
    }
}

/// `%XX` escapes to bytes; the result must be UTF-8 (export names are strings).
fn percent_decode(text: &str) -> Result<String> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while let Some(&byte) = bytes.get(index) {
        if byte != b'%' {
            decoded.push(byte);
            index += 1;
            continue;
        }
        let hex = bytes
            .get(index + 1..index + 3)
            .and_then(|pair| std::str::from_utf8(pair).ok())
            .and_then(|pair| u8::from_str_radix(pair, 16).ok())
            .ok_or_else(|| anyhow!("bad percent escape at byte {index}"))?;
        decoded.push(hex);
        index += 3;
    }
    String::from_utf8(decoded).map_err(|_| anyhow!("not UTF-8 after percent-decoding"))
}

/// Connects and negotiates `export`; returns the socket in transmission, an empty core and
/// what the server said about the export.
pub fn connect(
    address: SocketAddr,
    export: &str,
) -> Result<(TcpStream, NbdCore, NegotiatedExport)> {
    let mut stream = TcpStream::connect_timeout(&address, HANDSHAKE_TIMEOUT)
        .with_context(|| format!("connecting to NBD server {address}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut handshake = ClientHandshake::new(export)?;
    let mut buffer = [0u8; 4096];
    let negotiated = loop {
        if let Some(negotiated) = handshake.outcome() {
            break negotiated;
        }
        let received = stream.read(&mut buffer);
        if is_interrupted(&received) {
            continue;
        }
        let received = received.with_context(|| format!("NBD handshake with {address}"))?;
        if received == 0 {
            return Err(handshake.handle_eof())
                .with_context(|| format!("NBD handshake with {address}"));
        }
        let consumed = handshake
            .handle_bytes(&buffer[..received])
            .with_context(|| format!("NBD handshake with {address}"))?;
        if consumed < received {
            // A server sends nothing in transmission before the first request.
            bail!("NBD server {address} sent data after the handshake ended");
        }
        let output = handshake.pending_output();
        if !output.is_empty() {
            stream.write_all(output)?;
            let sent = output.len();
            handshake.consume_output(sent);
        }
    };
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok((stream, NbdCore::new(), negotiated))
}

/// A call on a socket with a timeout fails with EINTR when the process is stopped and resumed
/// (signal(7)); it moved no byte and is made again.
fn is_interrupted(result: &std::io::Result<usize>) -> bool {
    result
        .as_ref()
        .is_err_and(|error| error.kind() == std::io::ErrorKind::Interrupted)
}

/// One request at a time over a blocking socket: the latency probe's NBD client.
pub struct BlockingNbd {
    stream: TcpStream,
    core: NbdCore,
}

impl BlockingNbd {
    pub fn connect(address: SocketAddr, export: &str, io_size_bytes: u32) -> Result<BlockingNbd> {
        let (stream, mut core, _) = connect(address, export)?;
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        core.reserve(1, io_size_bytes);
        Ok(BlockingNbd { stream, core })
    }

    /// Reads `buf.len()` bytes at `offset_bytes`.
    pub fn read(&mut self, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        self.core
            .submit_read(0, offset_bytes, u32::try_from(buf.len())?)?;
        self.round_trip(Some(buf))
    }

    /// Writes `data` at `offset_bytes`.
    pub fn write(&mut self, offset_bytes: u64, data: &[u8]) -> Result<()> {
        let length = u32::try_from(data.len())?;
        self.core
            .submit_write_with(0, offset_bytes, length, false, |buf| {
                buf.copy_from_slice(data);
            })?;
        self.round_trip(None)
    }

    fn round_trip(&mut self, read_into: Option<&mut [u8]>) -> Result<()> {
        while let Some(bytes) = self.core.transmit_start() {
            let written = self.stream.write(bytes);
            self.core
                .transmit_done(written.as_ref().map_or(0, |count| *count));
            if is_interrupted(&written) {
                continue;
            }
            if written.context("sending to the NBD server")? == 0 {
                bail!("the NBD server closed the connection");
            }
        }
        loop {
            if let Some(completion) = self.core.poll_completion()? {
                if let Some(failure) = completion.error_text() {
                    bail!("{failure}");
                }
                if let Some(buf) = read_into {
                    buf.copy_from_slice(completion.data);
                }
                return Ok(());
            }
            let Some(space) = self.core.receive_start() else {
                bail!("the probe's receive buffer is full without a complete reply");
            };
            let received = self.stream.read(space);
            self.core
                .receive_done(received.as_ref().map_or(0, |count| *count));
            if is_interrupted(&received) {
                continue;
            }
            if received.context("receiving from the NBD server")? == 0 {
                bail!("the NBD server closed the connection");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_with_defaults_and_escapes() {
        let cases = [
            ("nbd://127.0.0.1", "127.0.0.1:10809", ""),
            ("nbd://127.0.0.1/", "127.0.0.1:10809", ""),
            ("nbd://localhost:1234/ns1", "localhost:1234", "ns1"),
            ("nbd://[::1]/a%20b%2Fc", "[::1]:10809", "a b/c"),
            ("nbd://[::1]:99/x/y", "[::1]:99", "x/y"),
        ];
        for (spec, authority, export) in cases {
            assert!(NbdUri::is_nbd(spec));
            let uri = NbdUri::parse(spec).expect(spec);
            assert_eq!(uri.authority, authority, "{spec}");
            assert_eq!(uri.export, export, "{spec}");
        }
        for bad in [
            "127.0.0.1:7070",
            "nbd://",
            "nbd:///x",
            "nbd://h/%zz",
            "nbd://h/%4",
            "nbd://h/%ff",
            "nbd://h/x?tls=1",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} must be refused");
        }
        assert!(!NbdUri::is_nbd("127.0.0.1:7070"));
    }
}
