//! NVMe commands and completions as NVMe-oF carries them: the 64-byte submission queue
//! entry ([`Command`]), its SGL descriptor, the fabrics commands (Connect, Property Get/Set),
//! the 16-byte completion ([`Completion`]) and status codes ([`Status`]).
//!
//! A [`Command`] is a view over the raw entry with typed getters (reading a field never
//! fails: every offset is checked at compile time); builders for the host side set the
//! fields an initiator needs.

use crate::wire::{Fields, FieldsMut};

/// Bytes of a submission queue entry.
pub const SQE_SIZE: usize = 64;
/// Bytes of a completion queue entry.
pub const CQE_SIZE: usize = 16;
/// Bytes of Connect's data.
pub const CONNECT_DATA_SIZE: usize = 1024;
/// Longest NQN (the spec's 223 bytes; the field holds 256 with its NUL).
pub const NQN_BYTES_MAX: usize = 223;
/// Connect's CNTLID asking for any controller (the dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;
/// The well-known NQN of a discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Admin command opcodes this target knows.
pub mod admin_opcode {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    pub const KEEP_ALIVE: u8 = 0x18;
    pub const FABRICS: u8 = 0x7F;
}

/// NVM command set I/O opcodes.
pub mod io_opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
    pub const FABRICS: u8 = 0x7F;
}

/// Fabrics command types (FCTYPE).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTHENTICATION_SEND: u8 = 0x05;
    pub const AUTHENTICATION_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Feature identifiers.
pub mod feature {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MANAGEMENT: u8 = 0x02;
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const ERROR_RECOVERY: u8 = 0x05;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIGURATION: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Log page identifiers.
pub mod log_page {
    pub const ERROR_INFORMATION: u8 = 0x01;
    pub const SMART_HEALTH: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NAMESPACES: u8 = 0x04;
    pub const DISCOVERY: u8 = 0x70;
}

/// Identify CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    pub const NAMESPACE_DESCRIPTORS: u8 = 0x03;
}

/// Controller properties (register offsets) and their bits.
pub mod property {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1C;
    pub const NSSR: u32 = 0x20;

    pub const CC_EN: u32 = 1;
    pub const CC_SHN_SHIFT: u32 = 14;
    pub const CC_SHN_MASK: u32 = 0b11 << CC_SHN_SHIFT;
    pub const CC_IOSQES_SHIFT: u32 = 16;
    pub const CC_IOCQES_SHIFT: u32 = 20;
    pub const CSTS_RDY: u32 = 1;
    pub const CSTS_CFS: u32 = 1 << 1;
    pub const CSTS_SHST_SHIFT: u32 = 2;
    pub const CSTS_SHST_MASK: u32 = 0b11 << CSTS_SHST_SHIFT;
    pub const SHST_OCCURRING: u32 = 0b01 << CSTS_SHST_SHIFT;
    pub const SHST_COMPLETE: u32 = 0b10 << CSTS_SHST_SHIFT;
}

/// A submission queue entry (the command of a CapsuleCmd), little-endian fields.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Command(pub [u8; SQE_SIZE]);

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Command")
            .field("opcode", &self.opcode())
            .field("cid", &self.cid())
            .field("nsid", &self.nsid())
            .field("sgl", &self.sgl())
            .field("cdw10", &self.cdw10())
            .finish()
    }
}

/// SGL descriptor types (the high nibble of the identifier byte) and subtypes.
pub mod sgl {
    /// Data Block with subtype Offset: data in the capsule at `address` bytes from its start.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Transport SGL Data Block, transport-specific: data moves by R2T/H2CData or C2HData.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5A;
}

/// The command's data descriptor (SGL1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SglDescriptor {
    pub address: u64,
    pub length: u32,
    /// The identifier byte: type (high nibble) and subtype.
    pub identifier: u8,
}

impl Command {
    pub fn zeroed() -> Command {
        Command([0; SQE_SIZE])
    }

    fn fields(&self) -> Fields<'_, SQE_SIZE> {
        Fields(&self.0)
    }

    fn fields_mut(&mut self) -> FieldsMut<'_, SQE_SIZE> {
        FieldsMut(&mut self.0)
    }

    pub fn opcode(&self) -> u8 {
        self.fields().u8_at::<0>()
    }

    /// FUSE (bits 1:0) and PSDT (bits 7:6).
    pub fn flags(&self) -> u8 {
        self.fields().u8_at::<1>()
    }

    pub fn cid(&self) -> u16 {
        self.fields().u16_le::<2>()
    }

    pub fn nsid(&self) -> u32 {
        self.fields().u32_le::<4>()
    }

    /// Fabrics commands: FCTYPE (where other commands have the NSID).
    pub fn fctype(&self) -> u8 {
        self.fields().u8_at::<4>()
    }

    pub fn sgl(&self) -> SglDescriptor {
        let f = self.fields();
        SglDescriptor {
            address: f.u64_le::<24>(),
            length: f.u32_le::<32>(),
            identifier: f.u8_at::<39>(),
        }
    }

    pub fn cdw10(&self) -> u32 {
        self.fields().u32_le::<40>()
    }

    pub fn cdw11(&self) -> u32 {
        self.fields().u32_le::<44>()
    }

    pub fn cdw12(&self) -> u32 {
        self.fields().u32_le::<48>()
    }

    pub fn cdw13(&self) -> u32 {
        self.fields().u32_le::<52>()
    }

    pub fn cdw14(&self) -> u32 {
        self.fields().u32_le::<56>()
    }

    pub fn cdw15(&self) -> u32 {
        self.fields().u32_le::<60>()
    }

    /// Read, Write, Write Zeroes: the starting LBA (CDW10-11).
    pub fn slba(&self) -> u64 {
        self.fields().u64_le::<40>()
    }

    /// Read, Write, Write Zeroes: the number of logical blocks (CDW12 bits 15:0 + 1).
    pub fn block_count(&self) -> u32 {
        (self.cdw12() & 0xFFFF) + 1
    }

    /// Read, Write, Write Zeroes: Force Unit Access (CDW12 bit 30).
    pub fn fua(&self) -> bool {
        self.cdw12() & (1 << 30) != 0
    }

    /// Write Zeroes: deallocate (CDW12 bit 25).
    pub fn deallocate(&self) -> bool {
        self.cdw12() & (1 << 25) != 0
    }

    /// Property Get/Set: the property's size is 8 bytes (ATTRIB bits 2:0 = 1).
    pub fn property_is_8_bytes(&self) -> bool {
        self.fields().u8_at::<40>() & 0b111 == 1
    }

    /// Property Get/Set: the property's offset.
    pub fn property_offset(&self) -> u32 {
        self.fields().u32_le::<44>()
    }

    /// Property Set: the value.
    pub fn property_value(&self) -> u64 {
        self.fields().u64_le::<48>()
    }

    /// Connect: record format, queue id, SQ size (0's based), attributes, keep-alive
    /// timeout in milliseconds.
    pub fn connect(&self) -> ConnectCommand {
        let f = self.fields();
        ConnectCommand {
            recfmt: f.u16_le::<40>(),
            qid: f.u16_le::<42>(),
            sqsize: f.u16_le::<44>(),
            cattr: f.u8_at::<46>(),
            kato_ms: f.u32_le::<48>(),
        }
    }

    // Builders (host side).

    pub fn set_opcode(&mut self, opcode: u8) -> &mut Command {
        self.fields_mut().put_u8::<0>(opcode);
        // PSDT 10b: SGLs, as NVMe-oF requires.
        self.fields_mut().put_u8::<1>(0x40);
        self
    }

    pub fn set_cid(&mut self, cid: u16) -> &mut Command {
        self.fields_mut().put_u16_le::<2>(cid);
        self
    }

    pub fn set_nsid(&mut self, nsid: u32) -> &mut Command {
        self.fields_mut().put_u32_le::<4>(nsid);
        self
    }

    pub fn set_fctype(&mut self, fctype: u8) -> &mut Command {
        self.fields_mut().put_u8::<4>(fctype);
        self
    }

    pub fn set_sgl(&mut self, descriptor: SglDescriptor) -> &mut Command {
        let mut f = self.fields_mut();
        f.put_u64_le::<24>(descriptor.address);
        f.put_u32_le::<32>(descriptor.length);
        f.put_u8::<39>(descriptor.identifier);
        self
    }

    pub fn set_cdw(&mut self, index: usize, value: u32) -> &mut Command {
        assert!((10..=15).contains(&index), "CDW{index}");
        let at = 40 + 4 * (index - 10);
        self.0[at..at + 4].copy_from_slice(&value.to_le_bytes());
        self
    }

    /// A Read or Write (`opcode`) of `block_count` blocks at `slba`.
    pub fn io(opcode: u8, cid: u16, nsid: u32, slba: u64, block_count: u32, fua: bool) -> Command {
        assert!((1..=0x1_0000).contains(&block_count));
        let mut command = Command::zeroed();
        command
            .set_opcode(opcode)
            .set_cid(cid)
            .set_nsid(nsid)
            .set_cdw(10, slba as u32)
            .set_cdw(11, (slba >> 32) as u32)
            .set_cdw(12, (block_count - 1) | if fua { 1 << 30 } else { 0 });
        command
    }

    /// A fabrics Connect for queue `qid` of `sqsize` entries (0's based).
    pub fn connect_command(cid: u16, qid: u16, sqsize: u16, cattr: u8, kato_ms: u32) -> Command {
        let mut command = Command::zeroed();
        command
            .set_opcode(admin_opcode::FABRICS)
            .set_cid(cid)
            .set_fctype(fctype::CONNECT);
        let mut f = command.fields_mut();
        f.put_u16_le::<40>(0);
        f.put_u16_le::<42>(qid);
        f.put_u16_le::<44>(sqsize);
        f.put_u8::<46>(cattr);
        f.put_u32_le::<48>(kato_ms);
        command
    }

    /// A Property Get (`value` None) or Set.
    pub fn property(cid: u16, offset: u32, eight_bytes: bool, value: Option<u64>) -> Command {
        let mut command = Command::zeroed();
        command
            .set_opcode(admin_opcode::FABRICS)
            .set_cid(cid)
            .set_fctype(match value {
                Some(_) => fctype::PROPERTY_SET,
                None => fctype::PROPERTY_GET,
            });
        let mut f = command.fields_mut();
        f.put_u8::<40>(u8::from(eight_bytes));
        f.put_u32_le::<44>(offset);
        f.put_u64_le::<48>(value.unwrap_or(0));
        command
    }
}

/// Connect's command fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectCommand {
    pub recfmt: u16,
    pub qid: u16,
    /// 0's based.
    pub sqsize: u16,
    pub cattr: u8,
    pub kato_ms: u32,
}

/// Connect CATTR bit: the host disables SQ flow control (SQHD is not reported, and the
/// controller may answer a read with C2HData's SUCCESS flag instead of a CapsuleResp).
pub const CATTR_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;

/// Connect's data: who connects to what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    pub host_id: [u8; 16],
    pub cntlid: u16,
    pub subsystem_nqn: String,
    pub host_nqn: String,
}

/// Offsets in Connect's data (for Connect Invalid Parameters' IPO).
pub mod connect_offset {
    pub const CNTLID: u16 = 16;
    pub const SUBNQN: u16 = 256;
    pub const HOSTNQN: u16 = 512;
}

/// Connect's data did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnectDataError {
    #[error("Connect data is {0} bytes, not 1024")]
    Length(usize),
    #[error("an NQN at byte {0} is not NUL-terminated UTF-8 of at most 223 bytes")]
    Nqn(u16),
}

impl ConnectData {
    pub fn decode(bytes: &[u8]) -> Result<ConnectData, ConnectDataError> {
        let Some(bytes) = bytes.first_chunk::<CONNECT_DATA_SIZE>() else {
            return Err(ConnectDataError::Length(bytes.len()));
        };
        let f = Fields(bytes);
        let nqn = |at: u16| -> Result<String, ConnectDataError> {
            let field = &bytes[usize::from(at)..usize::from(at) + 256];
            let end = field
                .iter()
                .position(|&b| b == 0)
                .ok_or(ConnectDataError::Nqn(at))?;
            if end > NQN_BYTES_MAX {
                return Err(ConnectDataError::Nqn(at));
            }
            std::str::from_utf8(&field[..end])
                .map(str::to_string)
                .map_err(|_| ConnectDataError::Nqn(at))
        };
        Ok(ConnectData {
            host_id: f.bytes::<0, 16>(),
            cntlid: f.u16_le::<16>(),
            subsystem_nqn: nqn(connect_offset::SUBNQN)?,
            host_nqn: nqn(connect_offset::HOSTNQN)?,
        })
    }

    /// The 1024 bytes (NQNs longer than the field are cut).
    pub fn encode(&self) -> [u8; CONNECT_DATA_SIZE] {
        let mut out = [0u8; CONNECT_DATA_SIZE];
        out[..16].copy_from_slice(&self.host_id);
        out[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        for (at, nqn) in [
            (connect_offset::SUBNQN, &self.subsystem_nqn),
            (connect_offset::HOSTNQN, &self.host_nqn),
        ] {
            let bytes = nqn.as_bytes();
            let length = bytes.len().min(NQN_BYTES_MAX);
            let at = usize::from(at);
            out[at..at + length].copy_from_slice(&bytes[..length]);
        }
        out
    }
}

/// A command's status: type, code and whether retrying can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    /// Status code type: 0 generic, 1 command specific, 2 media and data integrity.
    pub sct: u8,
    pub sc: u8,
    /// Do Not Retry.
    pub dnr: bool,
}

impl Status {
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01).no_retry();
    pub const INVALID_FIELD: Status = Status::generic(0x02).no_retry();
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0B).no_retry();
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0C).no_retry();
    pub const SGL_DATA_LENGTH_INVALID: Status = Status::generic(0x0F).no_retry();
    pub const SGL_TYPE_INVALID: Status = Status::generic(0x11).no_retry();
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::generic(0x20).no_retry();
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80).no_retry();
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81).no_retry();
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::specific(0x05).no_retry();
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09).no_retry();
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0D).no_retry();
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::specific(0x0E).no_retry();
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80).no_retry();
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82).no_retry();
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84).no_retry();
    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);
    pub const ACCESS_DENIED: Status = Status::media(0x86).no_retry();

    pub const fn generic(sc: u8) -> Status {
        Status {
            sct: 0,
            sc,
            dnr: false,
        }
    }

    pub const fn specific(sc: u8) -> Status {
        Status {
            sct: 1,
            sc,
            dnr: false,
        }
    }

    pub const fn media(sc: u8) -> Status {
        Status {
            sct: 2,
            sc,
            dnr: false,
        }
    }

    pub const fn no_retry(self) -> Status {
        Status { dnr: true, ..self }
    }

    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// The completion's status field (phase bit 0).
    pub fn to_field(self) -> u16 {
        (u16::from(self.sc) << 1) | (u16::from(self.sct & 0b111) << 9) | (u16::from(self.dnr) << 15)
    }

    pub fn from_field(field: u16) -> Status {
        Status {
            sc: (field >> 1) as u8,
            sct: ((field >> 9) & 0b111) as u8,
            dnr: field & (1 << 15) != 0,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SCT {:#x} SC {:#04x}{}",
            self.sct,
            self.sc,
            if self.dnr { " DNR" } else { "" }
        )
    }
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub dw0: u32,
    pub dw1: u32,
    /// SQ head pointer (0xFFFF when SQ flow control is off... reserved).
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

impl Completion {
    pub fn new(cid: u16, status: Status) -> Completion {
        Completion {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 0,
            cid,
            status,
        }
    }

    pub fn to_bytes(&self) -> [u8; CQE_SIZE] {
        let mut out = [0u8; CQE_SIZE];
        let mut f = FieldsMut(&mut out);
        f.put_u32_le::<0>(self.dw0);
        f.put_u32_le::<4>(self.dw1);
        f.put_u16_le::<8>(self.sqhd);
        f.put_u16_le::<10>(self.sqid);
        f.put_u16_le::<12>(self.cid);
        f.put_u16_le::<14>(self.status.to_field());
        out
    }

    pub fn from_bytes(bytes: &[u8; CQE_SIZE]) -> Completion {
        let f = Fields(bytes);
        Completion {
            dw0: f.u32_le::<0>(),
            dw1: f.u32_le::<4>(),
            sqhd: f.u16_le::<8>(),
            sqid: f.u16_le::<10>(),
            cid: f.u16_le::<12>(),
            status: Status::from_field(f.u16_le::<14>()),
        }
    }
}

/// One Dataset Management range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DsmRange {
    pub attributes: u32,
    pub block_count: u32,
    pub slba: u64,
}

/// Bytes of one Dataset Management range.
pub const DSM_RANGE_SIZE: usize = 16;
/// Most ranges in one Dataset Management command.
pub const DSM_RANGES_MAX: usize = 256;

impl DsmRange {
    pub fn decode(bytes: &[u8; DSM_RANGE_SIZE]) -> DsmRange {
        let f = Fields(bytes);
        DsmRange {
            attributes: f.u32_le::<0>(),
            block_count: f.u32_le::<4>(),
            slba: f.u64_le::<8>(),
        }
    }

    pub fn encode(&self) -> [u8; DSM_RANGE_SIZE] {
        let mut out = [0u8; DSM_RANGE_SIZE];
        let mut f = FieldsMut(&mut out);
        f.put_u32_le::<0>(self.attributes);
        f.put_u32_le::<4>(self.block_count);
        f.put_u64_le::<8>(self.slba);
        out
    }
}
