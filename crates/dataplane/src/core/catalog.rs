//! Namespaces added and removed at run time (`crate::namespaces`, `crate::control`): this
//! thread adopts the control plane's catalog, grows its per-namespace state for a new slot and
//! asks the driver to open the slot's device queue before any request can reach it, and, for a
//! slot being removed, closes the queue and tells the control plane once no request of this
//! thread uses the slot any more.
//!
//! Invariants: the driver sees [`Op::OpenDevice`] for a slot before any [`Op::Device`] of it,
//! and [`Op::CloseDevice`] only when no request of this thread refers to the slot and the
//! flush this thread issued for it (what it wrote reaches stable storage before the device
//! closes) has finished, so no operation of the slot is outstanding; a slot that is not live
//! is refused at [`Dataplane::charge`] (the protocol's "no such namespace").

use std::sync::Arc;

use reflex_qos::Nanos;

use super::request::Work;
use super::tenants::NamespaceQos;
use super::{Dataplane, DeviceCommand, DeviceOpId, DeviceOpKind, NamespaceTelemetry, Op};
use crate::namespaces::SlotState;

impl Dataplane {
    /// Adopts the control plane's catalog (a [`crate::control::ControlMessage::Namespaces`]).
    pub(super) fn adopt_catalog(&mut self, now: Nanos) {
        let Some(catalog) = self.control.catalog() else {
            return;
        };
        let namespaces = catalog.namespaces;
        for index in self.qos.len()..namespaces.len() {
            let namespace_index = index as u16;
            let Some(setup) = self.control.qos_setup(namespace_index) else {
                tracing::error!(
                    namespace_index,
                    "no scheduler setup for a new namespace slot"
                );
                break;
            };
            let shared = std::sync::Arc::clone(&setup.shared);
            let scheduler = match reflex_qos::Scheduler::new(
                setup.shared,
                self.thread_index as u16,
                &self.qos_config,
                setup.policy,
                now,
            ) {
                Ok(scheduler) => scheduler,
                Err(error) => {
                    tracing::error!(namespace_index, %error, "scheduler for a new namespace refused");
                    break;
                }
            };
            let fair = match reflex_qos::FairQueue::new(&self.qos_config.fairness, now) {
                Ok(fair) => fair,
                Err(error) => {
                    tracing::error!(namespace_index, %error, "fairness stage for a new namespace refused");
                    break;
                }
            };
            let id = namespaces.id(namespace_index);
            let migrator =
                reflex_qos::Migrator::new(&self.qos_config.fairness.migration, self.thread_index);
            if migrator.is_enabled() {
                shared
                    .migration_board()
                    .join(self.thread_index, fair.depth_max());
            }
            self.qos.push(NamespaceQos {
                scheduler,
                fair,
                migrator,
                shared,
                loads: Vec::new(),
                default_tenant: setup.default_tenant,
                namespace_id: id,
                accounts: Vec::new(),
            });
            self.telemetry.push(NamespaceTelemetry::default());
            self.discards
                .push(namespaces.info(namespace_index).supports_trim);
            self.device_errors.add_namespace(id);
            self.live.add_namespace();
            let live = namespaces.state(namespace_index) != SlotState::Gone;
            self.queues_open.push(live);
            if live {
                self.ops.push_back(Op::OpenDevice { namespace_index });
            }
            if namespaces.state(namespace_index) == SlotState::Removing {
                self.draining.push(namespace_index);
            }
        }
        for index in 0..self.qos.len().min(namespaces.len()) {
            let namespace_index = index as u16;
            if namespaces.state(namespace_index) != SlotState::Live
                && self.namespaces.is_live(namespace_index)
                && !self.draining.contains(&namespace_index)
            {
                self.draining.push(namespace_index);
            }
        }
        self.namespaces = Arc::clone(&namespaces);
        self.nbd_exports = catalog.nbd_exports;
        self.notify_nvme_controllers();
        self.check_drained(now);
    }

    /// Lets every NVMe/TCP connection see the new namespace set now, not at its next PDU:
    /// an idle admin queue holding an Asynchronous Event Request is told at once that a
    /// namespace left the active list, and its completion is parsed out as output.
    fn notify_nvme_controllers(&mut self) {
        for index in 0..self.connections.len() {
            let connection = &mut self.connections[index];
            if !connection.is_open() {
                continue;
            }
            if let crate::frontend::Frontend::NvmeTcp(nvme) = &mut connection.frontend {
                nvme.follow_namespaces(&self.namespaces);
                if nvme.has_output() {
                    self.mark_parse(index as u32);
                }
            }
        }
    }

    /// Moves every slot being removed on: once no request of this thread refers to it, a
    /// flush of its device; once that has finished, its queue closes and the control plane
    /// hears that this thread is done with it.
    pub(super) fn check_drained(&mut self, now: Nanos) {
        if self.draining.is_empty() && self.flushed.is_empty() {
            return;
        }
        while let Some(namespace_index) = self.flushed.pop() {
            // Its flush was the slot's last operation here: nothing of it is outstanding.
            self.close_queue(namespace_index);
            self.report_drained(namespace_index, now);
        }
        let mut index = 0;
        while index < self.draining.len() {
            let namespace_index = self.draining[index];
            if self.slot_in_use(namespace_index) {
                index += 1;
                continue;
            }
            self.draining.swap_remove(index);
            let open = self
                .queues_open
                .get(usize::from(namespace_index))
                .copied()
                .unwrap_or(false);
            if open && self.phase == super::Phase::Running {
                self.flushes_pending += 1;
                self.flushing.push(namespace_index);
                self.ops.push_back(Op::Device(DeviceCommand {
                    id: DeviceOpId::ShutdownFlush { namespace_index },
                    namespace_index,
                    queue: 0,
                    kind: DeviceOpKind::Flush,
                }));
            } else {
                // Shutting down: the shutdown's flush covers the device (it may be in flight
                // now), and the queue closes when the thread ends.
                self.report_drained(namespace_index, now);
            }
        }
    }

    /// The flush of a slot being removed finished (`handle_device`).
    pub(super) fn on_removal_flush(&mut self, namespace_index: u16) -> bool {
        let Some(position) = self.flushing.iter().position(|&n| n == namespace_index) else {
            return false;
        };
        self.flushing.swap_remove(position);
        self.flushed.push(namespace_index);
        true
    }

    fn close_queue(&mut self, namespace_index: u16) {
        if let Some(open) = self.queues_open.get_mut(usize::from(namespace_index))
            && *open
        {
            *open = false;
            self.ops.push_back(Op::CloseDevice { namespace_index });
        }
    }

    fn report_drained(&mut self, namespace_index: u16, now: Nanos) {
        self.with_control(now, |control, thread, own| {
            control.namespace_drained(thread, namespace_index, own);
        });
    }

    /// Whether a request of this thread refers to slot `namespace_index` (admitted and waiting
    /// for a buffer, at the write gate or the scheduler, on the device, or being sent).
    fn slot_in_use(&self, namespace_index: u16) -> bool {
        self.live
            .device_in_flight
            .get(usize::from(namespace_index))
            .is_some_and(|&n| n > 0)
            || self.requests.iter().any(|request| match request.work {
                Work::Io { io, .. }
                | Work::Part { io, .. }
                | Work::Start(crate::frontend::Action::Io(io)) => {
                    io.namespace_index == namespace_index
                }
                _ => false,
            })
    }

    /// Slots this thread has not drained yet (tests).
    pub fn namespaces_draining(&self) -> usize {
        self.draining.len() + self.flushing.len() + self.flushed.len()
    }

    /// Slots whose removal flush is in flight on this thread (the shutdown's flush skips them:
    /// one flush per slot at a time).
    pub(super) fn removal_flush_in_flight(&self, namespace_index: u16) -> bool {
        self.flushing.contains(&namespace_index)
    }

    /// The namespaces this thread serves now (a driver opens a new slot's device queue from
    /// here on [`Op::OpenDevice`]).
    pub fn namespaces(&self) -> &Arc<crate::namespaces::NamespaceSet> {
        &self.namespaces
    }
}
