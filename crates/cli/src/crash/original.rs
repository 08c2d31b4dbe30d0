//! A pipelined client of the original ReFlex block protocol (docs/PROTOCOL.md §2), writes
//! only, without I/O: what the crash test needs to load the original port.
//!
//! The protocol has no status: the server acknowledges a write with the request's header
//! echoed (`lba_count` 0) and answers anything it refuses by closing the connection. So a
//! reply either matches an outstanding handle with the same `lba`, or the stream is broken.
//! Handles are the writer's slot indices, below the queue depth it reserved.

use reflex_proto::original::{HEADER_SIZE, Header, Opcode, SECTOR_SIZE_BYTES};

/// A reply the client cannot accept: the connection is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OriginalError {
    #[error("bad reply header: {0}")]
    Decode(#[from] reflex_proto::original::DecodeError),
    #[error("reply for handle {0}, which has no write outstanding")]
    UnknownHandle(u64),
    #[error("reply for handle {handle} echoes lba {found}, the write was at lba {expected}")]
    WrongLba {
        handle: u64,
        expected: u64,
        found: u64,
    },
    #[error("reply to a write is a read reply")]
    NotAWriteReply,
}

/// One original-protocol connection's requests and replies.
pub struct OriginalCore {
    /// Indexed by handle: the lba of the outstanding write.
    outstanding: Vec<Option<u64>>,
    transmit: Vec<u8>,
    transmit_sent_bytes: usize,
    receive: Vec<u8>,
}

impl OriginalCore {
    /// A core for handles `0..slots`.
    pub fn new(slots: usize) -> OriginalCore {
        OriginalCore {
            outstanding: vec![None; slots],
            transmit: Vec::new(),
            transmit_sent_bytes: 0,
            receive: Vec::new(),
        }
    }

    /// Queues a write of `data` (a multiple of 512 bytes) at `offset_bytes` under `handle`.
    pub fn submit_write(&mut self, handle: usize, offset_bytes: u64, data: &[u8]) {
        assert!(self.outstanding[handle].is_none(), "handle {handle} in use");
        assert!(offset_bytes.is_multiple_of(u64::from(SECTOR_SIZE_BYTES)));
        assert!(data.len().is_multiple_of(SECTOR_SIZE_BYTES as usize));
        let lba = offset_bytes / u64::from(SECTOR_SIZE_BYTES);
        let header = Header {
            opcode: Opcode::Write,
            handle: (handle as u64).to_le_bytes(),
            lba,
            lba_count: u32::try_from(data.len() / SECTOR_SIZE_BYTES as usize)
                .expect("a write of at most 1 MiB"),
        };
        self.transmit.extend_from_slice(&header.to_bytes());
        self.transmit.extend_from_slice(data);
        self.outstanding[handle] = Some(lba);
    }

    /// The bytes not yet sent.
    pub fn pending_output(&self) -> &[u8] {
        &self.transmit[self.transmit_sent_bytes..]
    }

    /// `count` of the pending bytes were sent.
    pub fn consume_output(&mut self, count: usize) {
        self.transmit_sent_bytes += count;
        assert!(self.transmit_sent_bytes <= self.transmit.len());
        if self.transmit_sent_bytes == self.transmit.len() {
            self.transmit.clear();
            self.transmit_sent_bytes = 0;
        }
    }

    /// Bytes received from the server.
    pub fn handle_bytes(&mut self, input: &[u8]) {
        self.receive.extend_from_slice(input);
    }

    /// The handle of the next acknowledged write, `Ok(None)` until a whole reply is there.
    pub fn poll_completion(&mut self) -> Result<Option<usize>, OriginalError> {
        let Some((header, consumed)) = Header::decode(&self.receive)? else {
            return Ok(None);
        };
        if header.opcode != Opcode::Write {
            return Err(OriginalError::NotAWriteReply);
        }
        let handle = u64::from_le_bytes(header.handle);
        let slot = usize::try_from(handle)
            .ok()
            .filter(|index| self.outstanding.get(*index).is_some_and(Option::is_some))
            .ok_or(OriginalError::UnknownHandle(handle))?;
        let expected = self.outstanding[slot].take().unwrap_or_default();
        if header.lba != expected {
            return Err(OriginalError::WrongLba {
                handle,
                expected,
                found: header.lba,
            });
        }
        debug_assert_eq!(consumed, HEADER_SIZE);
        self.receive.drain(..consumed);
        Ok(Some(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(handle: u64, lba: u64) -> [u8; HEADER_SIZE] {
        Header {
            opcode: Opcode::Write,
            handle: handle.to_le_bytes(),
            lba,
            lba_count: 0,
        }
        .to_bytes()
    }

    #[test]
    fn writes_are_framed_and_replies_matched_by_handle() {
        let mut core = OriginalCore::new(2);
        core.submit_write(0, 4096, &[1u8; 4096]);
        core.submit_write(1, 0, &[2u8; 512]);
        let sent = core.pending_output().to_vec();
        assert_eq!(sent.len(), 2 * HEADER_SIZE + 4096 + 512);
        let (first, _) = Header::decode(&sent).expect("valid").expect("whole");
        assert_eq!((first.lba, first.lba_count), (8, 8));
        core.consume_output(sent.len());
        assert!(core.pending_output().is_empty());

        // Replies in any order, split anywhere.
        let input = [reply(1, 0), reply(0, 8)].concat();
        core.handle_bytes(&input[..30]);
        assert_eq!(core.poll_completion(), Ok(Some(1)));
        assert_eq!(core.poll_completion(), Ok(None));
        core.handle_bytes(&input[30..]);
        assert_eq!(core.poll_completion(), Ok(Some(0)));
        // The handle is free again.
        core.submit_write(0, 0, &[3u8; 512]);
    }

    #[test]
    fn unknown_handles_and_wrong_lbas_break_the_stream() {
        let mut core = OriginalCore::new(2);
        core.submit_write(0, 4096, &[1u8; 512]);
        core.handle_bytes(&reply(1, 8));
        assert_eq!(core.poll_completion(), Err(OriginalError::UnknownHandle(1)));
        let mut core = OriginalCore::new(2);
        core.submit_write(0, 4096, &[1u8; 512]);
        core.handle_bytes(&reply(0, 9));
        assert!(matches!(
            core.poll_completion(),
            Err(OriginalError::WrongLba { .. })
        ));
    }
}
