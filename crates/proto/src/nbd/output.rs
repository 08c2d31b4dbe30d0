//! Bytes a handshake state machine has produced and the caller has not sent yet, shared by the
//! server side ([`super::Handshake`]) and the client side ([`super::ClientHandshake`]): the
//! caller sends from [`OutputBuffer::pending`] and reports what went out with
//! [`OutputBuffer::consume`], so a partial send never loses or repeats a byte.

#[derive(Debug)]
pub(crate) struct OutputBuffer {
    bytes: Vec<u8>,
    sent_bytes: usize,
}

impl OutputBuffer {
    pub(crate) fn with_capacity(capacity_bytes: usize) -> OutputBuffer {
        OutputBuffer {
            bytes: Vec::with_capacity(capacity_bytes),
            sent_bytes: 0,
        }
    }

    pub(crate) fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    /// Bytes produced so far and not yet released by a complete send.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes waiting to be sent.
    pub(crate) fn pending(&self) -> &[u8] {
        self.bytes.get(self.sent_bytes..).unwrap_or_default()
    }

    /// Marks `count` bytes of [`pending`](Self::pending) as sent.
    pub(crate) fn consume(&mut self, count: usize) {
        assert!(
            count <= self.pending().len(),
            "consumed more output than was pending"
        );
        self.sent_bytes += count;
        if self.sent_bytes == self.bytes.len() {
            self.bytes.clear();
            self.sent_bytes = 0;
        }
    }
}
