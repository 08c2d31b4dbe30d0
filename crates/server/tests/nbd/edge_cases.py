# NBD edge cases that must reach the server, run by crates/server/tests/nbd_interop.rs as
# `nbdsh -n -c <this file's text>` with the parameters in the environment:
#   NBD_CHECK   read_past_end | write_read_only | opt_mode
#   NBD_URI     nbd://127.0.0.1:PORT/EXPORT
#   NBD_EXPORT  the export name (opt_mode)
#   NBD_SIZE    the export size in bytes (opt_mode)
#   NBD_ERRNO_READ_ONLY, NBD_ERRNO_WRITE_PAST_END   errno names the server should answer with
#   NBD_STRICT  "1" keeps libnbd's strict mode on: the negative control, where libnbd refuses
#               the bad requests itself and this script must notice and fail.
# Why strict mode matters: by default libnbd rejects out-of-range requests and writes to
# read-only exports before they are sent, so a check would pass without testing the server.
# An error the server sent says "command failed"; anything else came from libnbd.
# Prints "EDGE-CASES-OK <check>" last; the Rust side insists on it.

import errno
import os

import nbd

check = os.environ["NBD_CHECK"]
uri = os.environ["NBD_URI"]
strict = os.environ.get("NBD_STRICT") == "1"
BLOCK = 4096


def pattern(seed, length):
    return bytes((seed * 131 + i * 7 + (i >> 9)) & 0xFF for i in range(length))


def errno_named(variable):
    name = os.environ[variable]
    return getattr(errno, name)


def handle():
    h = nbd.NBD()
    if not strict:
        h.set_strict_mode(0)
    return h


def server_refuses(what, action, expected_errno):
    try:
        action()
    except nbd.Error as e:
        if "command failed" not in e.string:
            raise AssertionError(
                f"{what}: the error came from libnbd, not the server: {e.string}"
            )
        if e.errnum != expected_errno:
            raise AssertionError(
                f"{what}: server answered errno {e.errnum} ({e.string}), "
                f"want {expected_errno} ({errno.errorcode.get(expected_errno)})"
            )
        print(f"{what}: {e.string}")
        return
    raise AssertionError(f"{what}: succeeded, want errno {errno.errorcode.get(expected_errno)}")


def read_past_end():
    h = handle()
    h.connect_uri(uri)
    size = h.get_size()
    assert size >= 4 * BLOCK, size
    block = pattern(7, BLOCK)
    h.pwrite(block, 0)
    server_refuses("read at the end", lambda: h.pread(BLOCK, size), errno.EINVAL)
    server_refuses("read across the end", lambda: h.pread(BLOCK, size - 2048), errno.EINVAL)
    server_refuses(
        "read far past the end", lambda: h.pread(BLOCK, size + (1 << 40)), errno.EINVAL
    )
    server_refuses(
        "write across the end",
        lambda: h.pwrite(block, size - 2048),
        errno_named("NBD_ERRNO_WRITE_PAST_END"),
    )
    # The connection lives on: good requests still work and see the data written before.
    assert h.pread(BLOCK, 0) == block, "a good read after the errors returned other data"
    tail = pattern(9, BLOCK)
    h.pwrite(tail, size - BLOCK)
    assert h.pread(BLOCK, size - BLOCK) == tail, "the last block did not read back"
    h.shutdown()


def write_read_only():
    h = handle()
    h.connect_uri(uri)
    assert h.is_read_only(), "the export does not advertise READ_ONLY"
    before = h.pread(BLOCK, 0)
    expected = errno_named("NBD_ERRNO_READ_ONLY")
    server_refuses("write to a read-only export", lambda: h.pwrite(pattern(3, BLOCK), 0), expected)
    server_refuses("write zeroes to a read-only export", lambda: h.zero(BLOCK, 0), expected)
    server_refuses("trim on a read-only export", lambda: h.trim(BLOCK, 0), expected)
    assert h.pread(BLOCK, 0) == before, "a refused write changed the data"
    h.shutdown()


def opt_mode():
    export = os.environ["NBD_EXPORT"]
    size = int(os.environ["NBD_SIZE"])
    h = handle()
    h.set_opt_mode(True)
    h.connect_uri(uri)
    assert h.aio_is_negotiating(), "opt mode did not stop in the negotiation phase"
    names = []

    def listed(name, description):
        names.append(name)
        return 0

    h.opt_list(listed)
    assert export in names, f"LIST gave {names}, missing {export!r}"
    h.set_export_name("no-such-export-" + export)
    try:
        h.opt_info()
    except nbd.Error as e:
        print(f"INFO on an unknown export: {e.string}")
    else:
        raise AssertionError("INFO on an unknown export succeeded")
    assert h.aio_is_negotiating(), "the failed INFO ended the negotiation"
    h.set_export_name(export)
    h.opt_info()
    assert h.get_size() == size, f"INFO size {h.get_size()}, want {size}"
    h.opt_go()
    assert h.aio_is_ready(), "GO did not start the transmission phase"
    assert len(h.pread(BLOCK, 0)) == BLOCK
    h.shutdown()


{"read_past_end": read_past_end, "write_read_only": write_read_only, "opt_mode": opt_mode}[check]()
print(f"EDGE-CASES-OK {check}")
