//! The admin queue of an NVMe/TCP controller: Property Get/Set (CAP, VS, CC, CSTS with the
//! enable/ready and shutdown handshakes), Identify, Get Log Page, Get/Set Features, Keep
//! Alive, Asynchronous Event Request (held until an event: a subsystem's namespaces change
//! only when one is removed at run time, which leaves the active list, answers Identify
//! Namespace as inactive and raises the Namespace Attribute Changed notice,
//! `nvme_tcp_events.rs`) and Abort. A discovery controller answers Identify Controller, the
//! discovery log, keep-alive and its features.

use reflex_proto::nvme_tcp::admin::{
    self, ControllerType, IDENTIFY_SIZE, IdentifyController, IdentifyNamespace, SmartLog,
};
use reflex_proto::nvme_tcp::command::{
    admin_opcode, cns, fctype, feature, log_page, property, sgl,
};
use reflex_proto::nvme_tcp::pdu;
use reflex_proto::nvme_tcp::{Command, Status};

use super::Decoded;
use super::nvme_tcp_events::NAMESPACE_ATTRIBUTE_NOTICES;
use super::nvme_tcp_frontend::{ASYNC_EVENTS_HELD_MAX, NvmeTcpFrontend, Outcome, Phase};
use super::nvme_tcp_targets::{
    ControllerState, IN_CAPSULE_DATA_BYTES, MDTS, Subsystem, SubsystemNamespace,
};

/// The NVMe version reflexd reports (VS, Identify Controller VER): 1.3.
pub const NVME_VERSION: u32 = 0x0001_0300;
/// Most bytes one Get Log Page returns.
pub const LOG_BYTES_MAX: u64 = 64 << 10;
/// CAP.TO: the host waits up to 7.5 s for CSTS.RDY.
const READY_TIMEOUT_500MS: u8 = 15;

impl NvmeTcpFrontend {
    fn admin(&mut self) -> Option<&mut super::nvme_tcp_frontend::AdminState> {
        match &mut self.phase {
            Phase::Queue(queue) => queue.admin.as_deref_mut(),
            _ => None,
        }
    }

    fn subsystem(&self) -> Option<&Subsystem> {
        match &self.phase {
            Phase::Queue(queue) => queue
                .controller
                .subsystem
                .and_then(|index| self.targets.subsystems.get(index)),
            _ => None,
        }
    }

    /// Namespace `nsid` of the controller's subsystem, unless it was removed at run time.
    fn live_namespace(&self, nsid: u32) -> Option<&SubsystemNamespace> {
        self.subsystem()?
            .namespace(nsid)
            .map(|(_, namespace)| namespace)
            .filter(|namespace| !self.removed.contains(&namespace.namespace_index))
    }

    fn is_discovery(&self) -> bool {
        matches!(&self.phase, Phase::Queue(queue) if queue.controller.subsystem.is_none())
    }

    pub(super) fn admin_capsule(
        &mut self,
        command: Command,
        decoded: &pdu::Decoded,
        input: &[u8],
    ) -> Decoded {
        let cid = command.cid();
        let header_bytes = decoded.header_bytes;
        let skip = (decoded.total_bytes - header_bytes) as u64;
        let opcode = command.opcode();
        if opcode == admin_opcode::FABRICS {
            let outcome = match command.fctype() {
                fctype::PROPERTY_GET => self.property_get(command),
                fctype::PROPERTY_SET => self.property_set(command),
                fctype::CONNECT => Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR),
                _ => Outcome::status(cid, Status::INVALID_OPCODE),
            };
            return self.respond(outcome, header_bytes, skip);
        }
        let ready = self
            .admin()
            .is_some_and(|admin| admin.csts & property::CSTS_RDY != 0);
        if !ready {
            return self.respond(
                Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR),
                header_bytes,
                skip,
            );
        }
        let outcome = match opcode {
            admin_opcode::IDENTIFY => self.identify(command),
            admin_opcode::GET_LOG_PAGE => self.get_log_page(command),
            admin_opcode::SET_FEATURES => {
                if decoded.data.is_some() || command.sgl().length > 0 {
                    return self.with_command_data(command, decoded, input);
                }
                self.set_features(command)
            }
            admin_opcode::GET_FEATURES => self.get_features(command),
            admin_opcode::KEEP_ALIVE => {
                if let Some(admin) = self.admin() {
                    admin.alive_noted = true;
                }
                Outcome::status(cid, Status::SUCCESS)
            }
            admin_opcode::ASYNC_EVENT_REQUEST => {
                let held = match self.admin() {
                    Some(admin) if admin.events_held.len() < ASYNC_EVENTS_HELD_MAX => {
                        admin.events_held.push(cid);
                        true
                    }
                    _ => false,
                };
                if held {
                    // An event generated while no request was held goes out on this one.
                    self.report_async_event();
                    Outcome::Nothing
                } else {
                    Outcome::status(cid, Status::ASYNC_EVENT_LIMIT_EXCEEDED)
                }
            }
            // Abort: the command was not aborted (dw0 bit 0); every command finishes.
            admin_opcode::ABORT => Outcome::success(cid, 1),
            _ => Outcome::status(cid, Status::INVALID_OPCODE),
        };
        self.respond(outcome, header_bytes, skip)
    }

    /// An admin command with the data the frontend fetched for it.
    pub(super) fn admin_with_data(&mut self, command: Command, _data: &[u8]) -> Outcome {
        match command.opcode() {
            admin_opcode::SET_FEATURES => self.set_features(command),
            admin_opcode::FABRICS => Outcome::status(command.cid(), Status::COMMAND_SEQUENCE_ERROR),
            _ => Outcome::status(command.cid(), Status::INVALID_OPCODE),
        }
    }

    fn property_get(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        let queue_entries_max = self.targets.options.queue_entries_max;
        let Some(admin) = self.admin() else {
            return Outcome::status(cid, Status::INVALID_OPCODE);
        };
        let value: u64 = match command.property_offset() {
            property::CAP => admin::capabilities(queue_entries_max, READY_TIMEOUT_500MS),
            property::VS => u64::from(NVME_VERSION),
            property::CC => u64::from(admin.cc),
            property::CSTS => u64::from(admin.csts),
            _ => return Outcome::status(cid, Status::INVALID_FIELD),
        };
        Outcome::Complete {
            cid,
            status: Status::SUCCESS,
            dw0: value as u32,
            dw1: (value >> 32) as u32,
        }
    }

    /// Property Set: only CC is writable. EN 0→1 readies the controller (if the entry sizes
    /// are NVMe's), 1→0 resets it; a shutdown notification flushes every namespace of the
    /// subsystem, then reports the shutdown complete.
    fn property_set(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        if command.property_offset() != property::CC {
            return Outcome::status(cid, Status::INVALID_FIELD);
        }
        let Phase::Queue(queue) = &mut self.phase else {
            return Outcome::status(cid, Status::INVALID_OPCODE);
        };
        let controller = std::sync::Arc::clone(&queue.controller);
        let Some(admin) = queue.admin.as_deref_mut() else {
            return Outcome::status(cid, Status::INVALID_OPCODE);
        };
        let new = command.property_value() as u32;
        let old = std::mem::replace(&mut admin.cc, new);
        let enable = new & property::CC_EN != 0;
        let was_enabled = old & property::CC_EN != 0;
        if enable && !was_enabled {
            let iosqes = (new >> property::CC_IOSQES_SHIFT) & 0xF;
            let iocqes = (new >> property::CC_IOCQES_SHIFT) & 0xF;
            // A discovery controller has no I/O queues: entry sizes may be 0.
            let sizes_ok = (iosqes == 6 && iocqes == 4)
                || (controller.subsystem.is_none() && iosqes == 0 && iocqes == 0);
            if sizes_ok {
                admin.csts = property::CSTS_RDY;
                controller.set_state(ControllerState::Ready);
            } else {
                admin.csts = property::CSTS_CFS;
            }
        } else if !enable && was_enabled {
            admin.csts = 0;
            controller.set_state(ControllerState::Disabled);
        }
        let shutdown = new & property::CC_SHN_MASK != 0;
        let was_shutdown = old & property::CC_SHN_MASK != 0;
        if shutdown && !was_shutdown {
            admin.csts = (admin.csts & !property::CSTS_SHST_MASK) | property::SHST_OCCURRING;
            controller.set_state(ControllerState::ShuttingDown);
            if !self.queue_shutdown_flushes(cid) {
                self.shutdown_flushed();
            }
        }
        Outcome::status(cid, Status::SUCCESS)
    }

    /// The shutdown's flushes are done: CSTS.SHST says complete.
    pub(super) fn shutdown_flushed(&mut self) {
        if let Some(admin) = self.admin() {
            admin.csts = (admin.csts & !property::CSTS_SHST_MASK) | property::SHST_COMPLETE;
        }
    }

    /// Bytes the command's data descriptor lets the target send, or why not.
    fn transfer_length(command: &Command) -> Result<usize, Status> {
        let descriptor = command.sgl();
        if descriptor.identifier != sgl::TRANSPORT_DATA_BLOCK {
            return Err(Status::SGL_TYPE_INVALID);
        }
        Ok(descriptor.length as usize)
    }

    fn identify(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        let length = match Self::transfer_length(&command) {
            Ok(length) => length.min(IDENTIFY_SIZE),
            Err(status) => return Outcome::status(cid, status),
        };
        let mut page = [0u8; IDENTIFY_SIZE];
        let discovery = self.is_discovery();
        let cns = (command.cdw10() & 0xFF) as u8;
        let status = match cns {
            cns::CONTROLLER => {
                self.identify_controller().encode(&mut page);
                Status::SUCCESS
            }
            _ if discovery => Status::INVALID_FIELD,
            cns::NAMESPACE => self.identify_namespace(command.nsid(), &mut page),
            cns::ACTIVE_NAMESPACES => {
                let ids: Vec<u32> = self
                    .subsystem()
                    .map(|s| {
                        s.namespaces
                            .iter()
                            .filter(|n| !self.removed.contains(&n.namespace_index))
                            .map(|n| n.nsid)
                            .collect()
                    })
                    .unwrap_or_default();
                if command.nsid() >= 0xFFFF_FFFE {
                    Status::INVALID_NAMESPACE
                } else {
                    admin::encode_active_namespaces(&ids, command.nsid(), &mut page);
                    Status::SUCCESS
                }
            }
            cns::NAMESPACE_DESCRIPTORS => {
                match self
                    .live_namespace(command.nsid())
                    .map(|namespace| namespace.nguid)
                {
                    Some(nguid) => {
                        let mut uuid = nguid;
                        uuid[6] = (uuid[6] & 0x0F) | 0x80; // a name-based UUID (version 8)
                        uuid[8] = (uuid[8] & 0x3F) | 0x80;
                        admin::encode_namespace_descriptors(&nguid, &uuid, &mut page);
                        Status::SUCCESS
                    }
                    None => Status::INVALID_NAMESPACE,
                }
            }
            _ => Status::INVALID_FIELD,
        };
        if !status.is_success() {
            return Outcome::status(cid, status);
        }
        self.output_data(cid, &page[..length], Status::SUCCESS, 0);
        Outcome::Output
    }

    fn identify_controller(&self) -> IdentifyController {
        let Phase::Queue(queue) = &self.phase else {
            unreachable!("identify on a connected admin queue");
        };
        let options = &self.targets.options;
        let subsystem = self.subsystem();
        IdentifyController {
            vendor_id: 0,
            serial: options.serial.clone(),
            model: options.model.clone(),
            firmware: env!("CARGO_PKG_VERSION").to_string(),
            mdts: MDTS,
            cntlid: queue.controller.cntlid,
            version: NVME_VERSION,
            // Namespace attribute notices, on I/O controllers (`nvme_tcp_events.rs`).
            oaes: if subsystem.is_some() {
                NAMESPACE_ATTRIBUTE_NOTICES
            } else {
                0
            },
            controller_type: if subsystem.is_some() {
                ControllerType::Io
            } else {
                ControllerType::Discovery
            },
            aerl: (ASYNC_EVENTS_HELD_MAX - 1) as u8,
            lpa: 1 << 2,
            elpe: 0,
            kas: 1,
            maxcmd: options.queue_entries_max,
            nn: subsystem
                .map(|s| s.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0))
                .unwrap_or(0),
            // Dataset Management and Write Zeroes.
            oncs: if subsystem.is_some() { 0b1100 } else { 0 },
            // A volatile write cache (Flush matters); no flush of all namespaces at once.
            vwc: if subsystem.is_some() { 0b101 } else { 0 },
            sgls: 1 | (1 << 20),
            subsystem_nqn: subsystem.map_or_else(
                || reflex_proto::nvme_tcp::command::DISCOVERY_NQN.to_string(),
                |s| s.nqn.clone(),
            ),
            ioccsz: (64 + IN_CAPSULE_DATA_BYTES) / 16,
            iorcsz: 1,
            msdbd: 1,
            cmic: if subsystem.is_some() { 1 << 1 } else { 0 },
        }
    }

    fn identify_namespace(&self, nsid: u32, page: &mut [u8; IDENTIFY_SIZE]) -> Status {
        let Some(subsystem) = self.subsystem() else {
            return Status::INVALID_NAMESPACE;
        };
        let Some(namespace) = self.live_namespace(nsid) else {
            let highest = subsystem
                .namespaces
                .iter()
                .map(|n| n.nsid)
                .max()
                .unwrap_or(0);
            if (1..=highest).contains(&nsid) {
                // An inactive namespace id: zeroes.
                page.fill(0);
                return Status::SUCCESS;
            }
            return Status::INVALID_NAMESPACE;
        };
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&namespace.nguid[8..]);
        IdentifyNamespace {
            size_blocks: namespace.size_bytes / u64::from(namespace.block_size),
            block_size_log2: namespace.block_size.trailing_zeros() as u8,
            features: u8::from(namespace.discards),
            nmic: 1,
            // Deallocated blocks read as zeroes, and Write Zeroes may deallocate, where the
            // device discards.
            dlfeat: if namespace.discards { 0b1001 } else { 0 },
            nguid: namespace.nguid,
            eui64,
        }
        .encode(page);
        Status::SUCCESS
    }

    fn get_log_page(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        let lid = (command.cdw10() & 0xFF) as u8;
        let dwords =
            ((u64::from(command.cdw11() & 0xFFFF) << 16) | u64::from(command.cdw10() >> 16)) + 1;
        let length = dwords * 4;
        let offset = (u64::from(command.cdw13()) << 32) | u64::from(command.cdw12());
        if length > LOG_BYTES_MAX || !offset.is_multiple_of(4) {
            return Outcome::status(cid, Status::INVALID_FIELD);
        }
        match Self::transfer_length(&command) {
            Ok(available) if available as u64 >= length => {}
            Ok(_) => return Outcome::status(cid, Status::SGL_DATA_LENGTH_INVALID),
            Err(status) => return Outcome::status(cid, status),
        }
        let discovery = self.is_discovery();
        let log: Vec<u8> = match lid {
            log_page::DISCOVERY if discovery => {
                let host = match &self.phase {
                    Phase::Queue(queue) => queue.controller.host_nqn.clone(),
                    _ => String::new(),
                };
                let entries = self.targets.discovery_entries(&host);
                let mut log = vec![0u8; admin::discovery_log_size(entries.len())];
                admin::encode_discovery_log(1, &entries, &mut log);
                log
            }
            log_page::ERROR_INFORMATION => vec![0u8; admin::ERROR_LOG_ENTRY_SIZE],
            log_page::SMART_HEALTH if !discovery => {
                let mut log = [0u8; admin::SMART_LOG_SIZE];
                SmartLog {
                    temperature_kelvin: 298,
                    available_spare_percent: 100,
                    ..SmartLog::default()
                }
                .encode(&mut log);
                log.to_vec()
            }
            log_page::FIRMWARE_SLOT if !discovery => {
                let mut log = vec![0u8; 512];
                log[0] = 1; // slot 1 active
                let version = env!("CARGO_PKG_VERSION").as_bytes();
                for (index, byte) in log[8..16].iter_mut().enumerate() {
                    *byte = version.get(index).copied().unwrap_or(b' ');
                }
                log
            }
            log_page::CHANGED_NAMESPACES if !discovery => {
                // Cleared on read; RAE (CDW10 bit 15) keeps the event masked.
                let retain_event = command.cdw10() & (1 << 15) != 0;
                match self.admin() {
                    Some(admin) => admin.namespace_changes.read_log(retain_event),
                    None => vec![0u8; admin::CHANGED_NAMESPACES_LOG_SIZE],
                }
            }
            _ => return Outcome::status(cid, Status::INVALID_LOG_PAGE),
        };
        let mut data = vec![0u8; length as usize];
        if let Some(available) = log.get(offset.min(log.len() as u64) as usize..) {
            let copied = available.len().min(data.len());
            data[..copied].copy_from_slice(&available[..copied]);
        }
        self.output_data(cid, &data, Status::SUCCESS, 0);
        Outcome::Output
    }

    fn get_features(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        let fid = (command.cdw10() & 0xFF) as u8;
        let discovery = self.is_discovery();
        let granted = match &self.phase {
            Phase::Queue(queue) => queue.controller.granted_io_queues(),
            _ => 0,
        };
        let Some(admin) = self.admin() else {
            return Outcome::status(cid, Status::INVALID_OPCODE);
        };
        let value = match fid {
            feature::KEEP_ALIVE_TIMER => admin
                .keep_alive
                .map_or(0, |timeout| (timeout.0 / 1_000_000) as u32),
            feature::ASYNC_EVENT_CONFIGURATION => admin.async_event_config,
            _ if discovery => return Outcome::status(cid, Status::INVALID_FIELD),
            feature::NUMBER_OF_QUEUES => {
                let zero_based = u32::from(granted.saturating_sub(1));
                zero_based | (zero_based << 16)
            }
            feature::VOLATILE_WRITE_CACHE => 1,
            feature::TEMPERATURE_THRESHOLD => {
                match TemperatureSelection::decode(command.cdw11(), false) {
                    Some(selection) => {
                        let threshold = admin.temperature_thresholds[selection.threshold];
                        u32::from(threshold) | (command.cdw11() & SELECTION_BITS)
                    }
                    None => return Outcome::status(cid, Status::INVALID_FIELD),
                }
            }
            feature::ARBITRATION | feature::POWER_MANAGEMENT | feature::ERROR_RECOVERY => {
                admin.plain_features[usize::from(fid)]
            }
            _ => return Outcome::status(cid, Status::INVALID_FIELD),
        };
        Outcome::success(cid, value)
    }

    fn set_features(&mut self, command: Command) -> Outcome {
        let cid = command.cid();
        let fid = (command.cdw10() & 0xFF) as u8;
        if command.cdw10() & (1 << 31) != 0 {
            return Outcome::status(cid, Status::FEATURE_NOT_SAVEABLE);
        }
        let discovery = self.is_discovery();
        let io_queues_max = self.targets.options.io_queues_max;
        let keep_alive_min = self.targets.options.keep_alive_timeout_min;
        let Phase::Queue(queue) = &mut self.phase else {
            return Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR);
        };
        let controller = std::sync::Arc::clone(&queue.controller);
        let Some(admin) = queue.admin.as_deref_mut() else {
            return Outcome::status(cid, Status::INVALID_OPCODE);
        };
        let value = command.cdw11();
        match fid {
            feature::KEEP_ALIVE_TIMER => {
                admin.keep_alive = (value > 0)
                    .then(|| reflex_qos::Nanos(u64::from(value) * 1_000_000).max(keep_alive_min));
                admin.alive_noted = true;
                Outcome::status(cid, Status::SUCCESS)
            }
            feature::ASYNC_EVENT_CONFIGURATION => {
                admin.async_event_config = value;
                Outcome::status(cid, Status::SUCCESS)
            }
            _ if discovery => Outcome::status(cid, Status::INVALID_FIELD),
            feature::NUMBER_OF_QUEUES => {
                let (submission, completion) = (value & 0xFFFF, value >> 16);
                if submission == 0xFFFF || completion == 0xFFFF {
                    return Outcome::status(cid, Status::INVALID_FIELD);
                }
                let wanted = submission.max(completion) as u16 + 1;
                match controller.grant_io_queues(wanted, io_queues_max) {
                    Some(granted) => {
                        let zero_based = u32::from(granted - 1);
                        Outcome::success(cid, zero_based | (zero_based << 16))
                    }
                    None => Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR),
                }
            }
            feature::VOLATILE_WRITE_CACHE if value & 1 == 1 => {
                Outcome::status(cid, Status::SUCCESS)
            }
            feature::VOLATILE_WRITE_CACHE => Outcome::status(cid, Status::FEATURE_NOT_CHANGEABLE),
            feature::TEMPERATURE_THRESHOLD => match TemperatureSelection::decode(value, true) {
                Some(selection) => {
                    admin.temperature_thresholds[selection.threshold] = (value & 0xFFFF) as u16;
                    Outcome::status(cid, Status::SUCCESS)
                }
                None => Outcome::status(cid, Status::INVALID_FIELD),
            },
            feature::ARBITRATION | feature::POWER_MANAGEMENT | feature::ERROR_RECOVERY => {
                admin.plain_features[usize::from(fid)] = value;
                Outcome::status(cid, Status::SUCCESS)
            }
            _ => Outcome::status(cid, Status::INVALID_FIELD),
        }
    }
}

/// Temperature Threshold's TMPSEL (bits 19:16) and THSEL (bits 21:20) in Dword 11.
const SELECTION_BITS: u32 = 0x003F_0000;

/// Which threshold a Temperature Threshold command names: only the composite sensor exists.
struct TemperatureSelection {
    /// 0: over-temperature, 1: under-temperature.
    threshold: usize,
}

impl TemperatureSelection {
    /// `None` for a sensor this controller lacks or a reserved THSEL (Invalid Field). A Set
    /// may name every sensor (TMPSEL Fh), which here is the composite one.
    fn decode(dword11: u32, set: bool) -> Option<TemperatureSelection> {
        let sensor = (dword11 >> 16) & 0xF;
        let threshold = ((dword11 >> 20) & 0x3) as usize;
        let sensor_known = sensor == 0 || (set && sensor == 0xF);
        (sensor_known && threshold <= 1).then_some(TemperatureSelection { threshold })
    }
}
