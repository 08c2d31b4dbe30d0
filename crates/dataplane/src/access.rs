//! Access control on the dataplane: which peers a listener serves ([`AllowList`]), what a
//! tenant may do ([`Grant`]), why something was refused ([`Refusal`]), and a log that names
//! refusals without letting a hostile client flood it ([`RefusalLog`]).
//!
//! Where each check runs: a listener's allow-list at accept (`Dataplane::handle_accept`), so
//! a refused peer never gets a front end; a tenant's grant where every I/O request is charged
//! to its tenant (`Dataplane::charge`), before any buffer, scheduler or device sees it, so a
//! refused request writes nothing. Both are plain data consulted by the dataplane thread; the
//! configuration builds them (`reflex-server`), the control plane keeps each tenant's grant
//! with its entry and hands it over when a connection is first charged to the tenant.

use std::net::IpAddr;

use ipnet::IpNet;
use reflex_qos::Nanos;

/// Source addresses a listener serves (CIDR blocks). An IPv4 peer reaching a dual-stack
/// listener as `::ffff:a.b.c.d` is matched as the IPv4 address it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowList {
    nets: Vec<IpNet>,
}

impl AllowList {
    pub fn new(nets: Vec<IpNet>) -> AllowList {
        AllowList { nets }
    }

    /// Whether `peer` is in one of the blocks.
    pub fn allows(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.nets.iter().any(|net| net.contains(&peer))
    }

    pub fn nets(&self) -> &[IpNet] {
        &self.nets
    }
}

/// What one listener admits: its name (for logs and metrics) and its allow-list (`None`:
/// every peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerAccess {
    pub name: String,
    pub allow: Option<AllowList>,
}

impl ListenerAccess {
    /// A listener that serves every peer.
    pub fn open(name: impl Into<String>) -> ListenerAccess {
        ListenerAccess {
            name: name.into(),
            allow: None,
        }
    }
}

/// What a tenant may do on its namespace: everything by default; `read_only` refuses WRITE,
/// TRIM and WRITE ZEROES; `range` limits every request (reads too) to a byte range of the
/// namespace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Grant {
    pub read_only: bool,
    pub range: Option<ByteRange>,
}

/// Bytes `[offset_bytes, offset_bytes + length_bytes)` of a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub offset_bytes: u64,
    pub length_bytes: u64,
}

impl ByteRange {
    /// Whether `[offset_bytes, offset_bytes + length_bytes)` lies inside the range (an empty
    /// request must start inside it, or at its end).
    pub fn contains(&self, offset_bytes: u64, length_bytes: u64) -> bool {
        let end = self.offset_bytes.saturating_add(self.length_bytes);
        match offset_bytes.checked_add(length_bytes) {
            Some(request_end) => offset_bytes >= self.offset_bytes && request_end <= end,
            None => false,
        }
    }
}

impl Grant {
    /// A grant that allows everything.
    pub const ALL: Grant = Grant {
        read_only: false,
        range: None,
    };

    pub fn is_unrestricted(&self) -> bool {
        *self == Grant::ALL
    }

    /// Checks one request: `writes` when it changes data (WRITE, TRIM, WRITE ZEROES),
    /// `range` the bytes it touches (`None`: it names no range, as FLUSH).
    pub fn check(&self, writes: bool, range: Option<(u64, u64)>) -> Result<(), Refusal> {
        if self.read_only && writes {
            return Err(Refusal::ReadOnly);
        }
        if let (Some(granted), Some((offset_bytes, length_bytes))) = (self.range, range)
            && !granted.contains(offset_bytes, length_bytes)
        {
            return Err(Refusal::OutOfRange);
        }
        Ok(())
    }
}

/// Why a request was refused by access control (the `reason` label of
/// `reflex_refusals_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, thiserror::Error)]
pub enum Refusal {
    /// A write, trim or write-zeroes by a read-only tenant.
    #[error("the tenant's grant is read-only")]
    ReadOnly,
    /// Bytes outside the tenant's granted range.
    #[error("outside the tenant's granted range")]
    OutOfRange,
    /// A namespace that is not the tenant's.
    #[error("not the tenant's namespace")]
    Namespace,
    /// The tenant was removed while the connection was charged to it.
    #[error("the tenant was removed")]
    Revoked,
    /// A connection whose TLS client certificate names one tenant asked for another (an
    /// export, port or BIND of another tenant).
    #[error("not the tenant the client's certificate names")]
    Identity,
}

impl Refusal {
    pub const ALL: [Refusal; 5] = [
        Refusal::ReadOnly,
        Refusal::OutOfRange,
        Refusal::Namespace,
        Refusal::Revoked,
        Refusal::Identity,
    ];
    pub const COUNT: usize = Refusal::ALL.len();

    pub fn index(self) -> usize {
        self as usize
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::ReadOnly => "read_only",
            Refusal::OutOfRange => "out_of_range",
            Refusal::Namespace => "namespace",
            Refusal::Revoked => "revoked",
            Refusal::Identity => "identity",
        }
    }
}

/// Refusal log lines allowed in a burst, and how often one more is allowed after it.
pub const REFUSAL_LOG_BURST: u32 = 8;
pub const REFUSAL_LOG_INTERVAL: Nanos = Nanos(1_000_000_000);

/// A token bucket over log lines: [`REFUSAL_LOG_BURST`] at once, then one per
/// [`REFUSAL_LOG_INTERVAL`]; lines it holds back are counted and reported with the next line
/// it lets through. Refusals are counted in the metrics whether or not they are logged.
#[derive(Debug, Clone)]
pub struct RefusalLog {
    tokens: u32,
    refilled_at: Nanos,
    suppressed: u64,
}

impl Default for RefusalLog {
    fn default() -> RefusalLog {
        RefusalLog::new()
    }
}

impl RefusalLog {
    pub fn new() -> RefusalLog {
        RefusalLog {
            tokens: REFUSAL_LOG_BURST,
            refilled_at: Nanos::ZERO,
            suppressed: 0,
        }
    }

    /// Whether to log a refusal at `now`: `Some(n)` with the lines held back since the last
    /// one logged, `None` to count it only.
    pub fn admit(&mut self, now: Nanos) -> Option<u64> {
        let elapsed = now.saturating_since(self.refilled_at).0;
        let earned = elapsed / REFUSAL_LOG_INTERVAL.0;
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(earned).min(REFUSAL_LOG_BURST);
            self.refilled_at = now;
        }
        if self.tokens == 0 {
            self.suppressed += 1;
            return None;
        }
        self.tokens -= 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(text: &[&str]) -> AllowList {
        AllowList::new(
            text.iter()
                .map(|net| net.parse().unwrap_or_else(|e| panic!("{net}: {e}")))
                .collect(),
        )
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn allow_lists_match_blocks_and_mapped_ipv4() {
        let allow = list(&["127.0.0.1/32", "10.0.0.0/8", "::1/128"]);
        assert!(allow.allows(ip("127.0.0.1")));
        assert!(!allow.allows(ip("127.0.0.2")));
        assert!(allow.allows(ip("10.200.0.9")));
        assert!(allow.allows(ip("::1")));
        assert!(allow.allows(ip("::ffff:127.0.0.1")));
        assert!(!allow.allows(ip("::ffff:127.0.0.2")));
        assert!(!allow.allows(ip("::2")));
        assert!(!list(&[]).allows(ip("127.0.0.1")));
    }

    #[test]
    fn grants_refuse_writes_when_read_only_and_bytes_outside_the_range() {
        let range = ByteRange {
            offset_bytes: 4096,
            length_bytes: 8192,
        };
        let grant = Grant {
            read_only: true,
            range: Some(range),
        };
        assert_eq!(grant.check(false, Some((4096, 8192))), Ok(()));
        assert_eq!(grant.check(false, None), Ok(()));
        assert_eq!(grant.check(true, Some((4096, 512))), Err(Refusal::ReadOnly));
        assert_eq!(grant.check(true, None), Err(Refusal::ReadOnly));
        assert_eq!(grant.check(false, Some((0, 512))), Err(Refusal::OutOfRange));
        assert_eq!(
            grant.check(false, Some((4096, 8193))),
            Err(Refusal::OutOfRange)
        );
        assert_eq!(
            grant.check(false, Some((u64::MAX, 2))),
            Err(Refusal::OutOfRange)
        );
        assert_eq!(Grant::ALL.check(true, Some((0, u64::MAX))), Ok(()));
    }

    #[test]
    fn the_refusal_log_lets_a_burst_through_then_one_per_interval() {
        let mut log = RefusalLog::new();
        let start = Nanos(5_000_000_000);
        for _ in 0..REFUSAL_LOG_BURST {
            assert_eq!(log.admit(start), Some(0));
        }
        assert_eq!(log.admit(start), None);
        assert_eq!(log.admit(Nanos(start.0 + 1)), None);
        assert_eq!(
            log.admit(Nanos(start.0 + REFUSAL_LOG_INTERVAL.0)),
            Some(2),
            "the next line reports the two held back"
        );
        assert_eq!(log.admit(Nanos(start.0 + REFUSAL_LOG_INTERVAL.0)), None);
    }
}
