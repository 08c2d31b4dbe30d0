//! Namespaces added and removed at run time (`crate::namespaces`, `crate::control`): this
//! thread adopts the control plane's catalog, grows its per-namespace state for a new slot and
//! asks the driver to open the slot's device queue before any request can reach it, and, for a
//! slot being removed, closes the queue and tells the control plane once no request of this
//! thread uses the slot any more.
//!
//! Invariants: the driver sees [`Op::OpenDevice`] for a slot before any [`Op::Device`] of it,
//! and [`Op::CloseDevice`] only when no request of this thread refers to the slot; a slot that
//! is not live is refused at [`Dataplane::charge`] (the protocol's "no such namespace").

use std::sync::Arc;

use reflex_qos::Nanos;

use super::request::Work;
use super::tenants::NamespaceQos;
use super::{Dataplane, NamespaceTelemetry, Op};
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
            let id = namespaces.id(namespace_index);
            self.qos.push(NamespaceQos {
                scheduler,
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
        self.check_drained(now);
    }

    /// Closes the device queue of every slot being removed that no request of this thread
    /// refers to any more, and tells the control plane.
    pub(super) fn check_drained(&mut self, now: Nanos) {
        if self.draining.is_empty() {
            return;
        }
        let mut index = 0;
        while index < self.draining.len() {
            let namespace_index = self.draining[index];
            if self.slot_in_use(namespace_index) {
                index += 1;
                continue;
            }
            self.draining.swap_remove(index);
            if let Some(open) = self.queues_open.get_mut(usize::from(namespace_index))
                && *open
            {
                *open = false;
                self.ops.push_back(Op::CloseDevice { namespace_index });
            }
            self.with_control(now, |control, thread, own| {
                control.namespace_drained(thread, namespace_index, own);
            });
        }
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
        self.draining.len()
    }

    /// The namespaces this thread serves now (a driver opens a new slot's device queue from
    /// here on [`Op::OpenDevice`]).
    pub fn namespaces(&self) -> &Arc<crate::namespaces::NamespaceSet> {
        &self.namespaces
    }
}
