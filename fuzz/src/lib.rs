//! Shared code of the fuzz targets: the operation scripts the `dataplane` target runs against
//! the whole server ([`script`]). The regression tests in `crates/sim/tests/` include the same
//! module, so a crash input replays there on the stable toolchain.

pub mod script;
