//! Fixed-offset integer access for fixed-size headers, and a bounds-checked cursor for
//! variable-length bodies.
//!
//! Why: decoders run hundreds of thousands of times per second per core, and they read bytes
//! from the network. A header decoder checks the length once (`first_chunk::<N>()`), then reads
//! every field at a constant offset of a `&[u8; N]`; the offsets are checked against `N` at
//! compile time (`const { assert!(..) }`), so no read can panic and none needs a runtime bounds
//! check. Bodies of variable length use [`Cursor`], whose every read returns `Option`.

/// Read-only view of a fixed-size header.
#[derive(Clone, Copy)]
pub(crate) struct Fields<'a, const N: usize>(pub(crate) &'a [u8; N]);

/// Writable view of a fixed-size header.
pub(crate) struct FieldsMut<'a, const N: usize>(pub(crate) &'a mut [u8; N]);

macro_rules! field_readers {
    ($($get:ident, $ty:ty, $from:ident;)*) => {
        impl<const N: usize> Fields<'_, N> {
            $(
                #[inline(always)]
                pub(crate) fn $get<const AT: usize>(self) -> $ty {
                    const { assert!(AT + size_of::<$ty>() <= N) };
                    let mut bytes = [0u8; size_of::<$ty>()];
                    bytes.copy_from_slice(&self.0[AT..AT + size_of::<$ty>()]);
                    <$ty>::$from(bytes)
                }
            )*
        }
    };
}

macro_rules! field_writers {
    ($($put:ident, $ty:ty, $to:ident;)*) => {
        impl<const N: usize> FieldsMut<'_, N> {
            $(
                #[inline(always)]
                pub(crate) fn $put<const AT: usize>(&mut self, value: $ty) {
                    const { assert!(AT + size_of::<$ty>() <= N) };
                    self.0[AT..AT + size_of::<$ty>()].copy_from_slice(&value.$to());
                }
            )*
        }
    };
}

field_readers! {
    u8_at, u8, from_le_bytes;
    u16_le, u16, from_le_bytes;
    u32_le, u32, from_le_bytes;
    u64_le, u64, from_le_bytes;
    u16_be, u16, from_be_bytes;
    u32_be, u32, from_be_bytes;
    u64_be, u64, from_be_bytes;
}

field_writers! {
    put_u8, u8, to_le_bytes;
    put_u16_le, u16, to_le_bytes;
    put_u32_le, u32, to_le_bytes;
    put_u64_le, u64, to_le_bytes;
    put_u16_be, u16, to_be_bytes;
    put_u32_be, u32, to_be_bytes;
    put_u64_be, u64, to_be_bytes;
}

impl<const N: usize> Fields<'_, N> {
    /// `LEN` raw bytes at `AT`.
    #[inline(always)]
    pub(crate) fn bytes<const AT: usize, const LEN: usize>(self) -> [u8; LEN] {
        const { assert!(AT + LEN <= N) };
        let mut bytes = [0u8; LEN];
        bytes.copy_from_slice(&self.0[AT..AT + LEN]);
        bytes
    }
}

impl<const N: usize> FieldsMut<'_, N> {
    #[inline(always)]
    pub(crate) fn put_bytes<const AT: usize, const LEN: usize>(&mut self, value: &[u8; LEN]) {
        const { assert!(AT + LEN <= N) };
        self.0[AT..AT + LEN].copy_from_slice(value);
    }
}

/// A forward-only reader over a body whose total length is already known. Every read returns
/// `None` when the body is too short, so callers turn that into their own typed error.
pub(crate) struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Cursor<'a> {
        Cursor { rest: bytes }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.rest.len()
    }

    pub(crate) fn take(&mut self, count: usize) -> Option<&'a [u8]> {
        if count > self.rest.len() {
            return None;
        }
        let (head, tail) = self.rest.split_at(count);
        self.rest = tail;
        Some(head)
    }

    fn array<const LEN: usize>(&mut self) -> Option<[u8; LEN]> {
        let (head, tail) = self.rest.split_first_chunk::<LEN>()?;
        self.rest = tail;
        Some(*head)
    }

    pub(crate) fn u16_be(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32_be(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_what_fields_mut_wrote() {
        let mut buf = [0u8; 16];
        let mut w = FieldsMut(&mut buf);
        w.put_u16_le::<0>(0x0102);
        w.put_u32_be::<2>(0x0304_0506);
        w.put_u64_le::<6>(0x0708_090a_0b0c_0d0e);
        w.put_u8::<14>(0xff);
        assert_eq!(buf[..6], [0x02, 0x01, 0x03, 0x04, 0x05, 0x06]);
        let r = Fields(&buf);
        assert_eq!(r.u16_le::<0>(), 0x0102);
        assert_eq!(r.u32_be::<2>(), 0x0304_0506);
        assert_eq!(r.u64_le::<6>(), 0x0708_090a_0b0c_0d0e);
        assert_eq!(r.u8_at::<14>(), 0xff);
        assert_eq!(r.bytes::<2, 2>(), [0x03, 0x04]);
    }

    #[test]
    fn cursor_refuses_to_read_past_the_end() {
        let mut c = Cursor::new(&[0, 1, 0, 0, 0]);
        assert_eq!(c.u16_be(), Some(1));
        assert_eq!(c.u32_be(), None);
        assert_eq!(c.remaining(), 3);
        assert_eq!(c.take(3), Some(&[0u8, 0, 0][..]));
        assert_eq!(c.take(1), None);
    }
}
