//! One NBD connection in transmission, without I/O: the bench engine's counterpart of the
//! native protocol's `reflex_client::ConnectionCore`.
//!
//! Why its own core: NBD simple replies carry no length, so the client must remember, per
//! cookie, whether a successful reply is followed by READ data and how much. Cookies are the
//! engine's slot indices (below the queue depth), so the outstanding table is a plain vector
//! indexed by cookie: a reply's cookie from the network is looked up with a bounds-checked
//! `get`, never trusted. Requests are encoded into one transmit buffer (so a loop iteration's
//! requests leave in one send) and replies are parsed in place from one receive buffer, READ
//! data borrowed without a copy. As with `ConnectionCore`, the driver lends the buffers to the
//! kernel (`transmit_start`/`transmit_done`, `receive_start`/`receive_done`), and the core never
//! moves a lent buffer: [`NbdCore::reserve`] sizes both up front. Any reply the client cannot
//! accept (bad magic, a structured reply, a cookie not outstanding) breaks the connection with
//! an [`NbdCoreError`], returned again on every later call.

use reflex_proto::nbd::{
    Errno, REQUEST_HEADER_SIZE, SIMPLE_REPLY_SIZE, SimpleReplyError, decode_simple_reply,
    read_request, write_request,
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
    transmit: Vec<u8>,
    transmit_sent_bytes: usize,
    transmit_in_flight: bool,
    /// Always initialised; `receive_start..receive_end` holds unparsed bytes.
    receive: Vec<u8>,
    receive_start: usize,
    receive_end: usize,
    receive_in_flight: bool,
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
            transmit: Vec::new(),
            transmit_sent_bytes: 0,
            transmit_in_flight: false,
            receive: vec![0; RECEIVE_BUFFER_MIN_BYTES],
            receive_start: 0,
            receive_end: 0,
            receive_in_flight: false,
            outstanding: Vec::new(),
            outstanding_count: 0,
            broken: None,
        }
    }

    #[cfg(test)]
    fn outstanding_count(&self) -> usize {
        self.outstanding_count
    }

    fn transmit_pending_bytes(&self) -> usize {
        self.transmit.len() - self.transmit_sent_bytes
    }

    /// Makes room, while nothing is lent, for cookies `0..requests` with payloads of up to
    /// `io_size_bytes`, so the buffers never grow during the run.
    pub fn reserve(&mut self, requests: usize, io_size_bytes: u32) {
        assert!(!self.transmit_in_flight && !self.receive_in_flight);
        if self.outstanding.len() < requests {
            self.outstanding.resize(requests, None);
        }
        let frame_bytes = REQUEST_HEADER_SIZE + io_size_bytes as usize;
        // Unsent frames of every request, plus as much again of sent bytes not yet compacted.
        let transmit_bytes = 2 * requests * frame_bytes;
        if self.transmit.capacity() < transmit_bytes {
            self.transmit.reserve(transmit_bytes - self.transmit.len());
        }
        let receive_bytes = (SIMPLE_REPLY_SIZE + io_size_bytes as usize + RECEIVE_SPARE_MIN_BYTES)
            .max(RECEIVE_BUFFER_MIN_BYTES);
        if self.receive.len() < receive_bytes {
            self.receive.resize(receive_bytes, 0);
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
        self.transmit
            .extend_from_slice(&read_request(cookie, offset_bytes, length_bytes));
        self.record(
            cookie,
            Outstanding {
                read_length_bytes: length_bytes,
            },
        );
        Ok(())
    }

    /// Queues a WRITE whose payload `fill` writes in place into the transmit buffer.
    pub fn submit_write_with(
        &mut self,
        cookie: u64,
        offset_bytes: u64,
        length_bytes: u32,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), NbdSubmitError> {
        self.admit(cookie, length_bytes, 0)?;
        self.transmit
            .extend_from_slice(&write_request(cookie, offset_bytes, length_bytes, 0));
        let payload_start = self.transmit.len();
        self.transmit
            .resize(payload_start + length_bytes as usize, 0);
        fill(&mut self.transmit[payload_start..]);
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
        let transmit_fits = self.transmit.len() + frame_bytes <= self.transmit.capacity();
        let receive_fits = receive_needed <= self.receive.len();
        if (!transmit_fits && self.transmit_in_flight) || (!receive_fits && self.receive_in_flight)
        {
            return Err(NbdSubmitError::BuffersBusy);
        }
        if !transmit_fits {
            self.compact_transmit();
            self.transmit.reserve(frame_bytes);
        }
        if !receive_fits {
            self.receive.resize(receive_needed, 0);
        }
        Ok(())
    }

    fn record(&mut self, cookie: u64, outstanding: Outstanding) {
        // `admit` checked that the slot exists and is free.
        let slot = &mut self.outstanding[cookie as usize];
        assert!(slot.is_none());
        *slot = Some(outstanding);
        self.outstanding_count += 1;
        debug_assert!(self.outstanding_count <= self.outstanding.len());
    }

    fn compact_transmit(&mut self) {
        assert!(!self.transmit_in_flight);
        if self.transmit_sent_bytes > 0 {
            self.transmit.drain(..self.transmit_sent_bytes);
            self.transmit_sent_bytes = 0;
        }
    }

    /// Lends the unsent bytes for one send; `None` when there are none or one is in flight.
    pub fn transmit_start(&mut self) -> Option<&[u8]> {
        if self.transmit_in_flight || self.transmit_pending_bytes() == 0 {
            return None;
        }
        self.transmit_in_flight = true;
        Some(&self.transmit[self.transmit_sent_bytes..])
    }

    /// `sent_bytes` of the lent bytes were sent (0 after a failed send).
    pub fn transmit_done(&mut self, sent_bytes: usize) {
        assert!(self.transmit_in_flight);
        assert!(sent_bytes <= self.transmit_pending_bytes());
        self.transmit_in_flight = false;
        self.transmit_sent_bytes += sent_bytes;
        if self.transmit_sent_bytes == self.transmit.len() {
            self.transmit.clear();
            self.transmit_sent_bytes = 0;
        } else if self.transmit_sent_bytes * 2 >= self.transmit.len() {
            self.compact_transmit();
        }
    }

    /// Lends free receive space for one receive; `None` when a receive is in flight or the
    /// buffer is full of complete replies (poll them first).
    pub fn receive_start(&mut self) -> Option<&mut [u8]> {
        if self.receive_in_flight {
            return None;
        }
        self.compact_receive();
        if self.receive_end == self.receive.len() {
            return None;
        }
        self.receive_in_flight = true;
        Some(&mut self.receive[self.receive_end..])
    }

    /// `received_bytes` arrived in the lent space (0 after a failed receive).
    pub fn receive_done(&mut self, received_bytes: usize) {
        assert!(self.receive_in_flight);
        assert!(received_bytes <= self.receive.len() - self.receive_end);
        self.receive_in_flight = false;
        self.receive_end += received_bytes;
    }

    /// Copies received bytes in (tests); returns how many were taken.
    #[cfg(test)]
    fn handle_received_bytes(&mut self, bytes: &[u8]) -> usize {
        let Some(space) = self.receive_start() else {
            return 0;
        };
        let taken = space.len().min(bytes.len());
        space[..taken].copy_from_slice(&bytes[..taken]);
        self.receive_done(taken);
        taken
    }

    fn compact_receive(&mut self) {
        assert!(!self.receive_in_flight);
        if self.receive_start == self.receive_end {
            self.receive_start = 0;
            self.receive_end = 0;
            return;
        }
        if self.receive_start == 0 {
            return;
        }
        // A READ reply whose header has arrived may need more room than is left.
        let frame_bytes = self.peek_frame_bytes().unwrap_or(0);
        let frame_fits = self.receive_start + frame_bytes <= self.receive.len();
        if self.receive.len() - self.receive_end < RECEIVE_SPARE_MIN_BYTES || !frame_fits {
            self.receive
                .copy_within(self.receive_start..self.receive_end, 0);
            self.receive_end -= self.receive_start;
            self.receive_start = 0;
        }
    }

    /// Length of the reply at the front (header plus READ data), if its header is valid.
    fn peek_frame_bytes(&self) -> Option<usize> {
        let buffered = &self.receive[self.receive_start..self.receive_end];
        let (reply, _) = decode_simple_reply(buffered).ok().flatten()?;
        let outstanding = self.lookup(reply.cookie)?;
        Some(frame_bytes(reply.error, outstanding))
    }

    fn lookup(&self, cookie: u64) -> Option<Outstanding> {
        usize::try_from(cookie)
            .ok()
            .and_then(|index| self.outstanding.get(index))
            .copied()
            .flatten()
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
        let buffered = &self.receive[self.receive_start..self.receive_end];
        let reply = match decode_simple_reply(buffered) {
            Ok(None) => return Ok(None),
            Ok(Some((reply, _))) => reply,
            Err(error) => return Err(self.break_with(error.into())),
        };
        let Some(outstanding) = self.lookup(reply.cookie) else {
            return Err(self.break_with(NbdCoreError::UnknownCookie(reply.cookie)));
        };
        let frame_bytes = frame_bytes(reply.error, outstanding);
        if buffered.len() < frame_bytes {
            return Ok(None);
        }
        // `lookup` found the slot, so the cookie is a valid index.
        self.outstanding[reply.cookie as usize] = None;
        self.outstanding_count -= 1;
        let data_start = self.receive_start + SIMPLE_REPLY_SIZE;
        let data_end = self.receive_start + frame_bytes;
        self.receive_start = data_end;
        Ok(Some(NbdCompletion {
            cookie: reply.cookie,
            error: reply.error,
            data: &self.receive[data_start..data_end],
        }))
    }
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
    use reflex_proto::nbd::{SimpleReply, decode_request};

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
        core.submit_write_with(1, 0, 512, |buf| buf.fill(0xab))
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
