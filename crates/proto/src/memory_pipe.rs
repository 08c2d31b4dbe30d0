//! The transport an OpenSSL session runs over when the caller moves the bytes itself (the
//! dataplane's TLS-PSK sessions, the client library's, the fuzz script's): ciphertext the
//! caller received goes in, ciphertext to send comes out. Reading an empty pipe is
//! `WouldBlock`, which OpenSSL turns into "want read"; writing never blocks.

use std::io::{ErrorKind, Read, Write};

#[derive(Debug, Default)]
pub struct MemoryPipe {
    input: Vec<u8>,
    input_read: usize,
    output: Vec<u8>,
}

impl MemoryPipe {
    /// Ciphertext received from the peer, for the session to read.
    pub fn push_input(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
    }

    /// Ciphertext the session wrote and nobody took yet.
    pub fn output(&self) -> &[u8] {
        &self.output
    }

    /// The first `n` bytes of the output left.
    pub fn consume_output(&mut self, n: usize) {
        self.output.drain(..n);
    }

    /// Moves all the output to the end of `out`.
    pub fn take_output(&mut self, out: &mut Vec<u8>) {
        out.append(&mut self.output);
    }
}

impl Read for MemoryPipe {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let pending = &self.input[self.input_read..];
        if pending.is_empty() {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = pending.len().min(buffer.len());
        buffer[..n].copy_from_slice(&pending[..n]);
        self.input_read += n;
        if self.input_read == self.input.len() {
            self.input.clear();
            self.input_read = 0;
        }
        Ok(n)
    }
}

impl Write for MemoryPipe {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pass_in_order_and_an_empty_pipe_would_block() {
        let mut pipe = MemoryPipe::default();
        let mut buffer = [0u8; 4];
        assert_eq!(
            pipe.read(&mut buffer).unwrap_err().kind(),
            ErrorKind::WouldBlock
        );
        pipe.push_input(b"abcdef");
        assert_eq!(pipe.read(&mut buffer).unwrap(), 4);
        assert_eq!(&buffer, b"abcd");
        assert_eq!(pipe.read(&mut buffer).unwrap(), 2);
        assert_eq!(&buffer[..2], b"ef");
        pipe.write_all(b"xyz").unwrap();
        pipe.consume_output(1);
        let mut out = Vec::new();
        pipe.take_output(&mut out);
        assert_eq!(out, b"yz");
        assert!(pipe.output().is_empty());
    }
}
