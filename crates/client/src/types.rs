//! Values the client shows its users. Opcodes, statuses and namespaces are the protocol
//! crate's own types (re-exported from the crate root); [`Capabilities`] gathers what HELLO
//! answered — the fixed capabilities and the namespace list — into one owned value, decoded
//! once per connection.

use reflex_proto::native::{self, BodyError, Namespace};

/// What the server said about itself in its HELLO response (docs/PROTOCOL.md §1.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    pub version: u16,
    /// Alignment of offsets and lengths.
    pub block_size_bytes: u32,
    /// Largest READ/WRITE length.
    pub io_size_max_bytes: u32,
    /// Requests a connection may have outstanding.
    pub window_requests: u32,
    pub namespaces: Vec<Namespace>,
}

impl Capabilities {
    /// Decodes a capabilities body with proto's decoder (every check it makes applies).
    pub fn decode(body: &[u8]) -> Result<Capabilities, BodyError> {
        let (fixed, entries) = native::Capabilities::decode(body)?;
        let namespaces = entries.collect::<Result<Vec<_>, _>>()?;
        Ok(Capabilities {
            version: fixed.version,
            block_size_bytes: fixed.block_size_bytes,
            io_size_max_bytes: fixed.io_size_max_bytes,
            window_requests: fixed.window_requests,
            namespaces,
        })
    }

    pub fn namespace(&self, id: u32) -> Option<&Namespace> {
        self.namespaces.iter().find(|namespace| namespace.id == id)
    }
}
