//! The io_uring driver: the ring (`ring`, with the unsafe `push`) and the loop that runs a
//! [`reflex_dataplane::Dataplane`] over it (`driver`). With `sys`, the only code of
//! `reflex-server` that may use `unsafe`.

#![allow(unsafe_code)]

mod driver;
mod ring;

pub use driver::{RING_CQ_ENTRIES_MIN, UringDriver};
pub use ring::{MissingFeature, Ring};
