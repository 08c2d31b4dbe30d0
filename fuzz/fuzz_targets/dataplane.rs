//! The whole server under arbitrary clients: the input is an operation script
//! (`reflex_fuzz::script`: connections on native, original and NBD listeners, raw bytes and
//! mutated valid requests, virtual time, reads, closes, resets, shutdown) run against the real
//! dataplane threads and control plane of a `reflex_sim::VirtualServer`, then a graceful
//! shutdown whose end state is checked. Any panic is a finding; replay one with
//! `SCRIPT_FILE=… cargo test --release -p reflex-sim --test dataplane_script replay`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        // Every run allocates and frees each thread's buffer arena (1 or 2 MiB): keep that
        // memory in the heap instead of mapping and faulting it in again each time (glibc
        // only; ignored under AddressSanitizer, whose allocator does its own).
        // SAFETY: mallopt only sets allocator parameters; called before any fuzzing thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    },
    |data: &[u8]| {
        reflex_fuzz::script::run_bytes(data);
    }
);
