//! The server's namespaces: ids, devices and the facts validation needs, shared read-only by
//! every dataplane thread.
//!
//! Invariant: a namespace's index (its position here) is what requests, schedulers and device
//! queues carry; the wire id is looked up once, at validation.

use std::sync::Arc;

use reflex_flash::{Device, DeviceInfo};
use reflex_proto::native::{self, ServerLimits};

use crate::gate::WriteGate;

pub struct NamespaceSet {
    ids: Vec<u32>,
    devices: Vec<Arc<dyn Device>>,
    infos: Vec<DeviceInfo>,
    table: Vec<native::Namespace>,
    limits: ServerLimits,
    /// Per namespace: the ordering of read-modify-writes, shared by every thread.
    gates: Vec<WriteGate>,
}

impl std::fmt::Debug for NamespaceSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamespaceSet")
            .field("ids", &self.ids)
            .field("infos", &self.infos)
            .finish()
    }
}

impl NamespaceSet {
    /// `(id, device, read_only)` per namespace; at most 256, ids unique (checked by config).
    pub fn new(entries: Vec<(u32, Arc<dyn Device>, bool)>) -> NamespaceSet {
        assert!(entries.len() <= native::NAMESPACE_COUNT_MAX);
        assert!(entries.len() <= usize::from(u16::MAX));
        let mut set = NamespaceSet {
            ids: Vec::new(),
            devices: Vec::new(),
            infos: Vec::new(),
            table: Vec::new(),
            limits: ServerLimits::default(),
            gates: Vec::new(),
        };
        for (id, device, read_only) in entries {
            assert!(!set.ids.contains(&id), "namespace {id} twice");
            let info = device.info().clone();
            assert!(info.block_size <= set.limits.block_size_bytes());
            set.table.push(native::Namespace {
                id,
                size_bytes: info.size_bytes,
                read_only: read_only || info.read_only,
            });
            set.ids.push(id);
            set.devices.push(device);
            set.infos.push(info);
            set.gates.push(WriteGate::new());
        }
        set
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn index_of(&self, id: u32) -> Option<u16> {
        self.ids
            .iter()
            .position(|&known| known == id)
            .map(|index| index as u16)
    }

    pub fn id(&self, index: u16) -> u32 {
        self.ids[usize::from(index)]
    }

    pub fn device(&self, index: u16) -> &Arc<dyn Device> {
        &self.devices[usize::from(index)]
    }

    /// The write ordering of a namespace's read-modify-writes (`crate::gate`).
    pub fn write_gate(&self, index: u16) -> &WriteGate {
        &self.gates[usize::from(index)]
    }

    pub fn info(&self, index: u16) -> &DeviceInfo {
        &self.infos[usize::from(index)]
    }

    pub fn size_bytes(&self, index: u16) -> u64 {
        self.infos[usize::from(index)].size_bytes
    }

    /// Whether writes, trims and write-zeroes are refused (configured so, or the device is).
    pub fn is_read_only(&self, index: u16) -> bool {
        self.table[usize::from(index)].read_only
    }

    /// The table the native codec validates against and HELLO advertises.
    pub fn native_table(&self) -> &[native::Namespace] {
        &self.table
    }

    pub fn limits(&self) -> ServerLimits {
        self.limits
    }
}
