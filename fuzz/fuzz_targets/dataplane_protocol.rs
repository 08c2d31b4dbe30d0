//! The whole server under well-formed clients: the same operation scripts as the `dataplane`
//! target (`reflex_fuzz::script`), run in `Mode::WellFormed`: valid framing, whole payloads,
//! unique request ids, the NBD handshake done by the client codec, timing faults only; what
//! is fuzzed is timing and ordering (threads, limits, back-pressure, delays, stalls, virtual
//! time). Beyond the `dataplane` checks, every request must get exactly one answer.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        // See the `dataplane` target: keep each run's arena allocations in the heap.
        // SAFETY: mallopt only sets allocator parameters; called before any fuzzing thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    },
    |data: &[u8]| {
        reflex_fuzz::script::run_well_formed_bytes(data);
    }
);
