//! Quality of service for ReFlex: request costs, device profiles, the token scheduler and
//! admission control. Pure: no I/O, no clock; time comes in as [`Nanos`].
#![forbid(unsafe_code)]

pub mod profile;
pub mod time;

pub use profile::{DeviceProfile, TokenLimit};
pub use time::Nanos;
