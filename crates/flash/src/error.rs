//! Device errors. Each maps to a wire status in the protocol front ends.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FlashError {
    /// The device (or the kernel on its behalf) failed the operation; errno when known.
    #[error("I/O error (errno {errno})")]
    Io { errno: i32 },
    /// The device does not implement the operation (e.g. TRIM on a device without discard).
    #[error("operation not supported by this device")]
    Unsupported,
    /// A backend specification or configuration that cannot be opened.
    #[error("cannot open backend {spec:?}: {reason}")]
    Open { spec: String, reason: String },
}
