//! The physical limit of the original ReFlex protocol on this machine (issue 10).
//!
//! `limit-server` ([`server`]) answers original-protocol reads from memory with the least work
//! one io_uring thread can do: no validation beyond the 24-byte header, no namespaces, no
//! scheduler, data straight from one static region. It is the yardstick for `reflexd`: the
//! ratio of reflexd's replies per server core-second to limit-server's, measured by
//! `bench/limit.sh` with the same client, says how much of the machine reflexd's own work
//! takes. `limit-client` ([`client`]) is that client: a closed-loop, one-thread io_uring load
//! generator for any original-protocol server.
//!
//! Invariants: `unsafe` lives in [`uring`] only, which owns every byte it lends the kernel;
//! [`wire`] is sans-IO and cannot panic on network bytes; every queue is bounded by a named
//! maximum, and both programs are bounded in time and connections.
#![deny(unsafe_code)]

pub mod client;
pub mod server;
pub mod units;
pub mod uring;
pub mod wire;
