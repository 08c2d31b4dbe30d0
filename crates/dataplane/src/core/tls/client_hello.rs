//! Which TLS stack a session needs, read from the client's first record (RFC 8446 §4.1.2):
//! a ClientHello that offers an external pre-shared key (the `pre_shared_key` extension,
//! 41) goes to the OpenSSL PSK session (`psk.rs`), every other one to rustls. Why sniff:
//! rustls has no external PSKs, and which one a client wants shows only in its hello.
//!
//! rustls here never issues session tickets (`crates/server/src/tls.rs`), so a
//! `pre_shared_key` extension never means a resumption meant for rustls.
//!
//! Pure and bounds-checked: any malformed or truncated hello is [`Sniff::Other`], and rustls
//! then refuses it with its own alert.

/// What the first bytes of a TLS session ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniff {
    /// The first record is not complete yet.
    NeedMore,
    /// A ClientHello offering an external pre-shared key.
    Psk,
    /// Anything else (a certificate handshake, or not TLS at all).
    Other,
}

const RECORD_HEADER_BYTES: usize = 5;
const CONTENT_TYPE_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXTENSION_PRE_SHARED_KEY: u16 = 41;

/// Reads `bytes` (the session's ciphertext from its first byte). `buffer_full`: no more
/// bytes can arrive before a decision (a hello longer than the buffer is not PSK).
pub fn sniff(bytes: &[u8], buffer_full: bool) -> Sniff {
    if bytes.len() < RECORD_HEADER_BYTES {
        return if buffer_full || (!bytes.is_empty() && bytes[0] != CONTENT_TYPE_HANDSHAKE) {
            Sniff::Other
        } else {
            Sniff::NeedMore
        };
    }
    if bytes[0] != CONTENT_TYPE_HANDSHAKE {
        return Sniff::Other;
    }
    let record_bytes = usize::from(u16::from_be_bytes([bytes[3], bytes[4]]));
    let available = bytes.len() - RECORD_HEADER_BYTES;
    if available < record_bytes && !buffer_full {
        return Sniff::NeedMore;
    }
    let record = &bytes[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + record_bytes.min(available)];
    match offers_psk(record) {
        Some(true) => Sniff::Psk,
        _ => Sniff::Other,
    }
}

/// Whether the ClientHello in `record` has a `pre_shared_key` extension; `None` when it is
/// cut or malformed.
fn offers_psk(record: &[u8]) -> Option<bool> {
    let mut reader = Reader { bytes: record };
    if reader.u8()? != HANDSHAKE_CLIENT_HELLO {
        return None;
    }
    let body_bytes = reader.u24()?;
    let mut hello = Reader {
        bytes: reader.take(body_bytes)?,
    };
    hello.take(2 + 32)?; // legacy_version, random
    let session_id_bytes = usize::from(hello.u8()?);
    hello.take(session_id_bytes)?;
    let cipher_suites_bytes = usize::from(hello.u16()?);
    hello.take(cipher_suites_bytes)?;
    let compression_bytes = usize::from(hello.u8()?);
    hello.take(compression_bytes)?;
    if hello.bytes.is_empty() {
        return Some(false); // No extensions at all.
    }
    let extensions_bytes = usize::from(hello.u16()?);
    let mut extensions = Reader {
        bytes: hello.take(extensions_bytes)?,
    };
    while !extensions.bytes.is_empty() {
        let kind = extensions.u16()?;
        let length = usize::from(extensions.u16()?);
        extensions.take(length)?;
        if kind == EXTENSION_PRE_SHARED_KEY {
            return Some(true);
        }
    }
    Some(false)
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.bytes.len() {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u24(&mut self) -> Option<usize> {
        let b = self.take(3)?;
        Some(usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello record with the given extensions (type, body).
    fn hello(extensions: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(0); // session id
        body.extend([0, 2, 0x13, 0x01]); // one cipher suite
        body.extend([1, 0]); // null compression
        let mut ext = Vec::new();
        for (kind, data) in extensions {
            ext.extend(kind.to_be_bytes());
            ext.extend((data.len() as u16).to_be_bytes());
            ext.extend(*data);
        }
        body.extend((ext.len() as u16).to_be_bytes());
        body.extend(ext);
        let mut handshake = vec![HANDSHAKE_CLIENT_HELLO];
        handshake.extend(&(body.len() as u32).to_be_bytes()[1..]);
        handshake.extend(body);
        let mut record = vec![CONTENT_TYPE_HANDSHAKE, 3, 1];
        record.extend((handshake.len() as u16).to_be_bytes());
        record.extend(handshake);
        record
    }

    #[test]
    fn a_hello_with_pre_shared_key_is_psk() {
        let record = hello(&[(43, &[2, 3, 4]), (45, &[1, 1]), (41, &[0, 0, 0, 0])]);
        assert_eq!(sniff(&record, false), Sniff::Psk);
    }

    #[test]
    fn a_hello_without_it_is_other() {
        let record = hello(&[(43, &[2, 3, 4]), (45, &[1, 1])]);
        assert_eq!(sniff(&record, false), Sniff::Other);
    }

    #[test]
    fn every_cut_of_a_record_waits_for_more() {
        let record = hello(&[(41, &[0, 0])]);
        for cut in 0..record.len() {
            assert_eq!(sniff(&record[..cut], false), Sniff::NeedMore, "cut {cut}");
        }
        // A full buffer decides on what it has: the cut hello is not PSK.
        assert_eq!(sniff(&record[..record.len() - 1], true), Sniff::Other);
    }

    #[test]
    fn plaintext_and_malformed_hellos_are_other() {
        assert_eq!(sniff(b"GET / HTTP/1.1\r\n", false), Sniff::Other);
        assert_eq!(sniff(b"G", false), Sniff::Other);
        let mut record = hello(&[(41, &[0, 0])]);
        record[5] = 2; // not a ClientHello
        assert_eq!(sniff(&record, false), Sniff::Other);
        let mut record = hello(&[(41, &[0, 0])]);
        let last = record.len() - 3;
        record[last] = 0xff; // an extension longer than its list
        assert_eq!(sniff(&record, false), Sniff::Other);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            let length = (state >> 40) as usize % 300;
            let mut bytes = hello(&[(41, &[0, 0])]);
            bytes.truncate(length.min(bytes.len()));
            for (i, b) in bytes.iter_mut().enumerate() {
                if (state >> (i % 60)) & 7 == 0 {
                    *b ^= (state >> 8) as u8;
                }
            }
            let _ = sniff(&bytes, state & 1 == 0);
        }
    }
}
