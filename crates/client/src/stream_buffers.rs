//! The transmit and receive buffers of one stream connection, sans-IO, lent to the driver one
//! operation at a time.
//!
//! Why its own type: every protocol core over a byte stream (the native [`ConnectionCore`]
//! here, the NBD core of `reflex bench`) needs the same buffer handling, and the hard part is
//! the lend/return contract with an io_uring loop. A send or receive handed to the kernel owns
//! its bytes until the completion arrives, so this type lends at most one send
//! ([`StreamBuffers::transmit_start`] … [`StreamBuffers::transmit_done`]) and at most one
//! receive ([`StreamBuffers::receive_start`] … [`StreamBuffers::receive_done`]) at a time, and
//! never moves, grows, compacts or shrinks a buffer while it is lent. Growth happens only in
//! [`StreamBuffers::reserve`] (nothing lent) or [`StreamBuffers::make_room`], which refuses with
//! [`BuffersBusy`] instead of moving a lent buffer; a protocol core calls `make_room` before
//! encoding a frame and maps the refusal to its own error.
//!
//! Layout: the transmit buffer holds frames appended at its end, of which the first
//! `transmit_sent_bytes` are sent; sent bytes are dropped once everything is sent, or moved out
//! when at least half the buffer is sent. The receive buffer is always fully initialised, and
//! `receive_unread_start..receive_unread_end` holds bytes received but not yet taken by the
//! protocol core. Before lending receive space it compacts (moves the unread bytes to the
//! front) when less than the configured spare is free at the end, or when the frame at the
//! front, whose length only the protocol core can tell, would not fit where it starts.
//!
//! [`ConnectionCore`]: crate::ConnectionCore

/// A buffer would have to move while the kernel holds it; nothing changed. Retry after the
/// in-flight send or receive completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a buffer would have to move while the kernel holds it")]
pub struct BuffersBusy;

/// One connection's transmit and receive buffers. See the module doc for the lending contract.
#[derive(Debug)]
pub struct StreamBuffers {
    transmit: Vec<u8>,
    /// Bytes at the front of `transmit` already sent.
    transmit_sent_bytes: usize,
    transmit_in_flight: bool,
    /// Always fully initialised; `receive_unread_start..receive_unread_end` is unread.
    receive: Vec<u8>,
    receive_unread_start: usize,
    receive_unread_end: usize,
    receive_in_flight: bool,
    /// Below this much free space at the end, `receive_start` compacts first.
    receive_spare_min_bytes: usize,
}

impl StreamBuffers {
    /// Buffers with room for `transmit_capacity_bytes` of frames and a `receive_bytes` receive
    /// buffer that compacts when less than `receive_spare_min_bytes` is free at its end.
    pub fn new(
        transmit_capacity_bytes: usize,
        receive_bytes: usize,
        receive_spare_min_bytes: usize,
    ) -> StreamBuffers {
        // A zero spare would never compact a full buffer whose front frame is incomplete.
        assert!(receive_spare_min_bytes > 0);
        assert!(receive_spare_min_bytes < receive_bytes);
        StreamBuffers {
            transmit: Vec::with_capacity(transmit_capacity_bytes),
            transmit_sent_bytes: 0,
            transmit_in_flight: false,
            receive: vec![0; receive_bytes],
            receive_unread_start: 0,
            receive_unread_end: 0,
            receive_in_flight: false,
            receive_spare_min_bytes,
        }
    }

    // ----- getters -----

    /// Bytes appended but not yet reported sent by `transmit_done`.
    #[inline]
    pub fn transmit_pending_bytes(&self) -> usize {
        self.transmit.len() - self.transmit_sent_bytes
    }

    #[inline]
    pub fn transmit_in_flight(&self) -> bool {
        self.transmit_in_flight
    }

    #[inline]
    pub fn receive_in_flight(&self) -> bool {
        self.receive_in_flight
    }

    /// Bytes received and not yet taken: the protocol core parses frames from here.
    #[inline]
    pub fn received(&self) -> &[u8] {
        &self.receive[self.receive_unread_start..self.receive_unread_end]
    }

    /// Size of the receive buffer: the largest frame it can hold.
    pub fn receive_buffer_bytes(&self) -> usize {
        self.receive.len()
    }

    // ----- growth -----

    /// Grows, while nothing is lent, to at least `transmit_capacity_bytes` of transmit capacity
    /// and a `receive_bytes` receive buffer, so an event loop never meets [`BuffersBusy`].
    pub fn reserve(&mut self, transmit_capacity_bytes: usize, receive_bytes: usize) {
        assert!(!self.transmit_in_flight);
        assert!(!self.receive_in_flight);
        if self.transmit.capacity() < transmit_capacity_bytes {
            self.transmit
                .reserve(transmit_capacity_bytes - self.transmit.len());
        }
        if self.receive.len() < receive_bytes {
            self.receive.resize(receive_bytes, 0);
        }
    }

    /// Makes room for one more frame of `frame_bytes` to send and a receive buffer of at least
    /// `receive_bytes`. Refuses, changing nothing, when that would move a lent buffer.
    pub fn make_room(
        &mut self,
        frame_bytes: usize,
        receive_bytes: usize,
    ) -> Result<(), BuffersBusy> {
        let transmit_fits = self.transmit.len() + frame_bytes <= self.transmit.capacity();
        let receive_fits = receive_bytes <= self.receive.len();
        if !transmit_fits && self.transmit_in_flight {
            return Err(BuffersBusy);
        }
        if !receive_fits && self.receive_in_flight {
            return Err(BuffersBusy);
        }
        if !transmit_fits {
            self.compact_transmit();
            self.transmit.reserve(frame_bytes);
        }
        if !receive_fits {
            self.receive.resize(receive_bytes, 0);
        }
        Ok(())
    }

    // ----- output -----

    /// Appends a frame: `header`, then `payload_bytes` that `fill` writes in place (it gets a
    /// zeroed slice of exactly that length). Room must have been made by `make_room` or
    /// `reserve`: appending never moves the buffer, even while a send is in flight.
    #[inline]
    pub fn push_frame(
        &mut self,
        header: &[u8],
        payload_bytes: usize,
        fill: impl FnOnce(&mut [u8]),
    ) {
        let frame_bytes = header.len() + payload_bytes;
        assert!(self.transmit.len() + frame_bytes <= self.transmit.capacity());
        self.transmit.extend_from_slice(header);
        if payload_bytes > 0 {
            let payload_start = self.transmit.len();
            self.transmit.resize(payload_start + payload_bytes, 0);
            fill(&mut self.transmit[payload_start..]);
        }
    }

    /// Lends the unsent bytes for one send; `None` when there are none or a send is already
    /// in flight. Must be followed by exactly one [`StreamBuffers::transmit_done`].
    #[inline]
    pub fn transmit_start(&mut self) -> Option<&[u8]> {
        if self.transmit_in_flight || self.transmit_pending_bytes() == 0 {
            return None;
        }
        self.transmit_in_flight = true;
        Some(&self.transmit[self.transmit_sent_bytes..])
    }

    /// `sent_bytes` of the lent bytes were sent (0 after a failed send).
    #[inline]
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

    fn compact_transmit(&mut self) {
        assert!(!self.transmit_in_flight);
        if self.transmit_sent_bytes > 0 {
            self.transmit.drain(..self.transmit_sent_bytes);
            self.transmit_sent_bytes = 0;
        }
    }

    // ----- input -----

    /// Lends free receive space for one receive; `None` when a receive is in flight or the
    /// buffer is full of unread bytes (take frames first). `front_frame_bytes` tells, from the
    /// unread bytes, the whole length of the frame at the front once its header has arrived
    /// (`None` before that or when the header is invalid). Must be followed by exactly one
    /// [`StreamBuffers::receive_done`].
    pub fn receive_start(
        &mut self,
        front_frame_bytes: impl FnOnce(&[u8]) -> Option<usize>,
    ) -> Option<&mut [u8]> {
        if self.receive_in_flight {
            return None;
        }
        self.compact_receive(front_frame_bytes);
        if self.receive_unread_end == self.receive.len() {
            return None;
        }
        self.receive_in_flight = true;
        Some(&mut self.receive[self.receive_unread_end..])
    }

    /// `received_bytes` arrived in the lent space (0 after a failed receive).
    #[inline]
    pub fn receive_done(&mut self, received_bytes: usize) {
        assert!(self.receive_in_flight);
        assert!(received_bytes <= self.receive.len() - self.receive_unread_end);
        self.receive_in_flight = false;
        self.receive_unread_end += received_bytes;
    }

    /// Copies bytes in, as a receive would (for drivers that own their buffers, and tests);
    /// returns how many were taken, fewer than offered only when the buffer is full.
    pub fn receive_copy(
        &mut self,
        bytes: &[u8],
        front_frame_bytes: impl FnOnce(&[u8]) -> Option<usize>,
    ) -> usize {
        let Some(space) = self.receive_start(front_frame_bytes) else {
            return 0;
        };
        let taken = space.len().min(bytes.len());
        space[..taken].copy_from_slice(&bytes[..taken]);
        self.receive_done(taken);
        taken
    }

    /// Takes the first `bytes` unread bytes (a whole frame) and returns them; they stay valid
    /// until the next `receive_start`.
    #[inline]
    pub fn take_received(&mut self, bytes: usize) -> &[u8] {
        assert!(bytes <= self.receive_unread_end - self.receive_unread_start);
        let start = self.receive_unread_start;
        self.receive_unread_start += bytes;
        &self.receive[start..self.receive_unread_start]
    }

    fn compact_receive(&mut self, front_frame_bytes: impl FnOnce(&[u8]) -> Option<usize>) {
        assert!(!self.receive_in_flight);
        if self.receive_unread_start == self.receive_unread_end {
            self.receive_unread_start = 0;
            self.receive_unread_end = 0;
            return;
        }
        if self.receive_unread_start == 0 {
            return;
        }
        let spare_bytes = self.receive.len() - self.receive_unread_end;
        // A frame whose header has arrived may need more room than is left.
        let frame_fits = || {
            let frame_bytes = front_frame_bytes(self.received()).unwrap_or(0);
            self.receive_unread_start + frame_bytes <= self.receive.len()
        };
        if spare_bytes < self.receive_spare_min_bytes || !frame_fits() {
            self.receive
                .copy_within(self.receive_unread_start..self.receive_unread_end, 0);
            self.receive_unread_end -= self.receive_unread_start;
            self.receive_unread_start = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy framing for the tests: one length byte, then that many bytes.
    fn front_frame_bytes(unread: &[u8]) -> Option<usize> {
        unread.first().map(|length| 1 + usize::from(*length))
    }

    fn small_buffers() -> StreamBuffers {
        StreamBuffers::new(64, 32, 8)
    }

    #[test]
    fn a_partial_send_lends_the_rest_next_time() {
        let mut buffers = small_buffers();
        buffers.push_frame(&[1, 2, 3], 5, |payload| payload.fill(9));
        assert_eq!(buffers.transmit_pending_bytes(), 8);
        assert_eq!(
            buffers.transmit_start(),
            Some(&[1, 2, 3, 9, 9, 9, 9, 9][..])
        );
        buffers.transmit_done(2);
        assert!(!buffers.transmit_in_flight());
        assert_eq!(buffers.transmit_pending_bytes(), 6);
        buffers.push_frame(&[4], 0, |_| {});
        assert_eq!(buffers.transmit_start(), Some(&[3, 9, 9, 9, 9, 9, 4][..]));
        buffers.transmit_done(0);
        assert_eq!(
            buffers.transmit_pending_bytes(),
            7,
            "a failed send sends nothing"
        );
        let all = buffers.transmit_start().map(<[u8]>::len);
        assert_eq!(all, Some(7));
        buffers.transmit_done(7);
        assert_eq!(buffers.transmit_pending_bytes(), 0);
        assert_eq!(buffers.transmit_start(), None, "nothing to send");
    }

    #[test]
    fn sent_bytes_are_compacted_once_half_the_buffer_is_sent() {
        let mut buffers = small_buffers();
        buffers.push_frame(&[0; 10], 0, |_| {});
        buffers.transmit_start();
        buffers.transmit_done(6);
        // 6 of 10 sent: moved out, so a full-capacity frame fits after the 4 left.
        assert!(buffers.make_room(60, 0).is_ok());
        let capacity = buffers.transmit.capacity();
        buffers.push_frame(&[1; 60], 0, |_| {});
        assert_eq!(buffers.transmit.capacity(), capacity, "no growth");
        assert_eq!(buffers.transmit_pending_bytes(), 64);
    }

    #[test]
    fn a_lent_buffer_is_never_moved_and_the_refusal_changes_nothing() {
        let mut buffers = small_buffers();
        buffers.push_frame(&[7; 40], 0, |_| {});
        let lent = buffers.transmit_start().map(<[u8]>::as_ptr);
        assert!(lent.is_some());
        assert_eq!(buffers.make_room(30, 0), Err(BuffersBusy));
        assert_eq!(
            buffers.transmit_pending_bytes(),
            40,
            "the refusal changed nothing"
        );
        // Appending within capacity while lent is allowed and does not move the buffer.
        assert!(buffers.make_room(20, 0).is_ok());
        buffers.push_frame(&[8; 20], 0, |_| {});
        assert_eq!(Some(buffers.transmit.as_ptr()), lent);
        buffers.transmit_done(40);
        assert!(buffers.make_room(50, 0).is_ok(), "grows once returned");

        let space = buffers
            .receive_start(front_frame_bytes)
            .map(|space| space.len());
        assert_eq!(space, Some(32));
        assert_eq!(buffers.make_room(0, 64), Err(BuffersBusy));
        assert_eq!(buffers.receive_buffer_bytes(), 32);
        buffers.receive_done(0);
        assert!(buffers.make_room(0, 64).is_ok());
        assert_eq!(buffers.receive_buffer_bytes(), 64);
    }

    #[test]
    fn lending_twice_is_refused() {
        let mut buffers = small_buffers();
        buffers.push_frame(&[1, 2], 0, |_| {});
        assert!(buffers.transmit_start().is_some());
        assert!(buffers.transmit_in_flight());
        assert_eq!(buffers.transmit_start(), None);
        assert!(buffers.receive_start(front_frame_bytes).is_some());
        assert!(buffers.receive_in_flight());
        assert!(buffers.receive_start(front_frame_bytes).is_none());
        assert_eq!(
            buffers.receive_copy(&[1, 2], front_frame_bytes),
            0,
            "no copy while lent"
        );
        buffers.receive_done(0);
        buffers.transmit_done(2);
        assert!(buffers.receive_start(front_frame_bytes).is_some());
    }

    #[test]
    fn a_full_receive_buffer_lends_nothing_until_a_frame_is_taken() {
        let mut buffers = small_buffers();
        let stream: Vec<u8> = [[3u8, 1, 2, 3]; 10].concat();
        assert_eq!(buffers.receive_copy(&stream, front_frame_bytes), 32);
        assert_eq!(buffers.receive_start(front_frame_bytes), None, "full");
        assert_eq!(buffers.take_received(4), &[3, 1, 2, 3]);
        // 4 bytes free at the front, none at the end: compacted, then lent.
        assert_eq!(buffers.receive_copy(&stream[32..], front_frame_bytes), 4);
        assert_eq!(buffers.received().len(), 32);
        for _ in 0..8 {
            assert_eq!(buffers.take_received(4), &[3, 1, 2, 3]);
        }
        assert!(buffers.received().is_empty());
        // Everything taken: the next receive starts at the front again.
        let space = buffers
            .receive_start(front_frame_bytes)
            .map(|space| space.len());
        assert_eq!(space, Some(32));
        buffers.receive_done(0);
    }

    #[test]
    fn compaction_makes_room_for_a_frame_that_would_not_fit() {
        // A 2-byte frame, then the header of a 21-byte frame at offset 2: it ends at 23 and
        // 29 bytes are spare, so the unread bytes stay where they are.
        let mut buffers = small_buffers();
        assert_eq!(buffers.receive_copy(&[1, 0, 20], front_frame_bytes), 3);
        assert_eq!(buffers.take_received(2), &[1, 0]);
        let space = buffers
            .receive_start(front_frame_bytes)
            .map(|space| space.len());
        assert_eq!(space, Some(29), "not moved");
        buffers.receive_done(0);

        // A 10-byte frame, then the header of a 26-byte frame at offset 10: 20 bytes are
        // spare, but the frame would end at 36, so the unread bytes move to the front.
        let mut buffers = small_buffers();
        let stream = [vec![9; 10], vec![25, 1]].concat();
        assert_eq!(buffers.receive_copy(&stream, front_frame_bytes), 12);
        assert_eq!(buffers.take_received(10).len(), 10);
        let space = buffers
            .receive_start(front_frame_bytes)
            .map(|space| space.len());
        assert_eq!(space, Some(30), "moved to the front");
        buffers.receive_done(0);
        assert_eq!(buffers.received(), &[25, 1]);
        assert_eq!(buffers.receive_copy(&[7; 24], front_frame_bytes), 24);
        assert_eq!(buffers.take_received(26)[..3], [25, 1, 7]);
    }

    #[test]
    fn a_small_spare_at_the_end_compacts() {
        // 20 of 32 bytes taken, 6 unread, 6 spare (below the 8 minimum): moved.
        let mut buffers = small_buffers();
        let stream = [vec![19; 20], vec![3, 1, 2, 3, 0, 0]].concat();
        assert_eq!(buffers.receive_copy(&stream, front_frame_bytes), 26);
        assert_eq!(buffers.take_received(20).len(), 20);
        let space = buffers
            .receive_start(front_frame_bytes)
            .map(|space| space.len());
        assert_eq!(space, Some(26));
        buffers.receive_done(0);
        assert_eq!(buffers.take_received(4), &[3, 1, 2, 3]);
    }
}
