//! The emulated device's data: a sparse map of 4 KiB pages in memory.
//!
//! Pages never written (or trimmed whole) are absent and read as zeroes, so an emulated
//! namespace of any size costs memory only for the data really written to it. Timing lives in
//! the model ([`super::EmuDevice`]); this store only keeps bytes, so integrity tests check real
//! data through the same device the QoS experiments use.

use std::collections::HashMap;

/// Granule of the store (independent of the profile's page size, which only affects timing).
pub const STORE_PAGE_BYTES: usize = 4096;

#[derive(Debug, Default)]
pub struct PageStore {
    pages: HashMap<u64, Box<[u8; STORE_PAGE_BYTES]>>,
}

impl PageStore {
    pub fn new() -> PageStore {
        PageStore::default()
    }

    /// Pages holding data (memory in use is about this × 4 KiB).
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Copies `buf.len()` bytes starting at byte `offset` into `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        for_each_piece(offset, buf.len(), |page, within, range| {
            let target = &mut buf[range];
            match self.pages.get(&page) {
                Some(data) => target.copy_from_slice(&data[within..within + target.len()]),
                None => target.fill(0),
            }
        });
    }

    /// Stores `buf` at byte `offset`.
    pub fn write(&mut self, offset: u64, buf: &[u8]) {
        for_each_piece(offset, buf.len(), |page, within, range| {
            let source = &buf[range];
            let data = self
                .pages
                .entry(page)
                .or_insert_with(|| Box::new([0; STORE_PAGE_BYTES]));
            data[within..within + source.len()].copy_from_slice(source);
        });
    }

    /// Makes `len` bytes at `offset` read back as zeroes, freeing whole pages.
    pub fn trim(&mut self, offset: u64, len: u64) {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        for_each_piece(offset, len, |page, within, range| {
            if range.len() == STORE_PAGE_BYTES {
                self.pages.remove(&page);
            } else if let Some(data) = self.pages.get_mut(&page) {
                data[within..within + range.len()].fill(0);
            }
        });
    }
}

/// Splits `[offset, offset + len)` at page boundaries: (page index, offset within the page,
/// range within the caller's buffer).
fn for_each_piece(
    offset: u64,
    len: usize,
    mut piece: impl FnMut(u64, usize, std::ops::Range<usize>),
) {
    let page_bytes = STORE_PAGE_BYTES as u64;
    let mut done = 0usize;
    while done < len {
        let position = offset + done as u64;
        let page = position / page_bytes;
        let within = (position % page_bytes) as usize;
        let count = (STORE_PAGE_BYTES - within).min(len - done);
        piece(page, within, done..done + count);
        done += count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwritten_reads_zero_and_writes_stick() {
        let mut store = PageStore::new();
        let mut buf = vec![7u8; 9000];
        store.read(1000, &mut buf);
        assert!(buf.iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
        store.write(1000, &data);
        store.read(1000, &mut buf);
        assert_eq!(buf, data);
        assert_eq!(store.page_count(), 3);
        store.trim(0, 8192);
        assert_eq!(store.page_count(), 1);
        store.read(1000, &mut buf);
        assert!(buf[..8192 - 1000].iter().all(|&b| b == 0));
        assert_eq!(buf[8192 - 1000..], data[8192 - 1000..]);
    }
}
