//! Which TLS stack a session needs, read from the client's first record (RFC 8446 §4.1.2):
//! a ClientHello that offers one of the server's external pre-shared keys (an identity of
//! the `pre_shared_key` extension, 41, that the key file names) goes to the OpenSSL PSK
//! session (`psk.rs`), every other one to rustls. Why sniff: rustls has no external PSKs,
//! and which one a client wants shows only in its hello.
//!
//! Why match the identity and not just the extension: a TLS 1.3 resumption offers a ticket
//! in the same extension, and belongs to rustls (reflexd's rustls issues no tickets, but a
//! client may hold one from elsewhere).
//!
//! Pure and bounds-checked: any malformed or truncated hello is [`Sniff::Other`], and rustls
//! then refuses it with its own alert.

/// What the first bytes of a TLS session ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniff {
    /// The first record is not complete yet.
    NeedMore,
    /// A ClientHello offering one of the server's pre-shared keys.
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
/// `known`: whether an offered identity is one of the server's.
pub fn sniff(bytes: &[u8], buffer_full: bool, known: impl Fn(&[u8]) -> bool) -> Sniff {
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
    match offers_psk(record, known) {
        Some(true) => Sniff::Psk,
        _ => Sniff::Other,
    }
}

/// Whether the ClientHello in `record` offers a `known` identity in its `pre_shared_key`
/// extension; `None` when it is cut or malformed.
fn offers_psk(record: &[u8], known: impl Fn(&[u8]) -> bool) -> Option<bool> {
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
        let body = extensions.take(length)?;
        if kind == EXTENSION_PRE_SHARED_KEY {
            // OfferedPsks: identities<7..2^16-1> (each identity<1..2^16-1> and a u32
            // obfuscated_ticket_age), then the binders.
            let mut psk = Reader { bytes: body };
            let identities_bytes = usize::from(psk.u16()?);
            let mut identities = Reader {
                bytes: psk.take(identities_bytes)?,
            };
            while !identities.bytes.is_empty() {
                let identity_bytes = usize::from(identities.u16()?);
                let identity = identities.take(identity_bytes)?;
                identities.take(4)?;
                if known(identity) {
                    return Some(true);
                }
            }
            return Some(false);
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

    /// A `pre_shared_key` extension body offering `identities`, with one dummy binder.
    fn offered(identities: &[&[u8]]) -> Vec<u8> {
        let mut list = Vec::new();
        for identity in identities {
            list.extend((identity.len() as u16).to_be_bytes());
            list.extend(*identity);
            list.extend([0, 0, 0, 0]);
        }
        let mut body = (list.len() as u16).to_be_bytes().to_vec();
        body.extend(list);
        body.extend([0, 33, 32]);
        body.extend([9u8; 32]);
        body
    }

    fn known(identity: &[u8]) -> bool {
        identity == b"A"
    }

    #[test]
    fn a_hello_offering_a_known_identity_is_psk() {
        let psk = offered(&[b"ticket-from-elsewhere", b"A"]);
        let record = hello(&[(43, &[2, 3, 4]), (45, &[1, 1]), (41, &psk)]);
        assert_eq!(sniff(&record, false, known), Sniff::Psk);
    }

    #[test]
    fn a_resumption_or_an_unknown_identity_is_other() {
        let psk = offered(&[b"a-session-ticket"]);
        let record = hello(&[(43, &[2, 3, 4]), (45, &[1, 1]), (41, &psk)]);
        assert_eq!(sniff(&record, false, known), Sniff::Other);
        let record = hello(&[(43, &[2, 3, 4]), (45, &[1, 1])]);
        assert_eq!(sniff(&record, false, known), Sniff::Other);
    }

    #[test]
    fn every_cut_of_a_record_waits_for_more() {
        let record = hello(&[(41, &offered(&[b"A"]))]);
        for cut in 0..record.len() {
            assert_eq!(
                sniff(&record[..cut], false, known),
                Sniff::NeedMore,
                "cut {cut}"
            );
        }
        // A full buffer decides on what it has: the cut hello is not PSK.
        assert_eq!(
            sniff(&record[..record.len() - 1], true, known),
            Sniff::Other
        );
    }

    #[test]
    fn plaintext_and_malformed_hellos_are_other() {
        assert_eq!(sniff(b"GET / HTTP/1.1\r\n", false, known), Sniff::Other);
        assert_eq!(sniff(b"G", false, known), Sniff::Other);
        let mut record = hello(&[(41, &offered(&[b"A"]))]);
        record[5] = 2; // not a ClientHello
        assert_eq!(sniff(&record, false, known), Sniff::Other);
        let mut record = hello(&[(41, &offered(&[b"A"]))]);
        // The extension list's length (after the record and handshake headers, version,
        // random, session id, one cipher suite and the compression methods) overruns it.
        record[5 + 4 + 2 + 32 + 1 + 4 + 2] = 0xff;
        assert_eq!(sniff(&record, false, known), Sniff::Other);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            let length = (state >> 40) as usize % 300;
            let mut bytes = hello(&[(41, &offered(&[b"A"]))]);
            bytes.truncate(length.min(bytes.len()));
            for (i, b) in bytes.iter_mut().enumerate() {
                if (state >> (i % 60)) & 7 == 0 {
                    *b ^= (state >> 8) as u8;
                }
            }
            let _ = sniff(&bytes, state & 1 == 0, known);
        }
    }
}
