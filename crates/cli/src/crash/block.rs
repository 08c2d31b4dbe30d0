//! The self-describing 4 KiB block every crash-test write stores, and how a block read back
//! is classified.
//!
//! Why self-describing: after a crash the verifier must tell apart a block that holds the
//! expected write, an older or newer write of the same block, a write meant for another block,
//! half of one write and half of another, and garbage. So each block carries its own identity
//! (run tag, block number, write id, protocol) and a CRC-32 over everything but the CRC field;
//! the rest is a payload derived from that identity, so two writes never hold equal bytes. A
//! block can be judged whole or torn by itself, without the model; the model then says whether
//! the whole block is one the crash may have left there ([`super::model`]).
//!
//! Layout (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `"RFXCRASH"` |
//! | 8 | 8 | run tag (from the seed: a block of another run is foreign) |
//! | 16 | 8 | block number (4 KiB units from the start of the namespace) |
//! | 24 | 8 | write id: cycle << 40, writer << 32, sequence (see [`WriteId`]) |
//! | 32 | 1 | protocol (1 native, 2 original, 3 NBD) |
//! | 33 | 1 | 1 if the write was sent with FUA |
//! | 34 | 2 | 0 |
//! | 36 | 4 | CRC-32 (IEEE) of bytes 0..36 and 40..4096 |
//! | 40 | 4056 | payload: a function of run tag, block and write id |

use serde::Serialize;

/// Bytes per crash-test block: the unit of writes, of the model and of verification.
pub const BLOCK_SIZE_BYTES: usize = 4096;
const MAGIC: [u8; 8] = *b"RFXCRASH";
const CRC_OFFSET: usize = 36;
const PAYLOAD_OFFSET: usize = 40;

const _: () = assert!(PAYLOAD_OFFSET == CRC_OFFSET + 4);
const _: () = assert!((BLOCK_SIZE_BYTES - PAYLOAD_OFFSET).is_multiple_of(8));

/// Which protocol wrote a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Native,
    Original,
    Nbd,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Native, Protocol::Original, Protocol::Nbd];

    const fn code(self) -> u8 {
        match self {
            Protocol::Native => 1,
            Protocol::Original => 2,
            Protocol::Nbd => 3,
        }
    }

    const fn from_code(code: u8) -> Option<Protocol> {
        match code {
            1 => Some(Protocol::Native),
            2 => Some(Protocol::Original),
            3 => Some(Protocol::Nbd),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Native => "native",
            Protocol::Original => "original",
            Protocol::Nbd => "nbd",
        }
    }

    /// Whether the protocol can make a write durable itself (FLUSH and FUA). The original
    /// ReFlex protocol cannot: its writes become durable through a FLUSH on another protocol.
    pub const fn has_flush(self) -> bool {
        !matches!(self, Protocol::Original)
    }
}

/// Identifies one write for the whole run: unique, and ordered by cycle first, so that of two
/// writes of one block (always by the same writer, which owns the block) the later one has
/// the larger id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct WriteId(pub u64);

/// Sequence numbers of one writer in one cycle.
pub const SEQUENCE_MAX: u64 = (1 << 32) - 1;
/// Writers (3 protocols × connections).
pub const WRITERS_MAX: usize = 255;
/// Cycles of one run.
pub const CYCLES_MAX: u64 = (1 << 24) - 1;

impl WriteId {
    pub fn new(cycle: u64, writer_index: usize, sequence: u64) -> WriteId {
        assert!(cycle <= CYCLES_MAX);
        assert!(writer_index <= WRITERS_MAX);
        assert!(sequence <= SEQUENCE_MAX);
        WriteId(cycle << 40 | (writer_index as u64) << 32 | sequence)
    }

    pub fn cycle(self) -> u64 {
        self.0 >> 40
    }

    pub fn writer_index(self) -> usize {
        ((self.0 >> 32) & 0xff) as usize
    }
}

impl std::fmt::Display for WriteId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cycle {} writer {} #{}",
            self.cycle(),
            self.writer_index(),
            self.0 & SEQUENCE_MAX
        )
    }
}

/// The identity a block carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub run_tag: u64,
    pub block: u64,
    pub write_id: WriteId,
    pub protocol: Protocol,
    pub fua: bool,
}

/// Fills `out` (one block) with the content of `header`'s write.
pub fn encode(header: &BlockHeader, out: &mut [u8]) {
    assert_eq!(out.len(), BLOCK_SIZE_BYTES);
    out[0..8].copy_from_slice(&MAGIC);
    out[8..16].copy_from_slice(&header.run_tag.to_le_bytes());
    out[16..24].copy_from_slice(&header.block.to_le_bytes());
    out[24..32].copy_from_slice(&header.write_id.0.to_le_bytes());
    out[32] = header.protocol.code();
    out[33] = u8::from(header.fua);
    out[34..36].fill(0);
    let mut state = header.run_tag ^ header.block.rotate_left(23) ^ header.write_id.0;
    for word in out[PAYLOAD_OFFSET..].chunks_exact_mut(8) {
        word.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let crc = block_crc(out);
    out[CRC_OFFSET..PAYLOAD_OFFSET].copy_from_slice(&crc.to_le_bytes());
}

fn block_crc(block: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&block[..CRC_OFFSET]);
    hasher.update(&block[PAYLOAD_OFFSET..]);
    hasher.finalize()
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a block read back holds, judged by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded {
    /// All zeroes: never written (the backing file starts sparse).
    Zero,
    /// A whole crash-test block.
    Whole(BlockHeader),
    /// The magic is there but the CRC does not match: parts of different writes, or damage.
    Torn,
    /// Neither zero nor a crash-test block.
    Garbage,
}

/// Judges one block read back.
pub fn decode(block: &[u8]) -> Decoded {
    assert_eq!(block.len(), BLOCK_SIZE_BYTES);
    if block.iter().all(|byte| *byte == 0) {
        return Decoded::Zero;
    }
    if block[0..8] != MAGIC {
        return Decoded::Garbage;
    }
    let stored = u32::from_le_bytes([
        block[CRC_OFFSET],
        block[CRC_OFFSET + 1],
        block[CRC_OFFSET + 2],
        block[CRC_OFFSET + 3],
    ]);
    if stored != block_crc(block) {
        return Decoded::Torn;
    }
    let word = |offset: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&block[offset..offset + 8]);
        u64::from_le_bytes(bytes)
    };
    let Some(protocol) = Protocol::from_code(block[32]) else {
        return Decoded::Garbage;
    };
    Decoded::Whole(BlockHeader {
        run_tag: word(8),
        block: word(16),
        write_id: WriteId(word(24)),
        protocol,
        fua: block[33] != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(block: u64, sequence: u64) -> BlockHeader {
        BlockHeader {
            run_tag: 0xfeed,
            block,
            write_id: WriteId::new(3, 2, sequence),
            protocol: Protocol::Nbd,
            fua: true,
        }
    }

    fn check(bytes: &[u8], expected: Decoded) {
        assert_eq!(decode(bytes), expected);
    }

    #[test]
    fn blocks_round_trip_and_damage_is_classified() {
        let mut first = vec![0u8; BLOCK_SIZE_BYTES];
        encode(&header(17, 5), &mut first);
        check(&first, Decoded::Whole(header(17, 5)));
        check(&[0u8; BLOCK_SIZE_BYTES], Decoded::Zero);

        // Two writes of one block differ in every 512-byte sector, so a block made of
        // sectors of both is torn whichever sectors it takes.
        let mut second = vec![0u8; BLOCK_SIZE_BYTES];
        encode(&header(17, 6), &mut second);
        for sector in 0..8 {
            let range = sector * 512..(sector + 1) * 512;
            assert_ne!(first[range.clone()], second[range.clone()]);
            let mut mixed = first.clone();
            mixed[range.clone()].copy_from_slice(&second[range]);
            check(&mixed, Decoded::Torn);
        }
        let mut flipped = first.clone();
        flipped[4000] ^= 0x10;
        check(&flipped, Decoded::Torn);
        let mut garbage = first;
        garbage[0] = b'X';
        check(&garbage, Decoded::Garbage);
    }

    #[test]
    fn write_ids_order_by_cycle_then_writer_then_sequence() {
        let id = WriteId::new(7, 4, 99);
        assert_eq!((id.cycle(), id.writer_index()), (7, 4));
        assert!(WriteId::new(6, 200, SEQUENCE_MAX) < id);
        assert!(WriteId::new(7, 4, 98) < id);
        assert_eq!(id.to_string(), "cycle 7 writer 4 #99");
    }
}
