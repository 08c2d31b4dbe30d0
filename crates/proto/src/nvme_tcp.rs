//! NVMe over TCP (the NVM Express TCP Transport Specification 1.0 and the fabrics commands of
//! NVMe over Fabrics 1.1) as sans-IO codecs: what reflexd's NVMe/TCP target and the client's
//! small initiator put on the wire. `docs/NVME-TCP.md` says what reflexd implements.
//!
//! - [`pdu`]: the transport. `pdu::decode_header(buf, digests)` checks a PDU's common header,
//!   its PDU-specific header, header digest, padding and lengths, and says where its data lies
//!   (`Ok(None)`: need more bytes; `Err(PduError)`: fatal, report it in a TermReq and close).
//!   `pdu::Framing` encodes headers (CapsuleCmd, CapsuleResp, H2CData, C2HData, R2T) with
//!   digests and padding; `encode_ic_req`/`encode_ic_resp`/`encode_term_req`; `crc32c`.
//! - [`command`]: the 64-byte command (`Command`, typed getters and host-side builders), the
//!   16-byte completion (`Completion`), `Status` codes, Connect's data, Dataset Management
//!   ranges, opcodes, feature, log page and property constants.
//! - [`admin`]: Identify structures, log pages (SMART, discovery) and the CAP property.
//! - [`tls_key`]: TLS keys (TP 8011): the PSK interchange format, the retained and TLS PSKs,
//!   the PSK identity.
//!
//! Invariants: nothing here reads a clock, opens a socket or panics on input bytes; data is
//! never copied by the decoder (it only says where data lies); every decoder is fuzzed
//! (`fuzz/fuzz_targets/nvme_tcp_pdu.rs`).

pub mod admin;
pub mod command;
pub mod pdu;
#[cfg(test)]
mod tests;
pub mod tls_key;

pub use command::{Command, Completion, Status};
pub use pdu::{Decoded, Digests, Framing, Pdu, PduError, PduType};
