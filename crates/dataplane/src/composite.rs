//! Composite namespaces: one namespace striped or concatenated over other namespaces, each on
//! its own device (ReFlex4ARM's several SSDs per server).
//!
//! Why a layer of its own: QoS stays per device. A composite namespace has no device, no
//! profile and no token bucket; each piece of a request is charged to, scheduled on and
//! submitted to the member it lands on, through that member's own scheduler. This module is
//! only the address arithmetic: a byte range of the composite becomes pieces, each on one
//! member ([`Composite::piece`]), and the spec text `stripe:64K:1,2` / `concat:1,2` becomes a
//! [`CompositeSpec`].
//!
//! - **Stripe**: fixed-size stripes, round-robin over the members (stripe `s` on member
//!   `s % n`, at `s / n` stripes into it). Its size is `n` times the smallest member, rounded
//!   down to whole stripes, so every stripe exists on its member.
//! - **Concat**: the members one after the other; the leading offset bits pick the member, as
//!   ReFlex4ARM does. Its size is the members' sizes added up (each rounded down to blocks).
//!
//! Invariants: pieces never cross a member boundary, never run past the composite's size, and
//! the pieces of a range, in order, cover it exactly.

use reflex_flash::size::parse_size;

/// Members one composite namespace may have.
pub const COMPOSITE_MEMBERS_MAX: usize = 16;

/// How the composite lays its address space over its members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompositeLayout {
    Stripe { stripe_bytes: u64 },
    Concat,
}

/// A composite namespace as written: `stripe:SIZE:ID,ID,...` or `concat:ID,ID,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompositeSpec {
    pub layout: CompositeLayout,
    /// Member namespace ids, in layout order.
    pub members: Vec<u32>,
}

/// One member as the composite sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The member's namespace id and slot index.
    pub id: u32,
    pub namespace_index: u16,
    /// The bytes of the member the composite uses (its first ones).
    pub used_bytes: u64,
}

/// A stretch of a composite range that lies on one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The member's position in [`Composite::members`].
    pub member: usize,
    pub namespace_index: u16,
    /// Where it lies on the member's device.
    pub device_offset_bytes: u64,
    pub length_bytes: u32,
}

/// A checked composite namespace: its layout, members and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Composite {
    layout: CompositeLayout,
    members: Vec<Member>,
    block_size: u32,
    size_bytes: u64,
}

/// Why a composite spec or namespace is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompositeError {
    #[error("composite namespace: {0:?} is not `stripe:SIZE:ID,ID,...` or `concat:ID,ID,...`")]
    Malformed(String),
    #[error("composite namespace: stripe size: {0}")]
    StripeSize(String),
    #[error("composite namespace: member {0:?} is not a namespace id")]
    MemberId(String),
    #[error("composite namespace: needs at least 2 members, has {0}")]
    TooFewMembers(usize),
    #[error("composite namespace: at most {COMPOSITE_MEMBERS_MAX} members, has {0}")]
    TooManyMembers(usize),
    #[error("composite namespace: member {0} is named twice")]
    DuplicateMember(u32),
    #[error("composite namespace: member {0} is not a namespace declared before it")]
    UnknownMember(u32),
    #[error("composite namespace: member {0} is itself composite")]
    NestedMember(u32),
    #[error(
        "composite namespace: members' block sizes differ (namespace {first_id}: {first} bytes, namespace {other_id}: {other} bytes)"
    )]
    BlockSizes {
        first_id: u32,
        first: u32,
        other_id: u32,
        other: u32,
    },
    #[error(
        "composite namespace: stripe of {stripe_bytes} bytes is not a non-zero multiple of the members' block size ({block_size} bytes)"
    )]
    StripeNotBlocks { stripe_bytes: u64, block_size: u32 },
    #[error("composite namespace: member {id} ({size_bytes} bytes) is smaller than one stripe")]
    MemberTooSmall { id: u32, size_bytes: u64 },
}

impl CompositeSpec {
    /// Whether a backend spec names a composite (the rest is for [`CompositeSpec::parse`]).
    pub fn is_composite(spec: &str) -> bool {
        spec.starts_with("stripe:") || spec.starts_with("concat:")
    }

    /// Parses `stripe:64K:1,2` or `concat:1,2,3` (sizes as everywhere: `reflex_flash::spec`).
    pub fn parse(text: &str) -> Result<CompositeSpec, CompositeError> {
        let malformed = || CompositeError::Malformed(text.to_string());
        let (layout, members) = if let Some(rest) = text.strip_prefix("stripe:") {
            let (stripe, members) = rest.split_once(':').ok_or_else(malformed)?;
            let stripe_bytes =
                parse_size(stripe).map_err(|e| CompositeError::StripeSize(e.to_string()))?;
            (CompositeLayout::Stripe { stripe_bytes }, members)
        } else if let Some(members) = text.strip_prefix("concat:") {
            (CompositeLayout::Concat, members)
        } else {
            return Err(malformed());
        };
        let members = members
            .split(',')
            .map(|id| {
                let id = id.trim();
                match id.parse::<u32>() {
                    Ok(value) if value > 0 => Ok(value),
                    _ => Err(CompositeError::MemberId(id.to_string())),
                }
            })
            .collect::<Result<Vec<u32>, CompositeError>>()?;
        if members.len() < 2 {
            return Err(CompositeError::TooFewMembers(members.len()));
        }
        if members.len() > COMPOSITE_MEMBERS_MAX {
            return Err(CompositeError::TooManyMembers(members.len()));
        }
        for (position, id) in members.iter().enumerate() {
            if members[..position].contains(id) {
                return Err(CompositeError::DuplicateMember(*id));
            }
        }
        Ok(CompositeSpec { layout, members })
    }
}

/// What [`Composite::new`] needs of one member namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberInfo {
    pub id: u32,
    pub namespace_index: u16,
    pub size_bytes: u64,
    pub block_size: u32,
}

impl Composite {
    /// Checks the layout against its members (same block size, stripes of whole blocks, no
    /// member smaller than a stripe) and derives the size.
    pub fn new(
        layout: CompositeLayout,
        members: &[MemberInfo],
    ) -> Result<Composite, CompositeError> {
        if members.len() < 2 {
            return Err(CompositeError::TooFewMembers(members.len()));
        }
        if members.len() > COMPOSITE_MEMBERS_MAX {
            return Err(CompositeError::TooManyMembers(members.len()));
        }
        let first = members[0];
        for member in &members[1..] {
            if member.block_size != first.block_size {
                return Err(CompositeError::BlockSizes {
                    first_id: first.id,
                    first: first.block_size,
                    other_id: member.id,
                    other: member.block_size,
                });
            }
        }
        let block_size = first.block_size.max(1);
        let block = u64::from(block_size);
        let (used, size_bytes) = match layout {
            CompositeLayout::Stripe { stripe_bytes } => {
                if stripe_bytes == 0 || !stripe_bytes.is_multiple_of(block) {
                    return Err(CompositeError::StripeNotBlocks {
                        stripe_bytes,
                        block_size,
                    });
                }
                if let Some(small) = members.iter().find(|m| m.size_bytes < stripe_bytes) {
                    return Err(CompositeError::MemberTooSmall {
                        id: small.id,
                        size_bytes: small.size_bytes,
                    });
                }
                let smallest = members.iter().map(|m| m.size_bytes).min().unwrap_or(0);
                let used = smallest / stripe_bytes * stripe_bytes;
                (vec![used; members.len()], used * members.len() as u64)
            }
            CompositeLayout::Concat => {
                let used: Vec<u64> = members
                    .iter()
                    .map(|m| m.size_bytes / block * block)
                    .collect();
                let size = used.iter().sum();
                (used, size)
            }
        };
        Ok(Composite {
            layout,
            members: members
                .iter()
                .zip(used)
                .map(|(member, used_bytes)| Member {
                    id: member.id,
                    namespace_index: member.namespace_index,
                    used_bytes,
                })
                .collect(),
            block_size,
            size_bytes,
        })
    }

    pub fn layout(&self) -> CompositeLayout {
        self.layout
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The position of the member on slot `namespace_index`, if it is one.
    pub fn position(&self, namespace_index: u16) -> Option<usize> {
        self.members
            .iter()
            .position(|member| member.namespace_index == namespace_index)
    }

    /// The first piece of `[offset_bytes, offset_bytes + length_bytes)`: where it starts, on
    /// one member, up to the next member boundary. The caller validated the range against
    /// [`Self::size_bytes`]; a range past it is clamped to an empty piece on the last member.
    pub fn piece(&self, offset_bytes: u64, length_bytes: u32) -> Piece {
        debug_assert!(offset_bytes + u64::from(length_bytes) <= self.size_bytes);
        let (member, device_offset_bytes, room_bytes) = match self.layout {
            CompositeLayout::Stripe { stripe_bytes } => {
                let stripe = offset_bytes / stripe_bytes;
                let within = offset_bytes % stripe_bytes;
                let count = self.members.len() as u64;
                let member = (stripe % count) as usize;
                let device = (stripe / count) * stripe_bytes + within;
                (member, device, stripe_bytes - within)
            }
            CompositeLayout::Concat => {
                let mut start = 0u64;
                let mut found = None;
                for (position, member) in self.members.iter().enumerate() {
                    if offset_bytes < start + member.used_bytes {
                        let device = offset_bytes - start;
                        found = Some((position, device, member.used_bytes - device));
                        break;
                    }
                    start += member.used_bytes;
                }
                found.unwrap_or((self.members.len() - 1, 0, 0))
            }
        };
        let length_bytes = u64::from(length_bytes).min(room_bytes) as u32;
        Piece {
            member,
            namespace_index: self.members[member].namespace_index,
            device_offset_bytes,
            length_bytes,
        }
    }

    /// Every piece of a range, in order (tests, tools; the dataplane asks piece by piece).
    pub fn pieces(&self, offset_bytes: u64, length_bytes: u32) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut done = 0u32;
        while done < length_bytes {
            let piece = self.piece(offset_bytes + u64::from(done), length_bytes - done);
            if piece.length_bytes == 0 {
                break;
            }
            done += piece.length_bytes;
            pieces.push(piece);
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;

    fn members(sizes: &[u64], block_size: u32) -> Vec<MemberInfo> {
        sizes
            .iter()
            .enumerate()
            .map(|(position, &size_bytes)| MemberInfo {
                id: position as u32 + 1,
                namespace_index: position as u16,
                size_bytes,
                block_size,
            })
            .collect()
    }

    fn stripe(sizes: &[u64], stripe_bytes: u64) -> Composite {
        Composite::new(
            CompositeLayout::Stripe { stripe_bytes },
            &members(sizes, 512),
        )
        .unwrap()
    }

    /// `(member, device offset, length)` of each piece.
    fn check(composite: &Composite, offset: u64, length: u32, expected: &[(usize, u64, u32)]) {
        let pieces: Vec<(usize, u64, u32)> = composite
            .pieces(offset, length)
            .iter()
            .map(|piece| (piece.member, piece.device_offset_bytes, piece.length_bytes))
            .collect();
        assert_eq!(pieces, expected, "range {offset} + {length}");
        let covered: u32 = pieces.iter().map(|piece| piece.2).sum();
        assert_eq!(covered, length);
    }

    #[test]
    fn stripes_go_round_robin() {
        let composite = stripe(&[1024 * K, 1024 * K], 64 * K);
        assert_eq!(composite.size_bytes(), 2048 * K);
        check(&composite, 0, 4096, &[(0, 0, 4096)]);
        check(&composite, 64 * K, 4096, &[(1, 0, 4096)]);
        check(&composite, 128 * K, 4096, &[(0, 64 * K, 4096)]);
        check(&composite, 192 * K + 512, 512, &[(1, 64 * K + 512, 512)]);
    }

    #[test]
    fn a_range_across_stripes_is_split_at_each_boundary() {
        let composite = stripe(&[1024 * K, 1024 * K, 1024 * K], 64 * K);
        // 8 KiB across the first boundary: 4 KiB on member 0, 4 KiB on member 1.
        check(
            &composite,
            60 * K,
            8 * 1024,
            &[(0, 60 * K, 4096), (1, 0, 4096)],
        );
        // 200 KiB from 32 KiB: the rest of stripe 0, stripes 1 and 2, part of stripe 3.
        check(
            &composite,
            32 * K,
            200 * 1024,
            &[
                (0, 32 * K, 32 * 1024),
                (1, 0, 64 * 1024),
                (2, 0, 64 * 1024),
                (0, 64 * K, 40 * 1024),
            ],
        );
    }

    #[test]
    fn stripe_size_is_whole_stripes_of_the_smallest_member() {
        // 100 KiB + 512 on the smaller member: one whole 64 KiB stripe per member.
        let composite = stripe(&[100 * K + 512, 1024 * K], 64 * K);
        assert_eq!(composite.size_bytes(), 128 * K);
        assert!(composite.members().iter().all(|m| m.used_bytes == 64 * K));
        // The last stripe ends the namespace exactly.
        check(&composite, 120 * K, 8 * 1024, &[(1, 56 * K, 8 * 1024)]);
    }

    #[test]
    fn concat_puts_members_one_after_the_other() {
        let composite = Composite::new(
            CompositeLayout::Concat,
            &members(&[100 * K + 100, 300 * K], 512),
        )
        .unwrap();
        // The first member is used up to its last whole block.
        assert_eq!(composite.members()[0].used_bytes, 100 * K);
        assert_eq!(composite.size_bytes(), 400 * K);
        check(&composite, 0, 4096, &[(0, 0, 4096)]);
        check(&composite, 100 * K, 4096, &[(1, 0, 4096)]);
        check(&composite, 98 * K, 4096, &[(0, 98 * K, 2048), (1, 0, 2048)]);
        // The last partial block of the range, at the very end.
        check(&composite, 400 * K - 512, 512, &[(1, 300 * K - 512, 512)]);
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let error = |layout, infos: &[MemberInfo]| Composite::new(layout, infos).unwrap_err();
        let mut mixed = members(&[1024 * K, 1024 * K], 512);
        mixed[1].block_size = 4096;
        assert_eq!(
            error(CompositeLayout::Concat, &mixed),
            CompositeError::BlockSizes {
                first_id: 1,
                first: 512,
                other_id: 2,
                other: 4096
            }
        );
        let stripe_layout = |stripe_bytes| CompositeLayout::Stripe { stripe_bytes };
        let even = members(&[1024 * K, 1024 * K], 4096);
        assert_eq!(
            error(stripe_layout(6 * K), &even),
            CompositeError::StripeNotBlocks {
                stripe_bytes: 6 * K,
                block_size: 4096
            }
        );
        assert!(matches!(
            error(stripe_layout(0), &even),
            CompositeError::StripeNotBlocks { .. }
        ));
        assert_eq!(
            error(stripe_layout(2048 * K), &even),
            CompositeError::MemberTooSmall {
                id: 1,
                size_bytes: 1024 * K
            }
        );
        assert_eq!(
            error(CompositeLayout::Concat, &even[..1]),
            CompositeError::TooFewMembers(1)
        );
    }

    #[test]
    fn specs_parse_or_say_why_not() {
        assert_eq!(
            CompositeSpec::parse("stripe:64K:1,2"),
            Ok(CompositeSpec {
                layout: CompositeLayout::Stripe {
                    stripe_bytes: 64 * K
                },
                members: vec![1, 2]
            })
        );
        assert_eq!(
            CompositeSpec::parse("concat:3, 1,2"),
            Ok(CompositeSpec {
                layout: CompositeLayout::Concat,
                members: vec![3, 1, 2]
            })
        );
        let refused = |text: &str| CompositeSpec::parse(text).unwrap_err();
        assert_eq!(
            refused("stripe:1,2"),
            CompositeError::Malformed("stripe:1,2".into())
        );
        assert!(matches!(
            refused("stripe:64Q:1,2"),
            CompositeError::StripeSize(_)
        ));
        assert_eq!(refused("concat:1,x"), CompositeError::MemberId("x".into()));
        assert_eq!(refused("concat:1,0"), CompositeError::MemberId("0".into()));
        assert_eq!(refused("concat:1,2,1"), CompositeError::DuplicateMember(1));
        assert_eq!(refused("concat:1"), CompositeError::TooFewMembers(1));
        assert_eq!(
            refused("mirror:1,2"),
            CompositeError::Malformed("mirror:1,2".into())
        );
        assert!(CompositeSpec::is_composite("stripe:4K:1,2"));
        assert!(!CompositeSpec::is_composite("file:stripe:4K"));
    }
}
