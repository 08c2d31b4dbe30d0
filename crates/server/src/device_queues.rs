//! What both drivers keep the same way: per namespace slot, this thread's queue of the slot's
//! device (opened at start or on `Op::OpenDevice`, dropped on `Op::CloseDevice`), and the
//! layout of the `u64` tokens their operations carry (`user_data` in io_uring, an epoll
//! event's data, a device queue's echo).

use std::sync::Arc;

use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::{DeviceCommand, DeviceOpId, GENERATION_MASK};
use reflex_flash::{Device, DeviceQueue, Lent};
use reflex_qos::Nanos;

/// Token kinds of device operations, the same in both drivers' `Kind` enums.
pub const KIND_DEVICE: u8 = 4;
pub const KIND_FLUSH: u8 = 5;
/// A read another thread migrated here (`crate::migration`).
pub const KIND_MIGRATED: u8 = 7;

/// A token: kind (4 bits) | generation (28 bits) | index (32 bits).
pub fn pack(kind: u8, generation: u32, index: u32) -> u64 {
    debug_assert!(kind < 16);
    (u64::from(kind) << 60) | (u64::from(generation & GENERATION_MASK) << 32) | u64::from(index)
}

/// A token's kind, generation and index.
pub fn unpack(token: u64) -> (u8, u32, u32) {
    (
        (token >> 60) as u8,
        ((token >> 32) as u32) & GENERATION_MASK,
        token as u32,
    )
}

/// The token a device operation carries.
pub fn device_token(id: DeviceOpId) -> u64 {
    match id {
        DeviceOpId::Request { index, generation } => pack(KIND_DEVICE, generation, index),
        DeviceOpId::ShutdownFlush { namespace_index } => {
            pack(KIND_FLUSH, 0, u32::from(namespace_index))
        }
        DeviceOpId::Migrated { slot, generation } => pack(KIND_MIGRATED, generation, slot),
    }
}

/// The device operation a token of kind [`KIND_DEVICE`], [`KIND_FLUSH`] or [`KIND_MIGRATED`]
/// names.
pub fn device_op_id(kind: u8, generation: u32, index: u32) -> DeviceOpId {
    if kind == KIND_FLUSH {
        DeviceOpId::ShutdownFlush {
            namespace_index: index as u16,
        }
    } else if kind == KIND_MIGRATED {
        DeviceOpId::Migrated {
            slot: index,
            generation,
        }
    } else {
        debug_assert_eq!(kind, KIND_DEVICE);
        DeviceOpId::Request { index, generation }
    }
}

/// Per namespace slot: this thread's queue of its device (`None`: removed, or not open).
pub struct DeviceQueues {
    queues: Vec<Option<Box<dyn DeviceQueue>>>,
}

impl DeviceQueues {
    /// A queue for every slot that has a device, made by `open`.
    pub fn open_all(
        namespaces: &NamespaceSet,
        open: impl Fn(&Arc<dyn Device>) -> Box<dyn DeviceQueue>,
    ) -> DeviceQueues {
        DeviceQueues {
            queues: (0..namespaces.len())
                .map(|index| namespaces.device(index as u16).map(&open))
                .collect(),
        }
    }

    /// `Op::OpenDevice`: the slot's queue, made by `open` (before the slot's first operation).
    pub fn open(
        &mut self,
        namespaces: &NamespaceSet,
        namespace_index: u16,
        open: impl FnOnce(&Arc<dyn Device>) -> Box<dyn DeviceQueue>,
    ) {
        let index = usize::from(namespace_index);
        if self.queues.len() <= index {
            self.queues.resize_with(index + 1, || None);
        }
        self.queues[index] = namespaces.device(namespace_index).map(open);
    }

    /// `Op::CloseDevice`: none of the slot's operations is outstanding.
    pub fn close(&mut self, namespace_index: u16) {
        if let Some(queue) = self.queues.get_mut(usize::from(namespace_index)) {
            *queue = None;
        }
    }

    pub fn get_mut(&mut self, namespace_index: usize) -> Option<&mut Box<dyn DeviceQueue>> {
        self.queues
            .get_mut(namespace_index)
            .and_then(Option::as_mut)
    }

    /// A loan of device memory that answers `command`, a READ that allows one, when its
    /// device lends ([`DeviceQueue::lend`]); the driver then gives it to
    /// `Dataplane::handle_device_lent` instead of submitting the read.
    pub fn lend(&mut self, command: &DeviceCommand) -> Option<Lent> {
        let (offset_bytes, length_bytes) = command.lendable_read()?;
        self.get_mut(usize::from(command.namespace_index))?
            .lend(offset_bytes, length_bytes)
    }

    /// Hints to the devices that the lendable READs among `commands` will be lent soon
    /// ([`DeviceQueue::prefetch_lend`]): their cache misses then overlap.
    pub fn prefetch_lends<'a>(&self, commands: impl Iterator<Item = &'a DeviceCommand>) {
        for command in commands {
            if let Some((offset_bytes, length_bytes)) = command.lendable_read()
                && let Some(Some(queue)) = self.queues.get(usize::from(command.namespace_index))
            {
                queue.prefetch_lend(offset_bytes, length_bytes);
            }
        }
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Box<dyn DeviceQueue>> {
        self.queues.iter_mut().flatten()
    }

    /// The earliest time a queue has something to do without a completion (fault delays).
    pub fn next_deadline(&self) -> Option<Nanos> {
        self.queues
            .iter()
            .flatten()
            .filter_map(|queue| queue.next_deadline())
            .min()
    }
}
