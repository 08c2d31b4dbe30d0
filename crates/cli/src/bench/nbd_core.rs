//! One NBD connection in transmission, without I/O: the bench engine's counterpart of the
//! native protocol's `reflex_client::ConnectionCore`.
//!
//! Why its own core: NBD simple replies carry no length, so the client must remember, per
//! cookie, whether a successful reply is followed by READ data and how much. Cookies are the
//! engine's slot indices (below the queue depth), so the outstanding table is a plain vector
//! indexed by cookie: a reply's cookie from the network is looked up with a bounds-checked
//! `get`, never trusted. Requests are encoded into one transmit buffer (so a loop iteration's
//! requests leave in one send) and replies are parsed in place from one receive buffer, READ
//! data borrowed without a copy. As with `ConnectionCore`, both buffers are a
//! [`StreamBuffers`]: the driver lends them to the kernel (`transmit_start`/`transmit_done`,
//! `receive_start`/`receive_done`), and a lent buffer never moves: [`NbdCore::reserve`] sizes
//! both up front. Any reply the client cannot
//! accept (bad magic, a structured reply, a cookie not outstanding) breaks the connection with
//! an [`NbdCoreError`], returned again on every later call.

use reflex_client::StreamBuffers;
use reflex_proto::nbd::{
    Errno, REQUEST_HEADER_SIZE, SIMPLE_REPLY_SIZE, SimpleReplyError, command_flags,
    decode_simple_reply, flush_request, read_request, write_request,
};

/// Smallest receive buffer: room for many 4 KiB replies per receive.
const RECEIVE_BUFFER_MIN_BYTES: usize = 256 * 1024;
/// Below this much free space at the end, `receive_start` compacts the buffer first.
const RECEIVE_SPARE_MIN_BYTES: usize = 64 * 1024;

const _: () = assert!(RECEIVE_SPARE_MIN_BYTES < RECEIVE_BUFFER_MIN_BYTES);

/// A request the core refuses; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdSubmitError {
    #[error("cookie {cookie} is outside the {slots} reserved slots or still outstanding")]
    Cookie { cookie: u64, slots: usize },
    #[error("the transmit buffer would have to grow while the kernel holds it")]
    BuffersBusy,
    #[error("the connection is broken")]
    Broken,
}

/// A reply that breaks the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdCoreError {
    #[error("{0}")]
    Reply(#[from] SimpleReplyError),
    #[error("reply for cookie {0}, which has no request outstanding")]
    UnknownCookie(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outstanding {
    /// READ: the data length that follows a successful reply; 0 otherwise.
    read_length_bytes: u32,
}

/// A reply taken out of the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdCompletion<'a> {
    pub cookie: u64,
    /// 0 on success, else an NBD error value.
    pub error: u32,
    /// READ data on success; empty otherwise.
    pub data: &'a [u8],
}

impl NbdCompletion<'_> {
    /// The error as text for the bench's error counters, e.g. `NBD error EINVAL (22)`.
    pub fn error_text(&self) -> Option<String> {
        if self.error == 0 {
            return None;
        }
        let name = match Errno::from_u32(self.error) {
            Ok(Errno::Perm) => "EPERM",
            Ok(Errno::Io) => "EIO",
            Ok(Errno::NoMem) => "ENOMEM",
            Ok(Errno::Inval) => "EINVAL",
            Ok(Errno::NoSpc) => "ENOSPC",
            Ok(Errno::Overflow) => "EOVERFLOW",
            Ok(Errno::NotSup) => "ENOTSUP",
            Ok(Errno::Shutdown) => "ESHUTDOWN",
            Err(_) => "unknown",
        };
        Some(format!("NBD error {name} ({})", self.error))
    }
}

/// One NBD connection after the handshake. Drive it like `ConnectionCore`: submit, lend the
/// transmit bytes, lend receive space, poll completions.
pub struct NbdCore {
    /// Requests to send and replies received but not yet polled.
    buffers: StreamBuffers,
    /// Indexed by cookie.
    outstanding: Vec<Option<Outstanding>>,
    outstanding_count: usize,
    broken: Option<NbdCoreError>,
}

impl Default for NbdCore {
    fn default() -> Self {
        NbdCore::new()
    }
}

impl NbdCore {
    /// A core with no slots; [`NbdCore::reserve`] before submitting.
    pub fn new() -> NbdCore {
        NbdCore {
            buffers: StreamBuffers::new(0, RECEIVE_BUFFER_MIN_BYTES, RECEIVE_SPARE_MIN_BYTES),
            outstanding: Vec::new(),
            outstanding_count: 0,
            broken: None,
        }
    }

    #[cfg(test)]
    fn outstanding_count(&self) -> usize {
        self.outstanding_count
    }

    /// Makes room, while nothing is lent, for cookies `0..requests` with payloads of up to
    /// `io_size_bytes`, so the buffers never grow during the run.
    pub fn reserve(&mut self, requests: usize, io_size_bytes: u32) {
        let frame_bytes = REQUEST_HEADER_SIZE + io_size_bytes as usize;
        // Unsent frames of every request, plus as much again of sent bytes not yet compacted.
        let transmit_bytes = 2 * requests * frame_bytes;
        let receive_bytes = (SIMPLE_REPLY_SIZE + io_size_bytes as usize + RECEIVE_SPARE_MIN_BYTES)
            .max(RECEIVE_BUFFER_MIN_BYTES);
        self.buffers.reserve(transmit_bytes, receive_bytes);
        if self.outstanding.len() < requests {
            self.outstanding.resize(requests, None);
        }
    }

    /// Queues a READ of `length_bytes` at `offset_bytes` under `cookie`.
    pub fn submit_read(
        &mut self,
        cookie: u64,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<(), NbdSubmitError> {
        self.admit(cookie, 0, length_bytes)?;
        self.buffers
            .push_frame(&read_request(cookie, offset_bytes, length_bytes), 0, |_| {});
        self.record(
            cookie,
            Outstanding {
                read_length_bytes: length_bytes,
            },
        );
        Ok(())
    }

    /// Queues a WRITE whose payload `fill` writes in place into the transmit buffer; with
    /// `fua` the request carries `NBD_CMD_FLAG_FUA` (the export must advertise `SEND_FUA`).
    pub fn submit_write_with(
        &mut self,
        cookie: u64,
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), NbdSubmitError> {
        self.admit(cookie, length_bytes, 0)?;
        let flags = if fua { command_flags::FUA } else { 0 };
        self.buffers.push_frame(
            &write_request(cookie, offset_bytes, length_bytes, flags),
            length_bytes as usize,
            fill,
        );
        self.record(
            cookie,
            Outstanding {
                read_length_bytes: 0,
            },
        );
        Ok(())
    }

    /// Queues a FLUSH under `cookie` (the export must advertise `SEND_FLUSH`): its reply comes
    /// once every write acknowledged before the server received it is durable.
    pub fn submit_flush(&mut self, cookie: u64) -> Result<(), NbdSubmitError> {
        self.admit(cookie, 0, 0)?;
        self.buffers.push_frame(&flush_request(cookie), 0, |_| {});
        self.record(
            cookie,
            Outstanding {
                read_length_bytes: 0,
            },
        );
        Ok(())
    }

    /// Every check before anything changes; makes room in the buffers when none is lent.
    fn admit(
        &mut self,
        cookie: u64,
        payload_bytes: u32,
        read_length_bytes: u32,
    ) -> Result<(), NbdSubmitError> {
        if self.broken.is_some() {
            return Err(NbdSubmitError::Broken);
        }
        let free = usize::try_from(cookie)
            .ok()
            .and_then(|index| self.outstanding.get(index))
            .is_some_and(Option::is_none);
        if !free {
            return Err(NbdSubmitError::Cookie {
                cookie,
                slots: self.outstanding.len(),
            });
        }
        let frame_bytes = REQUEST_HEADER_SIZE + payload_bytes as usize;
        let receive_needed =
            SIMPLE_REPLY_SIZE + read_length_bytes as usize + RECEIVE_SPARE_MIN_BYTES;
        self.buffers
            .make_room(frame_bytes, receive_needed)
            .map_err(|_| NbdSubmitError::BuffersBusy)
    }

    fn record(&mut self, cookie: u64, outstanding: Outstanding) {
        // `admit` checked that the slot exists and is free.
        let slot = &mut self.outstanding[cookie as usize];
        assert!(slot.is_none());
        *slot = Some(outstanding);
        self.outstanding_count += 1;
        debug_assert!(self.outstanding_count <= self.outstanding.len());
    }

    /// Lends the unsent bytes for one send; `None` when there are none or one is in flight.
    pub fn transmit_start(&mut self) -> Option<&[u8]> {
        self.buffers.transmit_start()
    }

    /// `sent_bytes` of the lent bytes were sent (0 after a failed send).
    pub fn transmit_done(&mut self, sent_bytes: usize) {
        self.buffers.transmit_done(sent_bytes);
    }

    /// Lends free receive space for one receive; `None` when a receive is in flight or the
    /// buffer is full of complete replies (poll them first).
    pub fn receive_start(&mut self) -> Option<&mut [u8]> {
        let outstanding = &self.outstanding;
        self.buffers
            .receive_start(|unread| front_frame_bytes(outstanding, unread))
    }

    /// `received_bytes` arrived in the lent space (0 after a failed receive).
    pub fn receive_done(&mut self, received_bytes: usize) {
        self.buffers.receive_done(received_bytes);
    }

    /// Copies received bytes in (tests); returns how many were taken.
    #[cfg(test)]
    fn handle_received_bytes(&mut self, bytes: &[u8]) -> usize {
        let outstanding = &self.outstanding;
        self.buffers
            .receive_copy(bytes, |unread| front_frame_bytes(outstanding, unread))
    }

    fn break_with(&mut self, error: NbdCoreError) -> NbdCoreError {
        self.broken = Some(error.clone());
        error
    }

    /// The next complete reply, or `None` until more bytes arrive.
    pub fn poll_completion(&mut self) -> Result<Option<NbdCompletion<'_>>, NbdCoreError> {
        if let Some(error) = &self.broken {
            return Err(error.clone());
        }
        let buffered = self.buffers.received();
        let reply = match decode_simple_reply(buffered) {
            Ok(None) => return Ok(None),
            Ok(Some((reply, _))) => reply,
            Err(error) => return Err(self.break_with(error.into())),
        };
        let Some(outstanding) = lookup(&self.outstanding, reply.cookie) else {
            return Err(self.break_with(NbdCoreError::UnknownCookie(reply.cookie)));
        };
        let frame_bytes = frame_bytes(reply.error, outstanding);
        if buffered.len() < frame_bytes {
            return Ok(None);
        }
        // `lookup` found the slot, so the cookie is a valid index.
        self.outstanding[reply.cookie as usize] = None;
        self.outstanding_count -= 1;
        let frame = self.buffers.take_received(frame_bytes);
        Ok(Some(NbdCompletion {
            cookie: reply.cookie,
            error: reply.error,
            data: &frame[SIMPLE_REPLY_SIZE..],
        }))
    }
}

/// The outstanding request under `cookie`; a cookie from the network is checked, not trusted.
fn lookup(outstanding: &[Option<Outstanding>], cookie: u64) -> Option<Outstanding> {
    usize::try_from(cookie)
        .ok()
        .and_then(|index| outstanding.get(index))
        .copied()
        .flatten()
}

/// Length of the reply at the front of `unread` (header plus READ data), if its header is
/// valid and its cookie outstanding.
fn front_frame_bytes(outstanding: &[Option<Outstanding>], unread: &[u8]) -> Option<usize> {
    let (reply, _) = decode_simple_reply(unread).ok().flatten()?;
    let request = lookup(outstanding, reply.cookie)?;
    Some(frame_bytes(reply.error, request))
}

/// Bytes of a reply: the header, plus the READ data when it succeeded.
fn frame_bytes(error: u32, outstanding: Outstanding) -> usize {
    let data = if error == 0 {
        outstanding.read_length_bytes as usize
    } else {
        0
    };
    SIMPLE_REPLY_SIZE + data
}

#[cfg(test)]
mod tests {
    use reflex_proto::nbd::{CommandType, SimpleReply, decode_request};

    use super::*;

    fn reply(cookie: u64, error: u32) -> Vec<u8> {
        SimpleReply { error, cookie }.to_bytes().to_vec()
    }

    fn sent(core: &mut NbdCore) -> Vec<u8> {
        let bytes = core
            .transmit_start()
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        if !bytes.is_empty() {
            core.transmit_done(bytes.len());
        }
        bytes
    }

    #[test]
    fn requests_batch_into_one_send_and_replies_match_cookies() {
        let mut core = NbdCore::new();
        core.reserve(4, 4096);
        core.submit_read(0, 8192, 4096).expect("read");
        core.submit_write_with(1, 0, 512, false, |buf| buf.fill(0xab))
            .expect("write");
        assert_eq!(core.outstanding_count(), 2);
        let bytes = sent(&mut core);
        assert_eq!(bytes.len(), 28 + 28 + 512);
        let (read, _) = decode_request(&bytes).expect("magic").expect("header");
        assert_eq!(
            (read.cookie, read.offset_bytes, read.length_bytes),
            (0, 8192, 4096)
        );
        let (write, _) = decode_request(&bytes[28..])
            .expect("magic")
            .expect("header");
        assert_eq!((write.cookie, write.payload_length_bytes()), (1, 512));
        assert!(bytes[56..].iter().all(|byte| *byte == 0xab));

        // Write reply first, then the read's header and data in two pieces.
        let data = vec![7u8; 4096];
        let input = [reply(1, 0), reply(0, 0), data.clone()].concat();
        core.handle_received_bytes(&input[..16 + 100]);
        let first = core.poll_completion().expect("valid").expect("write reply");
        assert_eq!((first.cookie, first.error, first.data.len()), (1, 0, 0));
        assert_eq!(
            core.poll_completion(),
            Ok(None),
            "the read's data is incomplete"
        );
        core.handle_received_bytes(&input[16 + 100..]);
        let second = core.poll_completion().expect("valid").expect("read reply");
        assert_eq!((second.cookie, second.data), (0, &data[..]));
        assert_eq!(core.outstanding_count(), 0);
        // The cookie is free again.
        core.submit_read(0, 0, 4096).expect("cookie reused");
    }

    #[test]
    fn fua_writes_and_flushes_carry_their_flags_and_commands() {
        let mut core = NbdCore::new();
        core.reserve(2, 4096);
        core.submit_write_with(0, 4096, 512, true, |buf| buf.fill(1))
            .expect("write");
        core.submit_flush(1).expect("flush");
        let bytes = sent(&mut core);
        assert_eq!(bytes.len(), 28 + 512 + 28);
        let (write, _) = decode_request(&bytes).expect("magic").expect("header");
        assert_eq!(write.flags, command_flags::FUA);
        let (flush, _) = decode_request(&bytes[28 + 512..])
            .expect("magic")
            .expect("header");
        assert_eq!(
            (
                flush.cookie,
                flush.flags,
                flush.offset_bytes,
                flush.length_bytes
            ),
            (1, 0, 0, 0)
        );
        assert_eq!(flush.command_raw, CommandType::Flush.as_u16());
        // A flush's reply carries no data.
        core.handle_received_bytes(&[reply(1, 0), reply(0, 0)].concat());
        assert_eq!(
            core.poll_completion()
                .expect("valid")
                .expect("flush")
                .cookie,
            1
        );
        assert_eq!(
            core.poll_completion()
                .expect("valid")
                .expect("write")
                .cookie,
            0
        );
    }

    #[test]
    fn an_error_reply_carries_no_data() {
        let mut core = NbdCore::new();
        core.reserve(1, 4096);
        core.submit_read(0, 0, 4096).expect("read");
        core.handle_received_bytes(&reply(0, 22));
        let completion = core.poll_completion().expect("valid").expect("reply");
        assert_eq!(
            completion.error_text().as_deref(),
            Some("NBD error EINVAL (22)")
        );
        assert!(completion.data.is_empty());
    }

    #[test]
    fn bad_replies_break_the_connection_with_typed_errors() {
        let cases = [
            (reply(3, 0), NbdCoreError::UnknownCookie(3)),
            (reply(u64::MAX, 0), NbdCoreError::UnknownCookie(u64::MAX)),
            (
                vec![0xde, 0xad, 0xbe, 0xef],
                NbdCoreError::Reply(SimpleReplyError::BadMagic { found: 0xdead_beef }),
            ),
            (
                vec![0x66, 0x8e, 0x33, 0xef],
                NbdCoreError::Reply(SimpleReplyError::Structured),
            ),
        ];
        for (input, expected) in cases {
            let mut core = NbdCore::new();
            core.reserve(2, 4096);
            core.submit_read(0, 0, 4096).expect("read");
            core.handle_received_bytes(&input);
            assert_eq!(core.poll_completion(), Err(expected.clone()));
            assert_eq!(core.poll_completion(), Err(expected), "stays broken");
            assert_eq!(core.submit_read(1, 0, 4096), Err(NbdSubmitError::Broken));
        }
    }

    #[test]
    fn cookies_outside_the_slots_or_in_use_are_refused() {
        let mut core = NbdCore::new();
        core.reserve(2, 4096);
        core.submit_read(1, 0, 4096).expect("read");
        for cookie in [1, 2, u64::MAX] {
            assert!(matches!(
                core.submit_read(cookie, 0, 4096),
                Err(NbdSubmitError::Cookie { .. })
            ));
        }
        assert_eq!(core.outstanding_count(), 1);
    }

    #[test]
    fn many_reads_flow_through_a_small_buffer() {
        // More data than the receive buffer holds, fed in odd pieces: compaction keeps up.
        let mut core = NbdCore::new();
        core.reserve(8, 64 * 1024);
        let mut stream = Vec::new();
        let mut completed = 0;
        for round in 0..40u64 {
            for cookie in 0..8u64 {
                core.submit_read(cookie, 0, 64 * 1024).expect("read");
                stream.extend_from_slice(&reply(cookie, 0));
                stream.extend(std::iter::repeat_n((round + cookie) as u8, 64 * 1024));
            }
            sent(&mut core);
            let mut offset = 0;
            while offset < stream.len() {
                let end = (offset + 77_777).min(stream.len());
                offset += core.handle_received_bytes(&stream[offset..end]);
                while let Some(completion) = core.poll_completion().expect("valid") {
                    let expected = (round + completion.cookie) as u8;
                    assert!(completion.data.iter().all(|byte| *byte == expected));
                    completed += 1;
                }
            }
            stream.clear();
        }
        assert_eq!(completed, 320);
    }
}
