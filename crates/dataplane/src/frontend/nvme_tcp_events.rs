//! Asynchronous events of an NVMe/TCP controller: the Notice "Namespace Attribute Changed"
//! and its Changed Namespace List log page (04h), kept per controller on its admin queue.
//!
//! Why: a namespace removed at run time leaves the active namespace list; without the notice
//! a host only learns it when its I/O fails (the Linux host rescans its namespaces on this
//! event). The rules are the Linux target's (`nvmet_ns_changed`, `nvmet_aen_bit_disabled` in
//! `drivers/nvme/target/core.c`): the list holds each changed NSID once (here in increasing
//! order; Linux keeps the order of the changes), and past [`CHANGED_NAMESPACES_MAX`] entries it
//! says only "more than that" (first entry FFFFFFFFh, the rest zero); reading the log page
//! clears it; an event is generated only if
//! the host enabled namespace attribute notices (Set Features, Asynchronous Event
//! Configuration bit 8), and once generated, further events of its kind are masked until the
//! host reads the log page without Retain Asynchronous Event (RAE).

use reflex_proto::nvme_tcp::admin::CHANGED_NAMESPACES_LOG_SIZE;

/// Entries of the Changed Namespace List log page.
pub const CHANGED_NAMESPACES_MAX: usize = 1024;
/// Asynchronous Event Configuration bit that enables namespace attribute notices (and the
/// OAES bit that says the controller sends them).
pub const NAMESPACE_ATTRIBUTE_NOTICES: u32 = 1 << 8;
/// Completion dword 0 of the notice: event type Notice (2h), information Namespace
/// Attribute Changed (00h), log page Changed Namespace List (04h).
pub const NAMESPACE_ATTRIBUTE_CHANGED_DW0: u32 = 0x2 | (0x04 << 16);

const _: () = assert!(CHANGED_NAMESPACES_MAX * 4 == CHANGED_NAMESPACES_LOG_SIZE);

/// One controller's changed namespaces and the state of their event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NamespaceChanges {
    /// Changed NSIDs, increasing, each once, at most [`CHANGED_NAMESPACES_MAX`].
    nsids: Vec<u32>,
    /// More namespaces changed than the list holds.
    overflow: bool,
    /// An event was generated that no Asynchronous Event Request has carried yet.
    unreported: bool,
    /// An event was generated and the host has not read the log page (RAE clear) since.
    masked: bool,
}

impl NamespaceChanges {
    /// Namespace `nsid` changed (left or joined the active list). `notices_enabled`: the
    /// host's Asynchronous Event Configuration has bit 8 set.
    pub fn note(&mut self, nsid: u32, notices_enabled: bool) {
        debug_assert!(nsid != 0 && nsid != u32::MAX);
        if !self.overflow
            && let Err(position) = self.nsids.binary_search(&nsid)
        {
            if self.nsids.len() == CHANGED_NAMESPACES_MAX {
                self.overflow = true;
                self.nsids.clear();
            } else {
                self.nsids.insert(position, nsid);
            }
        }
        if notices_enabled && !self.masked {
            self.masked = true;
            self.unreported = true;
        }
        debug_assert!(self.nsids.len() <= CHANGED_NAMESPACES_MAX);
        debug_assert!(!self.overflow || self.nsids.is_empty());
    }

    /// The completion dword 0 of an event to carry now on a held Asynchronous Event Request
    /// (each event is carried once).
    pub fn poll_event(&mut self) -> Option<u32> {
        if !self.unreported {
            return None;
        }
        debug_assert!(self.masked);
        self.unreported = false;
        Some(NAMESPACE_ATTRIBUTE_CHANGED_DW0)
    }

    /// The log page (4096 bytes), which reading clears; `retain_event` (RAE set) keeps the
    /// event masked.
    pub fn read_log(&mut self, retain_event: bool) -> Vec<u8> {
        let mut log = vec![0u8; CHANGED_NAMESPACES_LOG_SIZE];
        if self.overflow {
            log[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        } else {
            for (entry, nsid) in log.chunks_exact_mut(4).zip(&self.nsids) {
                entry.copy_from_slice(&nsid.to_le_bytes());
            }
        }
        self.nsids.clear();
        self.overflow = false;
        if !retain_event {
            self.masked = false;
        }
        log
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(log: &[u8]) -> Vec<u32> {
        log.chunks_exact(4)
            .map(|entry| u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]))
            .take_while(|&nsid| nsid != 0)
            .collect()
    }

    #[test]
    fn changes_are_listed_once_in_order_and_cleared_on_read() {
        let mut changes = NamespaceChanges::default();
        for nsid in [5, 2, 5, 9] {
            changes.note(nsid, true);
        }
        assert_eq!(changes.poll_event(), Some(NAMESPACE_ATTRIBUTE_CHANGED_DW0));
        assert_eq!(changes.poll_event(), None, "one event is carried once");
        assert_eq!(entries(&changes.read_log(false)), vec![2, 5, 9]);
        assert_eq!(entries(&changes.read_log(false)), Vec::<u32>::new());
    }

    #[test]
    fn an_event_masks_the_next_until_the_log_is_read_without_rae() {
        let mut changes = NamespaceChanges::default();
        changes.note(1, true);
        assert!(changes.poll_event().is_some());
        changes.note(2, true);
        assert_eq!(changes.poll_event(), None, "masked");
        // RAE set: the log is read (and cleared) but the event stays masked.
        assert_eq!(entries(&changes.read_log(true)), vec![1, 2]);
        changes.note(3, true);
        assert_eq!(changes.poll_event(), None);
        assert_eq!(entries(&changes.read_log(false)), vec![3]);
        changes.note(4, true);
        assert!(changes.poll_event().is_some(), "unmasked by the read");
    }

    #[test]
    fn disabled_notices_fill_the_log_but_raise_no_event() {
        let mut changes = NamespaceChanges::default();
        changes.note(7, false);
        assert_eq!(changes.poll_event(), None);
        assert_eq!(entries(&changes.read_log(false)), vec![7]);
    }

    #[test]
    fn more_than_1024_changes_overflow_to_one_entry() {
        let mut changes = NamespaceChanges::default();
        for nsid in 1..=CHANGED_NAMESPACES_MAX as u32 {
            changes.note(nsid, true);
        }
        let log = changes.read_log(false);
        assert_eq!(entries(&log).len(), CHANGED_NAMESPACES_MAX);
        for nsid in 1..=CHANGED_NAMESPACES_MAX as u32 + 1 {
            changes.note(nsid, true);
        }
        let log = changes.read_log(false);
        assert_eq!(entries(&log[..4]), vec![u32::MAX]);
        assert!(log[4..].iter().all(|&byte| byte == 0));
        assert_eq!(entries(&changes.read_log(false)), Vec::<u32>::new());
    }
}
