//! Sans-IO framing of the original ReFlex protocol for the yardstick: the server's request
//! parser and the client's reply parser, both fed whatever bytes a receive returned.
//!
//! Why streaming parsers: a receive may end anywhere (inside a header, inside a write's
//! payload, inside a read's data), and copying a leftover to the front of a buffer costs the
//! very memory traffic this crate measures. Each parser therefore consumes every byte it is
//! given, keeps at most 23 bytes of an unfinished header, and counts payload bytes down without
//! storing them. Nothing here can panic on network bytes: framing errors are typed.

use reflex_proto::original::{self, HEADER_SIZE, Header, Opcode, SECTOR_SIZE_BYTES};

/// The largest request served and the largest reply accepted: the original server's 1 MiB.
pub const IO_SIZE_MAX_BYTES: u32 = original::IO_SIZE_MAX_BYTES_DEFAULT;

/// One response the server owes: the header to send and how many data bytes follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    pub header: [u8; HEADER_SIZE],
    pub data_length_bytes: u32,
}

/// Framing the server will not serve: the connection is closed (the protocol has no status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Decode(#[from] original::DecodeError),
    #[error("lba_count is 0")]
    ZeroLength,
    #[error("{length_bytes} bytes requested, at most {IO_SIZE_MAX_BYTES} served")]
    TooLarge { length_bytes: u64 },
}

/// Framing of a reply the client cannot follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error(transparent)]
    Decode(#[from] original::DecodeError),
    #[error("reply announces {length_bytes} data bytes, at most {IO_SIZE_MAX_BYTES} expected")]
    TooLarge { length_bytes: u64 },
}

/// Collects the 24 bytes of one header across receives.
#[derive(Debug, Clone, Default)]
struct HeaderAssembler {
    bytes: [u8; HEADER_SIZE],
    length: usize,
}

impl HeaderAssembler {
    /// Takes bytes from the front of `input` until a header is complete; returns it, or `None`
    /// when `input` ran out first (the bytes taken are kept for the next call).
    #[inline]
    fn take(&mut self, input: &mut &[u8]) -> Option<[u8; HEADER_SIZE]> {
        if self.length == 0
            && let Some(bytes) = input.first_chunk::<HEADER_SIZE>()
        {
            *input = &input[HEADER_SIZE..];
            return Some(*bytes);
        }
        let wanted = HEADER_SIZE - self.length;
        let taken = wanted.min(input.len());
        self.bytes[self.length..self.length + taken].copy_from_slice(&input[..taken]);
        self.length += taken;
        *input = &input[taken..];
        if self.length < HEADER_SIZE {
            return None;
        }
        self.length = 0;
        Some(self.bytes)
    }
}

/// Decodes 24 bytes that [`HeaderAssembler`] completed.
#[inline]
fn decode(bytes: &[u8; HEADER_SIZE]) -> Result<Header, original::DecodeError> {
    match Header::decode(bytes)? {
        Some((header, _)) => Ok(header),
        // 24 bytes always hold a header; `decode` only says "need more" below 24.
        None => Err(original::DecodeError::BadMagic { found: 0 }),
    }
}

/// The server side: request bytes in, [`Response`]s out, in request order.
///
/// A read is answered with its header echoed and `lba_count × 512` data bytes. A write's
/// payload is discarded and the write answered with its header, `lba_count` 0 (§2). The lba is
/// not checked: the yardstick serves every address from the same memory.
#[derive(Debug, Clone, Default)]
pub struct RequestParser {
    header: HeaderAssembler,
    /// Payload bytes of the current write still to discard.
    discard_bytes: u64,
    /// The response of the write whose payload is being discarded.
    write_response: Option<[u8; HEADER_SIZE]>,
}

impl RequestParser {
    /// Consumes all of `input`; calls `respond` for every request it completes, in order.
    /// After an error the connection must be closed (the parser's state is undefined).
    #[inline]
    pub fn handle_bytes(
        &mut self,
        mut input: &[u8],
        respond: &mut impl FnMut(Response),
    ) -> Result<(), RequestError> {
        loop {
            if self.discard_bytes > 0 {
                let discarded = self.discard_bytes.min(input.len() as u64);
                input = &input[discarded as usize..];
                self.discard_bytes -= discarded;
                if self.discard_bytes > 0 {
                    return Ok(());
                }
            }
            if let Some(header) = self.write_response.take() {
                respond(Response {
                    header,
                    data_length_bytes: 0,
                });
            }
            let Some(bytes) = self.header.take(&mut input) else {
                return Ok(());
            };
            let header = decode(&bytes)?;
            if header.lba_count == 0 {
                return Err(RequestError::ZeroLength);
            }
            let length_bytes = u64::from(header.lba_count) * u64::from(SECTOR_SIZE_BYTES);
            if length_bytes > u64::from(IO_SIZE_MAX_BYTES) {
                return Err(RequestError::TooLarge { length_bytes });
            }
            match header.opcode {
                Opcode::Read => respond(Response {
                    header: bytes,
                    data_length_bytes: length_bytes as u32,
                }),
                Opcode::Write => {
                    self.discard_bytes = length_bytes;
                    self.write_response = Some(
                        Header {
                            lba_count: 0,
                            ..header
                        }
                        .to_bytes(),
                    );
                }
            }
        }
    }
}

/// The client side: reply bytes in, one call per complete reply (header and all its data).
#[derive(Debug, Clone, Default)]
pub struct ReplyParser {
    header: HeaderAssembler,
    /// Data bytes of the current read reply still to arrive.
    data_remaining_bytes: u64,
    /// The reply whose data is arriving.
    current: Option<Header>,
}

impl ReplyParser {
    /// Consumes all of `input`; calls `on_reply` for every reply it completes, in order, and
    /// stops at the first error (from the framing or from `on_reply`).
    #[inline]
    pub fn handle_bytes<E: From<ReplyError>>(
        &mut self,
        mut input: &[u8],
        on_reply: &mut impl FnMut(Header) -> Result<(), E>,
    ) -> Result<(), E> {
        loop {
            if self.data_remaining_bytes > 0 {
                let taken = self.data_remaining_bytes.min(input.len() as u64);
                input = &input[taken as usize..];
                self.data_remaining_bytes -= taken;
                if self.data_remaining_bytes > 0 {
                    return Ok(());
                }
            }
            if let Some(header) = self.current.take() {
                on_reply(header)?;
            }
            let Some(bytes) = self.header.take(&mut input) else {
                return Ok(());
            };
            let header = decode(&bytes).map_err(ReplyError::from)?;
            let length_bytes = header.response_payload_length_bytes();
            if length_bytes > u64::from(IO_SIZE_MAX_BYTES) {
                return Err(ReplyError::TooLarge { length_bytes }.into());
            }
            self.data_remaining_bytes = length_bytes;
            self.current = Some(header);
        }
    }

    /// Whether a reply is partly received.
    pub fn is_mid_reply(&self) -> bool {
        self.current.is_some() || self.header.length > 0
    }
}

/// A request header: `opcode`, `handle`, `lba`, `lba_count`.
pub fn request(opcode: Opcode, handle: u64, lba: u64, lba_count: u32) -> [u8; HEADER_SIZE] {
    Header {
        opcode,
        handle: handle.to_le_bytes(),
        lba,
        lba_count,
    }
    .to_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `input` to a fresh request parser in pieces of `piece` bytes.
    fn responses(input: &[u8], piece: usize) -> Result<Vec<Response>, RequestError> {
        let mut parser = RequestParser::default();
        let mut out = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            parser.handle_bytes(chunk, &mut |response| out.push(response))?;
        }
        Ok(out)
    }

    fn stream() -> (Vec<u8>, Vec<Response>) {
        let mut input = Vec::new();
        let mut expected = Vec::new();
        let read = request(Opcode::Read, 7, 8, 8);
        input.extend_from_slice(&read);
        expected.push(Response {
            header: read,
            data_length_bytes: 4096,
        });
        input.extend_from_slice(&request(Opcode::Write, 9, 16, 2));
        input.extend_from_slice(&[0xab; 1024]);
        expected.push(Response {
            header: request(Opcode::Write, 9, 16, 0),
            data_length_bytes: 0,
        });
        let read = request(Opcode::Read, 11, 0, 2048);
        input.extend_from_slice(&read);
        expected.push(Response {
            header: read,
            data_length_bytes: 1 << 20,
        });
        (input, expected)
    }

    #[test]
    fn requests_split_anywhere_give_the_same_responses() {
        let (input, expected) = stream();
        for piece in [1, 2, 5, 23, 24, 25, 100, 1023, input.len()] {
            assert_eq!(
                responses(&input, piece),
                Ok(expected.clone()),
                "piece {piece}"
            );
        }
    }

    #[test]
    fn a_write_is_answered_only_after_its_whole_payload() {
        let mut parser = RequestParser::default();
        let mut out = Vec::new();
        let header = request(Opcode::Write, 1, 0, 1);
        parser
            .handle_bytes(&header, &mut |response| out.push(response))
            .unwrap();
        parser
            .handle_bytes(&[0; 511], &mut |response| out.push(response))
            .unwrap();
        assert!(out.is_empty());
        parser
            .handle_bytes(&[0; 1], &mut |response| out.push(response))
            .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].header, request(Opcode::Write, 1, 0, 0));
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        let mut bad_magic = request(Opcode::Read, 1, 0, 8);
        bad_magic[0] = 25;
        assert_eq!(
            responses(&bad_magic, 24),
            Err(RequestError::Decode(original::DecodeError::BadMagic {
                found: 25
            }))
        );
        let mut bad_opcode = request(Opcode::Read, 1, 0, 8);
        bad_opcode[2] = 2;
        assert_eq!(
            responses(&bad_opcode, 7),
            Err(RequestError::Decode(original::DecodeError::UnknownOpcode {
                found: 2
            }))
        );
        assert_eq!(
            responses(&request(Opcode::Read, 1, 0, 0), 24),
            Err(RequestError::ZeroLength)
        );
        assert_eq!(
            responses(&request(Opcode::Write, 1, 0, 2049), 24),
            Err(RequestError::TooLarge {
                length_bytes: 2049 * 512
            })
        );
    }

    /// Feeds `input` to a fresh reply parser in pieces of `piece` bytes; returns the handles.
    fn replies(input: &[u8], piece: usize) -> Result<Vec<u64>, ReplyError> {
        let mut parser = ReplyParser::default();
        let mut handles = Vec::new();
        for chunk in input.chunks(piece.max(1)) {
            parser.handle_bytes(chunk, &mut |header: Header| {
                handles.push(u64::from_le_bytes(header.handle));
                Ok::<(), ReplyError>(())
            })?;
        }
        assert!(!parser.is_mid_reply());
        Ok(handles)
    }

    #[test]
    fn replies_split_anywhere_are_reported_whole_and_in_order() {
        let mut input = Vec::new();
        for handle in 0..5u64 {
            input.extend_from_slice(&request(Opcode::Read, handle, handle, 8));
            input.extend_from_slice(&[handle as u8; 4096]);
        }
        input.extend_from_slice(&request(Opcode::Write, 5, 0, 0));
        for piece in [1, 3, 24, 4096, 4120, 4121, input.len()] {
            assert_eq!(replies(&input, piece), Ok(vec![0, 1, 2, 3, 4, 5]));
        }
    }

    #[test]
    fn a_reply_announcing_too_much_data_is_refused() {
        assert_eq!(
            replies(&request(Opcode::Read, 1, 0, 4096), 24),
            Err(ReplyError::TooLarge {
                length_bytes: 4096 * 512
            })
        );
    }
}
