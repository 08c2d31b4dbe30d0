//! Placeholder (dataplane helper).
