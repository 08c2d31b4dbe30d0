//! The glue between the wire protocol and the table: one decoded request in, one response
//! header (and GET's value) out. A server's connection loop is then: decode with
//! `reflex_proto::kv::RequestDecoder`, answer `Rejected` headers with their status, and pass
//! each whole `Request` to [`answer`].

use reflex_proto::kv::{Request, ResponseHeader, Status, VALUE_SIZE_MAX_BYTES};

use crate::store::{BlockStore, KvStore};

/// Executes `request` on `store`. A successful GET's value is written to the front of
/// `value_out` (at least [`VALUE_SIZE_MAX_BYTES`] long) and its length is in the header;
/// every other answer carries no value. Never fails: errors become statuses.
pub fn answer<B: BlockStore>(
    store: &mut KvStore<B>,
    request_id: u64,
    request: &Request<'_>,
    value_out: &mut [u8],
) -> ResponseHeader {
    assert!(value_out.len() >= VALUE_SIZE_MAX_BYTES);
    let opcode = request.opcode();
    let outcome = match *request {
        Request::Put { key, value } => store.put(key, value).map(|()| (Status::Ok, 0)),
        Request::Get { key } => store.get_into(key, value_out).map(|length| match length {
            Some(length) => (Status::Ok, length),
            None => (Status::NotFound, 0),
        }),
        Request::Delete { key } => store.delete(key).map(|found| {
            let status = if found { Status::Ok } else { Status::NotFound };
            (status, 0)
        }),
        Request::Flush => store.flush().map(|()| (Status::Ok, 0)),
        // Tenants are the server's (reflexd's dataplane answers BIND before the table sees
        // it); a bare table has none to bind to.
        Request::Bind { .. } => Ok((Status::NoTenant, 0)),
    };
    let (status, value_length) = outcome.unwrap_or_else(|error| (error.status(), 0));
    // ≤ 64 KiB: the table stores nothing longer.
    ResponseHeader::new(opcode, status, request_id, value_length as u32)
}
