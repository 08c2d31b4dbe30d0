//! Placeholder (emulated-device helper).
