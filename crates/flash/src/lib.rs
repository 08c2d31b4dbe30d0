//! Storage devices behind one contract ([`Device`] / [`DeviceQueue`]): files and block
//! devices, memory, null, the emulated Flash device, and a fault-injecting wrapper around any
//! of them ([`fault`]).
//!
//! Architecture invariant: devices prepare work for the dataplane thread's ring or finish it
//! synchronously; they never start threads or loops of their own on the data path. The one
//! exception is a file device asked for a queue without a ring
//! ([`Device::queue_without_ring`], the epoll driver's): its I/O then runs on a small,
//! bounded thread pool ([`pool`]) that owns no dataplane state.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod aligned;
pub mod calibrate;
pub mod device;
pub mod emu;
pub mod error;
// Fault injection wraps any device; it needs no io_uring, so the simulator can use it.
pub mod fault;
/// Files and block devices are driven through io_uring entries: only with the `uring` feature.
#[cfg(feature = "uring")]
pub mod file;
pub mod mem;
pub mod null;
// Reference-counted blocks lent to sends: the `mem` device's memory.
#[allow(unsafe_code)]
pub mod pages;
// Ring-less file I/O on a thread pool (with `aligned`, where the crate's `unsafe` code lives,
// besides the calls of the unsafe `Device::queue_without_ring`).
#[cfg(feature = "uring")]
#[allow(unsafe_code)]
pub mod pool;
pub mod queueing;
pub mod size;
// Opening devices from specs needs the file device, hence the `uring` feature.
#[cfg(feature = "uring")]
pub mod spec;

pub use device::{
    Allocation, Completion, Device, DeviceInfo, DeviceOp, DeviceQueue, Extent, Notify, OpKind,
    Submit, push_extent,
};
pub use error::FlashError;
pub use fault::{FaultControls, FaultDevice, FaultPlan};
pub use pages::Lent;
