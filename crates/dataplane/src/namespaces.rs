//! The server's namespaces: ids, devices and the facts validation needs, shared read-only by
//! every dataplane thread.
//!
//! Namespaces live in **slots** with stable indices: a namespace added at run time takes the
//! next slot, and a removed one keeps its slot (never reused) so that an index a request,
//! scheduler or device queue carries always means the same namespace. A slot is `Live`
//! (found by id, listed), `Removing` (no longer found or listed; requests already admitted
//! finish on its device) or `Gone` (every thread has drained it; the set no longer holds its
//! device, which closes when its last queue is dropped). A change makes a new set
//! ([`NamespaceSet::with_added`], [`NamespaceSet::with_state`]); the control plane hands it to
//! every thread.
//!
//! A composite slot (`crate::composite`, [`NamespaceSet::with_composite`]) has no device: its
//! requests' pieces go to its members' slots, declared before it.
//!
//! Invariant: a namespace's index (its position here) is what requests, schedulers and device
//! queues carry; the wire id is looked up once, at validation, among live slots only.

use std::sync::Arc;

use reflex_flash::{Device, DeviceInfo};
use reflex_proto::native::{self, ServerLimits};

use crate::composite::{Composite, CompositeError, CompositeSpec, MemberInfo};
use crate::gate::WriteGate;

/// Slots a server has at most over its life (initial namespaces, plus one per run-time add).
pub const NAMESPACE_SLOTS_MAX: usize = 4096;

/// Where a slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Live,
    Removing,
    Gone,
}

#[derive(Clone)]
struct Slot {
    id: u32,
    device: Option<Arc<dyn Device>>,
    info: DeviceInfo,
    read_only: bool,
    state: SlotState,
    gate: Arc<WriteGate>,
    /// A namespace striped or concatenated over other slots (`crate::composite`): it has no
    /// device of its own.
    composite: Option<Arc<Composite>>,
}

#[derive(Clone)]
pub struct NamespaceSet {
    slots: Vec<Slot>,
    /// Counts the changes that led to this set (frontends cache what they derive from it).
    generation: u64,
    /// The live namespaces, in slot order: what the native codec validates against.
    table: Vec<native::Namespace>,
    limits: ServerLimits,
}

impl std::fmt::Debug for NamespaceSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.slots.iter().map(|slot| (slot.id, slot.state)))
            .finish()
    }
}

/// Why a namespace cannot be added to the set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamespaceSetError {
    #[error("namespace {0} exists")]
    Duplicate(u32),
    #[error("namespace id 0 is not valid (ids start at 1)")]
    ZeroId,
    #[error("at most {max} namespaces are served at once", max = native::NAMESPACE_COUNT_MAX)]
    TooMany,
    #[error("no namespace slot left ({NAMESPACE_SLOTS_MAX} over the server's life): restart")]
    NoSlot,
    #[error("device block size {0} is above the protocol's {max}", max = native::BLOCK_SIZE_BYTES_DEFAULT)]
    BlockSize(u32),
    #[error("namespace {id}: {error}")]
    Composite { id: u32, error: CompositeError },
}

impl NamespaceSet {
    /// `(id, device, read_only)` per namespace; at most 256, ids unique (checked by config).
    pub fn new(entries: Vec<(u32, Arc<dyn Device>, bool)>) -> NamespaceSet {
        let mut set = NamespaceSet {
            slots: Vec::new(),
            generation: 0,
            table: Vec::new(),
            limits: ServerLimits::default(),
        };
        for (id, device, read_only) in entries {
            set = set
                .with_added(id, device, read_only)
                .unwrap_or_else(|e| panic!("namespace {id}: {e}"));
        }
        set
    }

    /// This set with one more live namespace in a new slot (returned as the set's last
    /// index). Refused, with nothing changed, when the id is taken, the set is full or the
    /// device's block size is too large.
    pub fn with_added(
        &self,
        id: u32,
        device: Arc<dyn Device>,
        read_only: bool,
    ) -> Result<NamespaceSet, NamespaceSetError> {
        let info = device.info().clone();
        self.with_slot(id, Some(device), info, read_only, None)
    }

    /// This set with one more live namespace striped or concatenated over live namespaces
    /// of this set (`spec`'s members, declared before it, none of them composite).
    pub fn with_composite(
        &self,
        id: u32,
        spec: &CompositeSpec,
        read_only: bool,
    ) -> Result<NamespaceSet, NamespaceSetError> {
        let composite_error = |error| NamespaceSetError::Composite { id, error };
        let mut members = Vec::new();
        for &member_id in &spec.members {
            let index = self
                .index_of(member_id)
                .ok_or(composite_error(CompositeError::UnknownMember(member_id)))?;
            if self.composite(index).is_some() {
                return Err(composite_error(CompositeError::NestedMember(member_id)));
            }
            let info = self.info(index);
            members.push(MemberInfo {
                id: member_id,
                namespace_index: index,
                size_bytes: info.size_bytes,
                block_size: info.block_size,
            });
        }
        let composite = Composite::new(spec.layout, &members).map_err(composite_error)?;
        let member_read_only = members
            .iter()
            .any(|member| self.is_read_only(member.namespace_index));
        let supports_trim = members
            .iter()
            .all(|member| self.info(member.namespace_index).supports_trim);
        let description = format!(
            "{} over namespaces {}",
            match spec.layout {
                crate::composite::CompositeLayout::Stripe { stripe_bytes } =>
                    format!("stripe of {stripe_bytes} bytes"),
                crate::composite::CompositeLayout::Concat => "concat".to_string(),
            },
            spec.members
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let info = DeviceInfo {
            size_bytes: composite.size_bytes(),
            block_size: composite.block_size(),
            read_only: member_read_only,
            supports_trim,
            description,
        };
        self.with_slot(id, None, info, read_only, Some(Arc::new(composite)))
    }

    fn with_slot(
        &self,
        id: u32,
        device: Option<Arc<dyn Device>>,
        info: DeviceInfo,
        read_only: bool,
        composite: Option<Arc<Composite>>,
    ) -> Result<NamespaceSet, NamespaceSetError> {
        if id == 0 {
            return Err(NamespaceSetError::ZeroId);
        }
        if self.index_of(id).is_some() {
            return Err(NamespaceSetError::Duplicate(id));
        }
        if self.table.len() >= native::NAMESPACE_COUNT_MAX {
            return Err(NamespaceSetError::TooMany);
        }
        if self.slots.len() >= NAMESPACE_SLOTS_MAX {
            return Err(NamespaceSetError::NoSlot);
        }
        if info.block_size > self.limits.block_size_bytes() {
            return Err(NamespaceSetError::BlockSize(info.block_size));
        }
        let mut set = self.clone();
        set.generation += 1;
        set.slots.push(Slot {
            id,
            device,
            read_only: read_only || info.read_only,
            info,
            state: SlotState::Live,
            gate: Arc::new(WriteGate::new()),
            composite,
        });
        set.rebuild_table();
        Ok(set)
    }

    /// The layout of a composite namespace (`None`: a namespace on one device). One branch
    /// on the hot path of plain namespaces.
    #[inline]
    pub fn composite(&self, index: u16) -> Option<&Composite> {
        self.slots
            .get(usize::from(index))
            .and_then(|slot| slot.composite.as_deref())
    }

    /// The live composite namespaces that have slot `index` as a member.
    pub fn composites_over(&self, index: u16) -> impl Iterator<Item = u32> + '_ {
        self.slots
            .iter()
            .filter(move |slot| {
                slot.state != SlotState::Gone
                    && slot
                        .composite
                        .as_ref()
                        .is_some_and(|composite| composite.position(index).is_some())
            })
            .map(|slot| slot.id)
    }

    /// This set with slot `index` in `state` (`Gone` drops the set's hold on its device).
    /// States only move forward: Live, Removing, Gone.
    pub fn with_state(&self, index: u16, state: SlotState) -> NamespaceSet {
        let mut set = self.clone();
        set.generation += 1;
        if let Some(slot) = set.slots.get_mut(usize::from(index)) {
            let rank = |state: SlotState| state as u8;
            if rank(state) > rank(slot.state) {
                slot.state = state;
            }
            if slot.state == SlotState::Gone {
                slot.device = None;
            }
        }
        set.rebuild_table();
        set
    }

    fn rebuild_table(&mut self) {
        self.table = self
            .slots
            .iter()
            .filter(|slot| slot.state == SlotState::Live)
            .map(|slot| native::Namespace {
                id: slot.id,
                size_bytes: slot.info.size_bytes,
                read_only: slot.read_only,
            })
            .collect();
    }

    /// How many changes led to this set: a later set of the same server has a larger one.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Slots (live or not): per-namespace vectors are this long.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The live namespaces' indices, in slot order.
    pub fn live_indices(&self) -> impl Iterator<Item = u16> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.state == SlotState::Live)
            .map(|(index, _)| index as u16)
    }

    /// Live namespaces.
    pub fn live_count(&self) -> usize {
        self.table.len()
    }

    /// The index of the live namespace `id`.
    pub fn index_of(&self, id: u32) -> Option<u16> {
        self.slots
            .iter()
            .position(|slot| slot.id == id && slot.state == SlotState::Live)
            .map(|index| index as u16)
    }

    pub fn state(&self, index: u16) -> SlotState {
        self.slots
            .get(usize::from(index))
            .map_or(SlotState::Gone, |slot| slot.state)
    }

    pub fn is_live(&self, index: u16) -> bool {
        self.state(index) == SlotState::Live
    }

    pub fn id(&self, index: u16) -> u32 {
        self.slots[usize::from(index)].id
    }

    /// The device of a slot that is not gone.
    pub fn device(&self, index: u16) -> Option<&Arc<dyn Device>> {
        self.slots
            .get(usize::from(index))
            .and_then(|slot| slot.device.as_ref())
    }

    /// The write ordering of a namespace's read-modify-writes (`crate::gate`).
    pub fn write_gate(&self, index: u16) -> &WriteGate {
        &self.slots[usize::from(index)].gate
    }

    pub fn info(&self, index: u16) -> &DeviceInfo {
        &self.slots[usize::from(index)].info
    }

    pub fn size_bytes(&self, index: u16) -> u64 {
        self.slots[usize::from(index)].info.size_bytes
    }

    /// Whether writes, trims and write-zeroes are refused (configured so, or the device is).
    pub fn is_read_only(&self, index: u16) -> bool {
        self.slots[usize::from(index)].read_only
    }

    /// The table the native codec validates against and HELLO advertises (live namespaces).
    pub fn native_table(&self) -> &[native::Namespace] {
        &self.table
    }

    pub fn limits(&self) -> ServerLimits {
        self.limits
    }
}
