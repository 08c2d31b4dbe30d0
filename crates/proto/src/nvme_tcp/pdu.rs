//! NVMe/TCP PDUs (NVM Express TCP Transport Specification 1.0): the common header, the
//! PDU-specific headers, header and data digests (CRC32C), padding and lengths.
//!
//! Decoding is split in two so a receiver never copies data: [`decode_header`] checks and
//! decodes everything up to the PDU's data (the common header, the PDU-specific header, the
//! header digest and the padding) and returns where the data lies in the stream
//! ([`DataSpan`]); the caller moves the data itself (into a device buffer), then checks the
//! data digest with [`crc32c()`]. `Ok(None)` means "need more bytes"; every malformed header
//! is a [`PduError`] carrying the fatal error status and the offset of the field in error,
//! which is what a C2HTermReq or H2CTermReq reports.
//!
//! Encoding writes headers into a [`HeaderBytes`] (at most [`HEADER_BYTES_MAX`]); the data
//! and its digest are the caller's to send after it.

use crate::wire::{Fields, FieldsMut};

/// Bytes of the common header.
pub const COMMON_HEADER_SIZE: usize = 8;
/// Bytes of a header or data digest.
pub const DIGEST_SIZE: usize = 4;
/// Bytes of an ICReq or ICResp (header only, no digests).
pub const IC_PDU_SIZE: usize = 128;
/// HLEN of a CapsuleCmd: the common header and the 64-byte submission queue entry.
pub const CAPSULE_CMD_HLEN: usize = 72;
/// HLEN of a CapsuleResp: the common header and the 16-byte completion queue entry.
pub const CAPSULE_RESP_HLEN: usize = 24;
/// HLEN of H2CData, C2HData and R2T.
pub const DATA_HLEN: usize = 24;
/// HLEN of H2CTermReq and C2HTermReq.
pub const TERM_HLEN: usize = 24;
/// Most bytes of a TermReq's error data (the header of the PDU in error).
pub const TERM_DATA_MAX: usize = 152;
/// The largest encoded header: a capsule's 72 bytes and its digest, padded to the largest
/// alignment a peer may ask for (CPDA or HPDA 31: 128 bytes).
pub const HEADER_BYTES_MAX: usize = 128;
/// The largest alignment (in bytes) CPDA or HPDA can ask for.
pub const PDU_DATA_ALIGNMENT_MAX: usize = 128;
/// MAXH2CDATA may not be lower than this.
pub const MAXH2CDATA_MIN: u32 = 4096;

const _: () = assert!(CAPSULE_CMD_HLEN + DIGEST_SIZE <= HEADER_BYTES_MAX);
const _: () = assert!(PDU_DATA_ALIGNMENT_MAX == (31 + 1) * 4);

/// PDU types (the first byte of every PDU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2cTermReq = 0x02,
    C2hTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2cData = 0x06,
    C2hData = 0x07,
    R2t = 0x09,
}

impl PduType {
    pub fn from_u8(value: u8) -> Option<PduType> {
        Some(match value {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2cTermReq,
            0x03 => PduType::C2hTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2cData,
            0x07 => PduType::C2hData,
            0x09 => PduType::R2t,
            _ => return None,
        })
    }

    /// The HLEN every PDU of this type has.
    pub fn hlen(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_PDU_SIZE,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN,
            PduType::CapsuleResp => CAPSULE_RESP_HLEN,
            PduType::H2cTermReq | PduType::C2hTermReq => TERM_HLEN,
            PduType::H2cData | PduType::C2hData | PduType::R2t => DATA_HLEN,
        }
    }

    /// Whether the PDU carries a header digest when header digests are on (all but the
    /// connection set-up and termination PDUs).
    pub fn has_digests(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2cTermReq | PduType::C2hTermReq
        )
    }

    /// Whether the PDU may carry data, and whether it must.
    fn data_rule(self) -> DataRule {
        match self {
            PduType::CapsuleCmd => DataRule::Optional,
            PduType::H2cData | PduType::C2hData => DataRule::Required,
            _ => DataRule::None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataRule {
    None,
    Optional,
    Required,
}

/// Bits of the common header's FLAGS byte.
pub mod flags {
    /// The PDU carries a header digest.
    pub const HDGSTF: u8 = 0x01;
    /// The PDU carries a data digest.
    pub const DDGSTF: u8 = 0x02;
    /// H2CData, C2HData: the last PDU of the transfer (of an R2T, of a command's data).
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command succeeded and no CapsuleResp follows (with LAST_PDU only).
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a TermReq (what went wrong with a PDU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FatalError {
    InvalidHeaderField = 0x01,
    PduSequence = 0x02,
    HeaderDigest = 0x03,
    DataTransferOutOfRange = 0x04,
    DataTransferLimitExceeded = 0x05,
    UnsupportedParameter = 0x06,
}

impl FatalError {
    pub fn from_u16(value: u16) -> Option<FatalError> {
        Some(match value {
            0x01 => FatalError::InvalidHeaderField,
            0x02 => FatalError::PduSequence,
            0x03 => FatalError::HeaderDigest,
            0x04 => FatalError::DataTransferOutOfRange,
            0x05 => FatalError::DataTransferLimitExceeded,
            0x06 => FatalError::UnsupportedParameter,
            _ => return None,
        })
    }
}

/// A PDU the receiver must not accept: a TermReq reports `fatal` with `field_offset` (the
/// byte of the PDU header in error, for the FEI field) and the connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (fatal error {fatal:?}, header byte {field_offset})")]
pub struct PduError {
    pub fatal: FatalError,
    pub field_offset: u32,
    pub reason: &'static str,
}

impl PduError {
    pub fn new(fatal: FatalError, field_offset: usize, reason: &'static str) -> PduError {
        PduError {
            fatal,
            field_offset: field_offset as u32,
            reason,
        }
    }
}

/// Which digests a connection uses, as negotiated by ICReq/ICResp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    pub const NONE: Digests = Digests {
        header: false,
        data: false,
    };
    pub const BOTH: Digests = Digests {
        header: true,
        data: true,
    };

    fn header_bytes(self, pdu_type: PduType) -> usize {
        if self.header && pdu_type.has_digests() {
            DIGEST_SIZE
        } else {
            0
        }
    }

    /// The DGST byte of ICReq/ICResp.
    pub fn to_byte(self) -> u8 {
        u8::from(self.header) | (u8::from(self.data) << 1)
    }

    pub fn from_byte(byte: u8) -> Digests {
        Digests {
            header: byte & 1 != 0,
            data: byte & 2 != 0,
        }
    }
}

/// CRC32C (Castagnoli), as NVMe/TCP's header and data digests use it (sent little-endian).
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// CRC32C of data that arrives in pieces: start with 0, feed each piece in order.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

/// The common header of every PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: u8,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

impl CommonHeader {
    pub fn decode(bytes: &[u8; COMMON_HEADER_SIZE]) -> CommonHeader {
        let f = Fields(bytes);
        CommonHeader {
            pdu_type: f.u8_at::<0>(),
            flags: f.u8_at::<1>(),
            hlen: f.u8_at::<2>(),
            pdo: f.u8_at::<3>(),
            plen: f.u32_le::<4>(),
        }
    }

    fn encode(&self, out: &mut [u8; COMMON_HEADER_SIZE]) {
        let mut f = FieldsMut(out);
        f.put_u8::<0>(self.pdu_type);
        f.put_u8::<1>(self.flags);
        f.put_u8::<2>(self.hlen);
        f.put_u8::<3>(self.pdo);
        f.put_u32_le::<4>(self.plen);
    }
}

/// Where a PDU's data lies, counted from the PDU's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSpan {
    /// PDO: the first byte of data (the header, its digest and the padding come before).
    pub offset: usize,
    pub length: u32,
    /// A 4-byte data digest follows the data.
    pub digest: bool,
}

impl DataSpan {
    /// The first byte after the data and its digest (= PLEN).
    pub fn end(&self) -> usize {
        self.offset + self.length as usize + if self.digest { DIGEST_SIZE } else { 0 }
    }
}

/// ICReq: the host opens the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version: 0.
    pub pfv: u16,
    /// Host PDU data alignment: C2HData data must start at a multiple of `(hpda + 1) * 4`.
    pub hpda: u8,
    pub digests: Digests,
    /// Outstanding R2Ts per command the host accepts, 0's based.
    pub maxr2t: u32,
}

/// ICResp: the controller's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment for the host's data PDUs, as for HPDA.
    pub cpda: u8,
    pub digests: Digests,
    /// Most bytes of data in one H2CData PDU.
    pub maxh2cdata: u32,
}

/// The PDU-specific header of H2CData, C2HData (`ttag` 0) and R2T (`offset`/`length` are
/// R2TO/R2TL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// The command's CID.
    pub cccid: u16,
    /// Transfer tag: the controller's name for an R2T, echoed by H2CData.
    pub ttag: u16,
    /// DATAO (R2TO): the data's offset in the command's transfer.
    pub offset: u32,
    /// DATAL (R2TL).
    pub length: u32,
}

/// A TermReq's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq {
    /// FES as sent (may be a value this crate does not know).
    pub fes: u16,
    /// FEI: the field in error.
    pub fei: u32,
}

/// A decoded PDU header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu {
    IcReq(IcReq),
    IcResp(IcResp),
    H2cTermReq(TermReq),
    C2hTermReq(TermReq),
    /// The 64-byte submission queue entry.
    CapsuleCmd([u8; 64]),
    /// The 16-byte completion queue entry.
    CapsuleResp([u8; 16]),
    H2cData(DataHeader),
    C2hData(DataHeader),
    R2t(DataHeader),
}

/// A PDU header decoded and checked: what it is, its flags, how many bytes precede its data
/// and where its data lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub pdu: Pdu,
    pub flags: u8,
    /// PLEN: the whole PDU.
    pub total_bytes: usize,
    /// The header, its digest and padding: the bytes before the data (all of the PDU when it
    /// has no data; for a TermReq, its header: the error data follows).
    pub header_bytes: usize,
    /// The data, if the PDU has any.
    pub data: Option<DataSpan>,
}

/// Decodes the PDU header at the start of `input` on a connection using `digests` (use
/// [`Digests::NONE`] until ICReq/ICResp are exchanged). `Ok(None)`: fewer bytes than the
/// header, its digest and its padding. The header digest is verified; the data digest is the
/// caller's to check once it has the data. `Err`: a fatal error (close after a TermReq).
pub fn decode_header(input: &[u8], digests: Digests) -> Result<Option<Decoded>, PduError> {
    let Some(common) = input.first_chunk::<COMMON_HEADER_SIZE>() else {
        return Ok(None);
    };
    let common = CommonHeader::decode(common);
    let invalid = |offset: usize, reason| {
        Err(PduError::new(
            FatalError::InvalidHeaderField,
            offset,
            reason,
        ))
    };
    let Some(pdu_type) = PduType::from_u8(common.pdu_type) else {
        return invalid(0, "unknown PDU type");
    };
    let hlen = pdu_type.hlen();
    if usize::from(common.hlen) != hlen {
        return invalid(2, "HLEN does not match the PDU type");
    }
    let digest_bytes = digests.header_bytes(pdu_type);
    let flagged_header_digest = common.flags & flags::HDGSTF != 0;
    if pdu_type.has_digests() && flagged_header_digest != (digest_bytes > 0) {
        return invalid(1, "HDGSTF does not match the negotiated header digest");
    }
    let plen = common.plen as usize;
    let after_header = hlen + digest_bytes;
    // The data rule decides PDO and PLEN.
    let data = match pdu_type.data_rule() {
        DataRule::None => {
            let allowed_data = matches!(pdu_type, PduType::H2cTermReq | PduType::C2hTermReq);
            if common.pdo != 0 && !allowed_data {
                return invalid(3, "PDO set on a PDU without data");
            }
            if common.flags & flags::DDGSTF != 0 {
                return invalid(1, "DDGSTF on a PDU without data");
            }
            let plen_ok = if allowed_data {
                (hlen..=hlen + TERM_DATA_MAX).contains(&plen)
            } else {
                plen == after_header
            };
            if !plen_ok {
                return invalid(4, "PLEN does not match the PDU type");
            }
            None
        }
        rule => {
            let pdo = usize::from(common.pdo);
            let flagged_data_digest = common.flags & flags::DDGSTF != 0;
            // A capsule without data whose PDO points at its end (PLEN): some hosts (the
            // TrueNAS Python initiator) set PDO = HLEN on every capsule. Nothing follows the
            // header, so PDO has nothing to locate: accept it as a capsule without data.
            let pdo_at_end = rule == DataRule::Optional
                && pdo == plen
                && plen == after_header
                && !flagged_data_digest;
            if pdo == 0 || pdo_at_end {
                if rule == DataRule::Required {
                    return invalid(3, "PDO 0 on a data PDU");
                }
                if flagged_data_digest {
                    return invalid(1, "DDGSTF without data");
                }
                if plen != after_header {
                    return invalid(4, "PLEN of a PDU without data");
                }
                None
            } else {
                if pdo < after_header || pdo > after_header + PDU_DATA_ALIGNMENT_MAX {
                    return invalid(3, "PDO outside the header and its padding");
                }
                if flagged_data_digest != digests.data {
                    return invalid(1, "DDGSTF does not match the negotiated data digest");
                }
                let digest = if digests.data { DIGEST_SIZE } else { 0 };
                if plen < pdo + digest {
                    return invalid(4, "PLEN shorter than PDO");
                }
                let length = plen - pdo - digest;
                if rule == DataRule::Optional && length == 0 {
                    return invalid(4, "a capsule with PDO but no data");
                }
                Some(DataSpan {
                    offset: pdo,
                    length: u32::try_from(length)
                        .map_err(|_| PduError::new(FatalError::InvalidHeaderField, 4, "PLEN"))?,
                    digest: digests.data,
                })
            }
        }
    };
    let header_bytes = data.map_or(plen.min(after_header), |span| span.offset);
    let header_bytes = match pdu_type {
        PduType::H2cTermReq | PduType::C2hTermReq => hlen,
        _ => header_bytes,
    };
    if input.len() < header_bytes {
        return Ok(None);
    }
    if digest_bytes > 0 {
        let Some(stored) = input.get(hlen..hlen + DIGEST_SIZE) else {
            return Ok(None);
        };
        let mut digest = [0u8; DIGEST_SIZE];
        digest.copy_from_slice(stored);
        if crc32c(&input[..hlen]) != u32::from_le_bytes(digest) {
            return Err(PduError::new(
                FatalError::HeaderDigest,
                0,
                "header digest mismatch",
            ));
        }
    }
    let pdu = decode_specific(pdu_type, &input[..hlen])?;
    if let (Pdu::H2cData(header) | Pdu::C2hData(header), Some(span)) = (pdu, data)
        && header.length != span.length
    {
        return invalid(16, "DATAL does not match PLEN and PDO");
    }
    if let Pdu::C2hData(_) = pdu
        && common.flags & flags::SUCCESS != 0
        && common.flags & flags::LAST_PDU == 0
    {
        return invalid(1, "SUCCESS without LAST_PDU");
    }
    Ok(Some(Decoded {
        pdu,
        flags: common.flags,
        total_bytes: plen,
        header_bytes,
        data,
    }))
}

fn decode_specific(pdu_type: PduType, header: &[u8]) -> Result<Pdu, PduError> {
    let short = PduError::new(
        FatalError::InvalidHeaderField,
        2,
        "header shorter than HLEN",
    );
    Ok(match pdu_type {
        PduType::IcReq | PduType::IcResp => {
            let bytes = header.first_chunk::<IC_PDU_SIZE>().ok_or(short)?;
            let f = Fields(bytes);
            if pdu_type == PduType::IcReq {
                Pdu::IcReq(IcReq {
                    pfv: f.u16_le::<8>(),
                    hpda: f.u8_at::<10>(),
                    digests: Digests::from_byte(f.u8_at::<11>()),
                    maxr2t: f.u32_le::<12>(),
                })
            } else {
                Pdu::IcResp(IcResp {
                    pfv: f.u16_le::<8>(),
                    cpda: f.u8_at::<10>(),
                    digests: Digests::from_byte(f.u8_at::<11>()),
                    maxh2cdata: f.u32_le::<12>(),
                })
            }
        }
        PduType::H2cTermReq | PduType::C2hTermReq => {
            let bytes = header.first_chunk::<TERM_HLEN>().ok_or(short)?;
            let f = Fields(bytes);
            let term = TermReq {
                fes: f.u16_le::<8>(),
                fei: f.u32_le::<10>(),
            };
            if pdu_type == PduType::H2cTermReq {
                Pdu::H2cTermReq(term)
            } else {
                Pdu::C2hTermReq(term)
            }
        }
        PduType::CapsuleCmd => {
            let bytes = header.first_chunk::<CAPSULE_CMD_HLEN>().ok_or(short)?;
            Pdu::CapsuleCmd(Fields(bytes).bytes::<8, 64>())
        }
        PduType::CapsuleResp => {
            let bytes = header.first_chunk::<CAPSULE_RESP_HLEN>().ok_or(short)?;
            Pdu::CapsuleResp(Fields(bytes).bytes::<8, 16>())
        }
        PduType::H2cData | PduType::C2hData | PduType::R2t => {
            let bytes = header.first_chunk::<DATA_HLEN>().ok_or(short)?;
            let f = Fields(bytes);
            let data = DataHeader {
                cccid: f.u16_le::<8>(),
                ttag: f.u16_le::<10>(),
                offset: f.u32_le::<12>(),
                length: f.u32_le::<16>(),
            };
            match pdu_type {
                PduType::H2cData => Pdu::H2cData(data),
                PduType::C2hData => Pdu::C2hData(DataHeader { ttag: 0, ..data }),
                _ => Pdu::R2t(data),
            }
        }
    })
}

/// An encoded PDU header (with its digest and padding), ready to send before its data.
#[derive(Clone, Copy)]
pub struct HeaderBytes {
    bytes: [u8; HEADER_BYTES_MAX],
    length: u8,
}

impl std::fmt::Debug for HeaderBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HeaderBytes")
            .field(&self.as_bytes())
            .finish()
    }
}

impl HeaderBytes {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.length)]
    }

    pub fn len(&self) -> usize {
        usize::from(self.length)
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }
}

/// How a sender lays out a PDU: the negotiated digests and the data alignment the receiver
/// asked for (HPDA for the controller's PDUs, CPDA for the host's), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    pub digests: Digests,
    /// Data starts at a multiple of this (4 ..= 128).
    pub data_alignment: usize,
}

impl Framing {
    pub const PLAIN: Framing = Framing {
        digests: Digests::NONE,
        data_alignment: 4,
    };

    /// The framing for an alignment field value (HPDA or CPDA: `(value + 1) * 4` bytes).
    pub fn new(digests: Digests, alignment_field: u8) -> Option<Framing> {
        (alignment_field <= 31).then_some(Framing {
            digests,
            data_alignment: (usize::from(alignment_field) + 1) * 4,
        })
    }

    /// PDO of a PDU of `pdu_type` with data.
    pub fn data_offset(&self, pdu_type: PduType) -> usize {
        (pdu_type.hlen() + self.digests.header_bytes(pdu_type))
            .next_multiple_of(self.data_alignment)
    }

    /// The bytes after a PDU's data: its digest, if data digests are on.
    pub fn data_trailer_bytes(&self) -> usize {
        if self.digests.data { DIGEST_SIZE } else { 0 }
    }

    /// Writes the header of a `pdu_type` PDU: the common header with `flags` (digest flags
    /// are added), `specific` (the bytes after the common header, HLEN − 8 of them), the
    /// header digest and, when `data_bytes` > 0, the padding up to PDO. Returns the header
    /// bytes; PLEN counts the data and its digest.
    pub fn header(
        &self,
        pdu_type: PduType,
        mut pdu_flags: u8,
        specific: &[u8],
        data_bytes: u32,
    ) -> HeaderBytes {
        let hlen = pdu_type.hlen();
        assert_eq!(specific.len(), hlen - COMMON_HEADER_SIZE);
        let digest_bytes = self.digests.header_bytes(pdu_type);
        if digest_bytes > 0 {
            pdu_flags |= flags::HDGSTF;
        }
        let (pdo, plen) = if data_bytes > 0 {
            assert!(
                pdu_type.data_rule() != DataRule::None
                    || pdu_type == PduType::C2hTermReq
                    || pdu_type == PduType::H2cTermReq
            );
            if pdu_type.has_digests() && self.digests.data {
                pdu_flags |= flags::DDGSTF;
            }
            if pdu_type.has_digests() {
                let pdo = self.data_offset(pdu_type);
                let plen = pdo + data_bytes as usize + self.data_trailer_bytes();
                (pdo, plen)
            } else {
                (0, hlen + data_bytes as usize)
            }
        } else {
            (0, hlen + digest_bytes)
        };
        let mut header = HeaderBytes {
            bytes: [0; HEADER_BYTES_MAX],
            length: 0,
        };
        let common = CommonHeader {
            pdu_type: pdu_type as u8,
            flags: pdu_flags,
            hlen: hlen as u8,
            pdo: pdo as u8,
            plen: plen as u32,
        };
        let Some(first) = header.bytes.first_chunk_mut::<COMMON_HEADER_SIZE>() else {
            unreachable!("HEADER_BYTES_MAX holds a common header");
        };
        common.encode(first);
        header.bytes[COMMON_HEADER_SIZE..hlen].copy_from_slice(specific);
        if digest_bytes > 0 {
            let digest = crc32c(&header.bytes[..hlen]);
            header.bytes[hlen..hlen + DIGEST_SIZE].copy_from_slice(&digest.to_le_bytes());
        }
        let length = if pdo > 0 { pdo } else { hlen + digest_bytes };
        assert!(length <= HEADER_BYTES_MAX);
        header.length = length as u8;
        header
    }

    /// A CapsuleCmd header for `sqe` with `data_bytes` of in-capsule data after it.
    pub fn capsule_cmd(&self, sqe: &[u8; 64], data_bytes: u32) -> HeaderBytes {
        self.header(PduType::CapsuleCmd, 0, sqe, data_bytes)
    }

    /// A CapsuleResp for `cqe`.
    pub fn capsule_resp(&self, cqe: &[u8; 16]) -> HeaderBytes {
        self.header(PduType::CapsuleResp, 0, cqe, 0)
    }

    /// The header of an H2CData, C2HData or R2T PDU (`data.length` bytes of data follow
    /// H2CData and C2HData; none follow R2T).
    pub fn data_pdu(&self, pdu_type: PduType, pdu_flags: u8, data: DataHeader) -> HeaderBytes {
        let mut specific = [0u8; DATA_HLEN - COMMON_HEADER_SIZE];
        specific[0..2].copy_from_slice(&data.cccid.to_le_bytes());
        specific[2..4].copy_from_slice(&data.ttag.to_le_bytes());
        specific[4..8].copy_from_slice(&data.offset.to_le_bytes());
        specific[8..12].copy_from_slice(&data.length.to_le_bytes());
        let data_bytes = match pdu_type {
            PduType::H2cData | PduType::C2hData => data.length,
            PduType::R2t => 0,
            other => panic!("{other:?} is not a data PDU"),
        };
        self.header(pdu_type, pdu_flags, &specific, data_bytes)
    }
}

/// ICReq's 128 bytes.
pub fn encode_ic_req(req: &IcReq) -> [u8; IC_PDU_SIZE] {
    let mut out = [0u8; IC_PDU_SIZE];
    encode_ic(
        &mut out,
        PduType::IcReq,
        req.pfv,
        req.hpda,
        req.digests,
        req.maxr2t,
    );
    out
}

/// ICResp's 128 bytes.
pub fn encode_ic_resp(resp: &IcResp) -> [u8; IC_PDU_SIZE] {
    let mut out = [0u8; IC_PDU_SIZE];
    encode_ic(
        &mut out,
        PduType::IcResp,
        resp.pfv,
        resp.cpda,
        resp.digests,
        resp.maxh2cdata,
    );
    out
}

fn encode_ic(
    out: &mut [u8; IC_PDU_SIZE],
    pdu_type: PduType,
    pfv: u16,
    alignment: u8,
    digests: Digests,
    last: u32,
) {
    let mut f = FieldsMut(out);
    f.put_u8::<0>(pdu_type as u8);
    f.put_u8::<1>(0);
    f.put_u8::<2>(IC_PDU_SIZE as u8);
    f.put_u8::<3>(0);
    f.put_u32_le::<4>(IC_PDU_SIZE as u32);
    f.put_u16_le::<8>(pfv);
    f.put_u8::<10>(alignment);
    f.put_u8::<11>(digests.to_byte());
    f.put_u32_le::<12>(last);
}

/// A TermReq (`c2h`: the controller's, else the host's) reporting `error`, with up to
/// [`TERM_DATA_MAX`] bytes of the offending header as its data. Returns the PDU's bytes in
/// `out` (at least `TERM_HLEN + TERM_DATA_MAX`) and their count.
pub fn encode_term_req(c2h: bool, error: &PduError, offending: &[u8], out: &mut [u8]) -> usize {
    let data = &offending[..offending.len().min(TERM_DATA_MAX)];
    let total = TERM_HLEN + data.len();
    assert!(out.len() >= total, "TermReq buffer too small");
    let pdu_type = if c2h {
        PduType::C2hTermReq
    } else {
        PduType::H2cTermReq
    };
    let mut header = [0u8; TERM_HLEN];
    {
        let mut f = FieldsMut(&mut header);
        f.put_u8::<0>(pdu_type as u8);
        f.put_u8::<2>(TERM_HLEN as u8);
        f.put_u32_le::<4>(total as u32);
        f.put_u16_le::<8>(error.fatal as u16);
        f.put_u32_le::<10>(error.field_offset);
    }
    out[..TERM_HLEN].copy_from_slice(&header);
    out[TERM_HLEN..total].copy_from_slice(data);
    total
}
