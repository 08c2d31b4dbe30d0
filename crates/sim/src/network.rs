//! The virtual network: each direction of a simulated TCP connection is a [`Pipe`] that
//! delivers bytes in order, each send arriving one latency (plus its serialisation at the
//! link's bandwidth) after it was sent.

use std::collections::VecDeque;

use reflex_qos::Nanos;

/// Latency and bandwidth of every simulated connection (both directions alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetworkModel {
    /// One-way delay of every send.
    pub latency: Nanos,
    /// Bytes per second of each direction of each connection; 0: unlimited.
    pub bytes_per_sec: u64,
    /// Bytes a client's socket holds that it has not read (in flight plus received): when it
    /// is full, the server's sends wait. A client that never reads fills it.
    pub client_buffer_bytes: usize,
}

impl Default for NetworkModel {
    fn default() -> NetworkModel {
        NetworkModel {
            latency: Nanos::ZERO,
            bytes_per_sec: 0,
            client_buffer_bytes: 4 << 20,
        }
    }
}

/// One direction of a connection.
#[derive(Debug, Default)]
pub struct Pipe {
    /// Sends on their way: when each arrives, and its bytes.
    in_flight: VecDeque<(Nanos, Vec<u8>)>,
    in_flight_bytes: usize,
    /// When the link has finished putting the last send on the wire (sends serialise one
    /// after the other).
    link_free_at: Nanos,
    /// Arrived and not yet read.
    arrived: VecDeque<u8>,
}

impl Pipe {
    /// Sends `bytes` at `now`.
    pub fn send(&mut self, now: Nanos, bytes: &[u8], model: &NetworkModel) {
        if bytes.is_empty() {
            return;
        }
        let serialisation = match model.bytes_per_sec {
            0 => 0,
            rate => (bytes.len() as u128 * 1_000_000_000 / u128::from(rate)) as u64,
        };
        self.link_free_at = now.max(self.link_free_at) + Nanos(serialisation);
        let arrival = self.link_free_at + model.latency;
        self.in_flight_bytes += bytes.len();
        self.in_flight.push_back((arrival, bytes.to_vec()));
    }

    /// Moves what has arrived by `now` to the readable end; returns whether anything did.
    pub fn deliver(&mut self, now: Nanos) -> bool {
        let mut any = false;
        while let Some((arrival, _)) = self.in_flight.front() {
            if *arrival > now {
                break;
            }
            let Some((_, bytes)) = self.in_flight.pop_front() else {
                break;
            };
            self.in_flight_bytes -= bytes.len();
            self.arrived.extend(bytes);
            any = true;
        }
        any
    }

    /// When the next send in flight arrives.
    pub fn next_arrival(&self) -> Option<Nanos> {
        self.in_flight.front().map(|(arrival, _)| *arrival)
    }

    /// Bytes arrived and not yet read.
    pub fn readable_bytes(&self) -> usize {
        self.arrived.len()
    }

    /// Bytes sent and not yet read (in flight and arrived).
    pub fn unread_bytes(&self) -> usize {
        self.in_flight_bytes + self.arrived.len()
    }

    /// Reads up to `out.len()` arrived bytes into `out`; returns how many.
    pub fn read(&mut self, out: &mut [u8]) -> usize {
        let count = out.len().min(self.arrived.len());
        // Whole slices, not byte by byte: fuzzing instruments every byte loop.
        let (front, back) = self.arrived.as_slices();
        let from_front = count.min(front.len());
        out[..from_front].copy_from_slice(&front[..from_front]);
        out[from_front..count].copy_from_slice(&back[..count - from_front]);
        self.arrived.drain(..count);
        count
    }

    /// Reads everything that has arrived, appending it to `out`.
    pub fn read_all(&mut self, out: &mut Vec<u8>) {
        let (front, back) = self.arrived.as_slices();
        out.extend_from_slice(front);
        out.extend_from_slice(back);
        self.arrived.clear();
    }

    /// Whether nothing is in flight or waiting to be read.
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty() && self.arrived.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_arrive_in_order_after_latency_and_serialisation() {
        let model = NetworkModel {
            latency: Nanos(1_000),
            bytes_per_sec: 1_000_000_000,
            ..NetworkModel::default()
        };
        let mut pipe = Pipe::default();
        pipe.send(Nanos(0), &[1; 500], &model);
        pipe.send(Nanos(100), &[2; 10], &model);
        assert_eq!(pipe.next_arrival(), Some(Nanos(1_500)));
        assert!(!pipe.deliver(Nanos(1_499)));
        assert!(pipe.deliver(Nanos(1_500)));
        assert_eq!(pipe.readable_bytes(), 500);
        assert_eq!(pipe.unread_bytes(), 510);
        let mut out = [0u8; 600];
        assert_eq!(pipe.read(&mut out), 500);
        assert!(pipe.deliver(Nanos(2_000)));
        let mut rest = Vec::new();
        pipe.read_all(&mut rest);
        assert_eq!(rest, vec![2; 10]);
        assert!(pipe.is_empty());
    }
}
