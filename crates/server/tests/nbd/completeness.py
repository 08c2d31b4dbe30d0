# NBD completeness checks with libnbd, run by crates/server/tests/nbd_interop.rs as
# `nbdsh -n -c <this file's text>` with the parameters in the environment:
#   NBD_CHECK   large | unaligned | cache_fast_zero
#   NBD_URI     nbd://127.0.0.1:PORT/EXPORT (a writable export of at least 48 MiB)
#   NBD_FAST_ZERO_WRITES  "refused" when a fast zero that needs writes must fail (reflexd)
# Every handle is opened WITHOUT asking for the block sizes (set_request_block_size(False)),
# like a client that never agreed to any: the server must then serve 32 MiB requests and any
# byte range (the spec's defaults). Strict mode is off, so libnbd sends what it is asked to and
# the answers come from the server; an error the server sent says "command failed".
# Prints "COMPLETENESS-OK <check>" last; the Rust side insists on it.

import errno
import os
import random

import nbd

check = os.environ["NBD_CHECK"]
uri = os.environ["NBD_URI"]
MIB = 1 << 20


def handle(structured=True):
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.set_request_block_size(False)
    h.set_request_structured_replies(structured)
    h.connect_uri(uri)
    assert h.get_structured_replies_negotiated() == structured
    return h


def first_difference(a, b):
    if len(a) != len(b):
        return min(len(a), len(b))
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None


def same(what, got, want):
    if bytes(got) == bytes(want):
        return
    at = first_difference(got, want)
    raise AssertionError(f"{what}: differs at byte {at} of {len(want)}")


def server_refuses(what, action, expected_errno):
    try:
        action()
    except nbd.Error as e:
        if "command failed" not in e.string:
            raise AssertionError(f"{what}: the error came from libnbd, not the server: {e.string}")
        if e.errnum != expected_errno:
            raise AssertionError(
                f"{what}: server answered errno {e.errnum} ({e.string}), "
                f"want {errno.errorcode.get(expected_errno)}"
            )
        print(f"{what}: {e.string}")
        return
    raise AssertionError(f"{what}: succeeded, want {errno.errorcode.get(expected_errno)}")


def large():
    # 32 MiB at an unaligned offset, with simple and with structured replies, checked against
    # the copy written.
    for structured in (False, True):
        h = handle(structured)
        # 0: not advertised, so the spec's defaults (32 MiB) apply.
        maximum = h.get_block_size(nbd.SIZE_MAXIMUM)
        assert maximum == 0 or maximum >= 32 * MIB, maximum
        data = os.urandom(32 * MIB)
        offset = 5 * MIB + 3 + structured
        h.pwrite(data, offset)
        same(f"32 MiB read, structured={structured}", h.pread(32 * MIB, offset), data)
        if structured:
            chunks = []

            def chunk(subbuf, chunk_offset, status, error):
                chunks.append((chunk_offset, len(subbuf)))
                return 0

            back = h.pread_structured(32 * MIB, offset, chunk)
            same("32 MiB structured read", back, data)
            covered = sum(length for _, length in chunks)
            assert covered == 32 * MIB, f"chunks cover {covered}"
            print(f"32 MiB structured READ came in {len(chunks)} chunks")
        h.shutdown()


def unaligned():
    # Byte ranges at random offsets and lengths, against a local model of the region.
    rng = random.Random(20261123)
    base, region = 1 * MIB + 17, 4 * MIB
    for structured in (False, True):
        h = handle(structured)
        model = bytearray(h.pread(region, base))
        for step in range(400):
            length = rng.randint(1, 200_000 if step % 10 == 0 else 5000)
            at = rng.randrange(0, region - length)
            if step % 2 == 0:
                data = os.urandom(length)
                h.pwrite(data, base + at)
                model[at : at + length] = data
            else:
                same(f"read {base + at}+{length}", h.pread(length, base + at), model[at : at + length])
        # Pipelined: many unaligned writes in flight at once, to disjoint ranges that share
        # sectors (a few bytes apart).
        commands = []
        for index in range(64):
            at = index * 700 + rng.randrange(0, 300)
            data = os.urandom(rng.randint(1, 400))
            model[at : at + len(data)] = data
            commands.append(h.aio_pwrite(data, base + at))
        while h.aio_in_flight() > 0:
            h.poll(-1)
        for cookie in commands:
            # Raises if the server failed the write.
            assert h.aio_command_completed(cookie), f"write {cookie} not completed"
        same("after pipelined writes", h.pread(region, base), model)
        h.shutdown()


def cache_fast_zero():
    # NBD_FAST_ZERO_WRITES=refused: the server must refuse (ENOTSUP) a fast zero that would
    # need writes (NO_HOLE, unaligned edges), as reflexd does; otherwise a server may also
    # zero such ranges quickly (nbdkit memory, qemu-nbd with ZERO_RANGE) and succeed.
    refused_required = os.environ.get("NBD_FAST_ZERO_WRITES") == "refused"
    h = handle()
    assert h.can_cache(), "CACHE not advertised"
    h.cache(MIB, 0)
    data = os.urandom(256 * 1024)
    h.pwrite(data, 0)
    model = bytearray(data)
    fast = nbd.CMD_FLAG_FAST_ZERO
    fast_zeroes = [
        ("fast zero with NO_HOLE", 65536, 65536, fast | nbd.CMD_FLAG_NO_HOLE),
        ("unaligned fast zero", 4096, 131073, fast),
    ]
    if h.can_fast_zero():
        # A discard is fast: it succeeds.
        h.zero(65536, 0, nbd.CMD_FLAG_FAST_ZERO)
        model[:65536] = bytes(65536)
    else:
        assert not refused_required, "FAST_ZERO not advertised"
        print("FAST_ZERO not advertised by this server: not tried")
        fast_zeroes = []
    for what, length, offset, flags in fast_zeroes:
        try:
            h.zero(length, offset, flags)
        except nbd.Error as e:
            if "command failed" not in e.string or e.errnum != errno.ENOTSUP:
                raise AssertionError(f"{what}: {e.string} (errno {e.errnum}), want ENOTSUP")
            print(f"{what}: {e.string}")
            continue
        if refused_required:
            raise AssertionError(f"{what}: succeeded, want ENOTSUP")
        model[offset : offset + length] = bytes(length)
    # A refused fast zero changed nothing.
    same("after fast zeroes", h.pread(len(model), 0), model)
    # Without FAST_ZERO the same requests zero exactly their bytes.
    h.zero(4096, 131073)
    model[131073 : 131073 + 4096] = bytes(4096)
    h.zero(65536, 65536, nbd.CMD_FLAG_NO_HOLE)
    model[65536:131072] = bytes(65536)
    same("after zeroes", h.pread(len(model), 0), model)
    h.shutdown()


{"large": large, "unaligned": unaligned, "cache_fast_zero": cache_fast_zero}[check]()
print(f"COMPLETENESS-OK {check}")
