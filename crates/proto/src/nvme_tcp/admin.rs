//! The data admin commands return: Identify (controller, namespace, active namespace list,
//! namespace identification descriptors), log pages (error information, SMART / health,
//! changed namespaces, the discovery log) and the CAP property. Encoders write into a
//! caller's 4096-byte page (or, for the discovery log, a buffer sized by
//! [`discovery_log_size`]); decoders for the host side read the fields an initiator needs.

use crate::wire::{Fields, FieldsMut};

/// Bytes of an Identify data structure.
pub const IDENTIFY_SIZE: usize = 4096;
/// Bytes of the SMART / health log page.
pub const SMART_LOG_SIZE: usize = 512;
/// Bytes of one error information log entry.
pub const ERROR_LOG_ENTRY_SIZE: usize = 64;
/// Bytes of the changed namespace list log page.
pub const CHANGED_NAMESPACES_LOG_SIZE: usize = 4096;
/// Bytes of the discovery log page's header, and of each of its entries.
pub const DISCOVERY_HEADER_SIZE: usize = 1024;
pub const DISCOVERY_ENTRY_SIZE: usize = 1024;

/// Writes `text` into a fixed ASCII field, padded with spaces (serial, model, firmware).
fn put_ascii(out: &mut [u8], text: &str) {
    for (index, byte) in out.iter_mut().enumerate() {
        *byte = text.as_bytes().get(index).copied().unwrap_or(b' ');
    }
}

/// Writes `text` into a NUL-padded string field (NQNs, transport addresses), cut to leave a
/// NUL at the end.
fn put_string(out: &mut [u8], text: &str) {
    out.fill(0);
    let length = text.len().min(out.len().saturating_sub(1));
    out[..length].copy_from_slice(&text.as_bytes()[..length]);
}

fn read_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end])
        .trim_end()
        .to_string()
}

/// Kinds of controller (CNTRLTYPE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllerType {
    Io = 1,
    Discovery = 2,
}

/// What Identify Controller reports (the fields a host uses; the rest are 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifyController {
    pub vendor_id: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// MDTS: largest transfer is `2^mdts` × 4 KiB (0: no limit).
    pub mdts: u8,
    pub cntlid: u16,
    /// VER, as the VS property.
    pub version: u32,
    /// OAES: asynchronous events the controller sends (bit 8: namespace attribute notices).
    pub oaes: u32,
    pub controller_type: ControllerType,
    /// AERL: outstanding Asynchronous Event Requests, 0's based.
    pub aerl: u8,
    /// LPA: log page attributes (bit 2: extended Get Log Page).
    pub lpa: u8,
    /// ELPE: error log entries, 0's based.
    pub elpe: u8,
    /// KAS: keep-alive granularity in 100 ms units (0: keep-alive unsupported).
    pub kas: u16,
    /// MAXCMD: outstanding commands per queue.
    pub maxcmd: u16,
    /// NN: the largest namespace id.
    pub nn: u32,
    /// ONCS: optional NVM commands (bit 2 Dataset Management, bit 3 Write Zeroes).
    pub oncs: u16,
    /// VWC: volatile write cache (bit 0 present; bits 2:1 flush to all namespaces).
    pub vwc: u8,
    /// SGLS: SGL support (bit 0 SGLs, bit 20 in-capsule data with an offset).
    pub sgls: u32,
    pub subsystem_nqn: String,
    /// IOCCSZ: I/O queue command capsule size in 16-byte units (the 64-byte command and the
    /// in-capsule data).
    pub ioccsz: u32,
    /// IORCSZ: I/O queue response capsule size in 16-byte units.
    pub iorcsz: u32,
    /// MSDBD: SGL data block descriptors per command.
    pub msdbd: u8,
    /// CMIC: bit 1, the subsystem may have several controllers.
    pub cmic: u8,
}

impl IdentifyController {
    pub fn encode(&self, out: &mut [u8; IDENTIFY_SIZE]) {
        out.fill(0);
        {
            let mut f = FieldsMut(out);
            f.put_u16_le::<0>(self.vendor_id);
            f.put_u16_le::<2>(self.vendor_id);
        }
        put_ascii(&mut out[4..24], &self.serial);
        put_ascii(&mut out[24..64], &self.model);
        put_ascii(&mut out[64..72], &self.firmware);
        let mut f = FieldsMut(out);
        f.put_u8::<72>(0); // RAB
        f.put_u8::<76>(self.cmic);
        f.put_u8::<77>(self.mdts);
        f.put_u16_le::<78>(self.cntlid);
        f.put_u32_le::<80>(self.version);
        f.put_u32_le::<92>(self.oaes);
        f.put_u8::<111>(self.controller_type as u8);
        f.put_u8::<259>(self.aerl);
        f.put_u8::<261>(self.lpa);
        f.put_u8::<262>(self.elpe);
        // Composite temperature thresholds (kelvin): warning and critical.
        f.put_u16_le::<266>(WARNING_TEMPERATURE_KELVIN);
        f.put_u16_le::<268>(CRITICAL_TEMPERATURE_KELVIN);
        f.put_u16_le::<320>(self.kas);
        f.put_u8::<512>(0x66); // SQES: 64-byte entries.
        f.put_u8::<513>(0x44); // CQES: 16-byte entries.
        f.put_u16_le::<514>(self.maxcmd);
        f.put_u32_le::<516>(self.nn);
        f.put_u16_le::<520>(self.oncs);
        f.put_u8::<525>(self.vwc);
        f.put_u32_le::<536>(self.sgls);
        f.put_u32_le::<1792>(self.ioccsz);
        f.put_u32_le::<1796>(self.iorcsz);
        f.put_u16_le::<1800>(0); // ICDOFF
        f.put_u8::<1802>(0); // FCATT: dynamic controller model.
        f.put_u8::<1803>(self.msdbd);
        f.put_u16_le::<1804>(0); // OFCS
        put_string(&mut out[768..1024], &self.subsystem_nqn);
    }

    /// The fields an initiator reads.
    pub fn decode(bytes: &[u8; IDENTIFY_SIZE]) -> IdentifyController {
        let f = Fields(bytes);
        IdentifyController {
            vendor_id: f.u16_le::<0>(),
            serial: read_string(&bytes[4..24]),
            model: read_string(&bytes[24..64]),
            firmware: read_string(&bytes[64..72]),
            mdts: f.u8_at::<77>(),
            cntlid: f.u16_le::<78>(),
            version: f.u32_le::<80>(),
            oaes: f.u32_le::<92>(),
            controller_type: if f.u8_at::<111>() == 2 {
                ControllerType::Discovery
            } else {
                ControllerType::Io
            },
            aerl: f.u8_at::<259>(),
            lpa: f.u8_at::<261>(),
            elpe: f.u8_at::<262>(),
            kas: f.u16_le::<320>(),
            maxcmd: f.u16_le::<514>(),
            nn: f.u32_le::<516>(),
            oncs: f.u16_le::<520>(),
            vwc: f.u8_at::<525>(),
            sgls: f.u32_le::<536>(),
            subsystem_nqn: read_string(&bytes[768..1024]),
            ioccsz: f.u32_le::<1792>(),
            iorcsz: f.u32_le::<1796>(),
            msdbd: f.u8_at::<1803>(),
            cmic: f.u8_at::<76>(),
        }
    }
}

/// What Identify Namespace reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// Size, capacity and utilisation in logical blocks.
    pub size_blocks: u64,
    /// log2 of the logical block size (9: 512 bytes).
    pub block_size_log2: u8,
    /// NSFEAT (bit 0: thin provisioning, deallocation supported).
    pub features: u8,
    /// NMIC: bit 0, shared by several controllers.
    pub nmic: u8,
    /// DLFEAT: bits 2:0 what deallocated blocks read (1: zeroes); bit 3 Write Zeroes may
    /// deallocate.
    pub dlfeat: u8,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
}

impl IdentifyNamespace {
    pub fn encode(&self, out: &mut [u8; IDENTIFY_SIZE]) {
        out.fill(0);
        let mut f = FieldsMut(out);
        f.put_u64_le::<0>(self.size_blocks);
        f.put_u64_le::<8>(self.size_blocks);
        f.put_u64_le::<16>(self.size_blocks);
        f.put_u8::<24>(self.features);
        f.put_u8::<25>(0); // NLBAF: one format.
        f.put_u8::<26>(0); // FLBAS: format 0.
        f.put_u8::<30>(self.nmic);
        f.put_u8::<33>(self.dlfeat);
        f.put_bytes::<104, 16>(&self.nguid);
        f.put_bytes::<120, 8>(&self.eui64);
        f.put_u32_le::<128>(u32::from(self.block_size_log2) << 16);
    }

    pub fn decode(bytes: &[u8; IDENTIFY_SIZE]) -> IdentifyNamespace {
        let f = Fields(bytes);
        let format = usize::from(f.u8_at::<26>() & 0x0F);
        let lbaf_at = 128 + 4 * format;
        let lbaf = u32::from_le_bytes([
            bytes[lbaf_at],
            bytes[lbaf_at + 1],
            bytes[lbaf_at + 2],
            bytes[lbaf_at + 3],
        ]);
        IdentifyNamespace {
            size_blocks: f.u64_le::<0>(),
            block_size_log2: (lbaf >> 16) as u8,
            features: f.u8_at::<24>(),
            nmic: f.u8_at::<30>(),
            dlfeat: f.u8_at::<33>(),
            nguid: f.bytes::<104, 16>(),
            eui64: f.bytes::<120, 8>(),
        }
    }
}

/// The active namespace id list: ids above `after`, ascending, at most 1024.
pub fn encode_active_namespaces(ids: &[u32], after: u32, out: &mut [u8; IDENTIFY_SIZE]) {
    out.fill(0);
    let mut sorted: Vec<u32> = ids.iter().copied().filter(|&id| id > after).collect();
    sorted.sort_unstable();
    for (slot, id) in out.chunks_exact_mut(4).zip(sorted) {
        slot.copy_from_slice(&id.to_le_bytes());
    }
}

/// Reads an active namespace id list.
pub fn decode_active_namespaces(bytes: &[u8; IDENTIFY_SIZE]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .take_while(|&id| id != 0)
        .collect()
}

/// Namespace identification descriptors: the NGUID, a UUID and the command set (NVM).
pub fn encode_namespace_descriptors(
    nguid: &[u8; 16],
    uuid: &[u8; 16],
    out: &mut [u8; IDENTIFY_SIZE],
) {
    out.fill(0);
    let mut at = 0;
    for (kind, value) in [(2u8, &nguid[..]), (3u8, &uuid[..]), (4u8, &[0u8][..])] {
        out[at] = kind;
        out[at + 1] = value.len() as u8;
        out[at + 4..at + 4 + value.len()].copy_from_slice(value);
        at += 4 + value.len();
    }
}

/// The namespace identification descriptors of a list: `(NIDT, value)`.
pub fn decode_namespace_descriptors(bytes: &[u8; IDENTIFY_SIZE]) -> Vec<(u8, Vec<u8>)> {
    let mut found = Vec::new();
    let mut at = 0;
    while at + 4 <= bytes.len() {
        let (kind, length) = (bytes[at], usize::from(bytes[at + 1]));
        if kind == 0 || at + 4 + length > bytes.len() {
            break;
        }
        found.push((kind, bytes[at + 4..at + 4 + length].to_vec()));
        at += 4 + length;
    }
    found
}

/// The composite temperature above which the controller warns (WCTEMP), and the default of
/// its over-temperature threshold (Temperature Threshold feature).
pub const WARNING_TEMPERATURE_KELVIN: u16 = 343;
/// The composite temperature above which the controller is critical (CCTEMP).
pub const CRITICAL_TEMPERATURE_KELVIN: u16 = 353;

/// The SMART / health log page: no warning, a temperature, full spare, and the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmartLog {
    pub temperature_kelvin: u16,
    pub available_spare_percent: u8,
    pub data_units_read: u64,
    pub data_units_written: u64,
    pub host_read_commands: u64,
    pub host_write_commands: u64,
    pub power_on_hours: u64,
}

impl SmartLog {
    pub fn encode(&self, out: &mut [u8; SMART_LOG_SIZE]) {
        out.fill(0);
        let mut f = FieldsMut(out);
        f.put_u16_le::<1>(self.temperature_kelvin);
        f.put_u8::<3>(self.available_spare_percent);
        f.put_u8::<4>(10); // available spare threshold
        f.put_u64_le::<32>(self.data_units_read);
        f.put_u64_le::<48>(self.data_units_written);
        f.put_u64_le::<64>(self.host_read_commands);
        f.put_u64_le::<80>(self.host_write_commands);
        f.put_u64_le::<128>(self.power_on_hours);
    }
}

/// NVMe-oF transport types, address families and subsystem types of the discovery log.
pub mod discovery {
    pub const TRTYPE_TCP: u8 = 3;
    pub const ADRFAM_IPV4: u8 = 1;
    pub const ADRFAM_IPV6: u8 = 2;
    pub const SUBTYPE_DISCOVERY: u8 = 1;
    pub const SUBTYPE_NVM: u8 = 2;
    /// TREQ: secure channel not required.
    pub const TREQ_NOT_REQUIRED: u8 = 0b10;
    /// TREQ: secure channel (TLS) required.
    pub const TREQ_REQUIRED: u8 = 0b01;
    /// TSAS for TCP, SECTYPE (NVMe/TCP transport 1.0, "TCP Transport Specific Address
    /// Subtype"): no security.
    pub const SECTYPE_NONE: u8 = 0;
    /// SECTYPE: TLS 1.3 (1 would be TLS 1.2, which TP 8011 does not use).
    pub const SECTYPE_TLS13: u8 = 2;
}

/// One entry of the discovery log page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryEntry {
    pub transport_type: u8,
    pub address_family: u8,
    pub subsystem_type: u8,
    pub transport_requirements: u8,
    pub port_id: u16,
    pub cntlid: u16,
    pub admin_queue_size_max: u16,
    pub service_id: String,
    pub subsystem_nqn: String,
    pub address: String,
    /// TSAS byte 0 for TCP: the security type ([`discovery::SECTYPE_NONE`] or
    /// [`discovery::SECTYPE_TLS13`]).
    pub tcp_security_type: u8,
}

/// Bytes of a discovery log with `entries` entries.
pub fn discovery_log_size(entries: usize) -> usize {
    DISCOVERY_HEADER_SIZE + entries * DISCOVERY_ENTRY_SIZE
}

/// Writes the discovery log (`out` of [`discovery_log_size`] bytes).
pub fn encode_discovery_log(generation: u64, entries: &[DiscoveryEntry], out: &mut [u8]) {
    assert!(out.len() >= discovery_log_size(entries.len()));
    out.fill(0);
    out[0..8].copy_from_slice(&generation.to_le_bytes());
    out[8..16].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    for (index, entry) in entries.iter().enumerate() {
        let at = DISCOVERY_HEADER_SIZE + index * DISCOVERY_ENTRY_SIZE;
        let record = &mut out[at..at + DISCOVERY_ENTRY_SIZE];
        record[0] = entry.transport_type;
        record[1] = entry.address_family;
        record[2] = entry.subsystem_type;
        record[3] = entry.transport_requirements;
        record[4..6].copy_from_slice(&entry.port_id.to_le_bytes());
        record[6..8].copy_from_slice(&entry.cntlid.to_le_bytes());
        record[8..10].copy_from_slice(&entry.admin_queue_size_max.to_le_bytes());
        put_ascii(&mut record[32..64], &entry.service_id);
        put_string(&mut record[256..512], &entry.subsystem_nqn);
        put_ascii(&mut record[512..768], &entry.address);
        // TSAS (bytes 768..1023) for TCP: SECTYPE, then reserved.
        record[768] = entry.tcp_security_type;
    }
}

/// Reads a discovery log's entries (as many as `bytes` holds whole).
pub fn decode_discovery_log(bytes: &[u8]) -> Vec<DiscoveryEntry> {
    let Some(header) = bytes.first_chunk::<16>() else {
        return Vec::new();
    };
    let count = u64::from_le_bytes([
        header[8], header[9], header[10], header[11], header[12], header[13], header[14],
        header[15],
    ]);
    let mut entries = Vec::new();
    for index in 0..count.min(1024) as usize {
        let at = DISCOVERY_HEADER_SIZE + index * DISCOVERY_ENTRY_SIZE;
        let Some(record) = bytes.get(at..at + DISCOVERY_ENTRY_SIZE) else {
            break;
        };
        entries.push(DiscoveryEntry {
            transport_type: record[0],
            address_family: record[1],
            subsystem_type: record[2],
            transport_requirements: record[3],
            port_id: u16::from_le_bytes([record[4], record[5]]),
            cntlid: u16::from_le_bytes([record[6], record[7]]),
            admin_queue_size_max: u16::from_le_bytes([record[8], record[9]]),
            service_id: read_string(&record[32..64]),
            subsystem_nqn: read_string(&record[256..512]),
            address: read_string(&record[512..768]),
            tcp_security_type: record[768],
        });
    }
    entries
}

/// The CAP property: `queue_entries_max` entries per queue (MQES is 0's based), NVM command
/// set, 4 KiB pages, ready within `ready_timeout_500ms` × 500 ms.
pub fn capabilities(queue_entries_max: u16, ready_timeout_500ms: u8) -> u64 {
    assert!(queue_entries_max >= 2);
    u64::from(queue_entries_max - 1) | (u64::from(ready_timeout_500ms) << 24) | (1 << 37)
}

/// MQES + 1 from a CAP value: entries per queue.
pub fn queue_entries_max(cap: u64) -> u32 {
    (cap & 0xFFFF) as u32 + 1
}
