//! The protocol seam of the bench engine: one connection's sans-IO core, native protocol or
//! NBD, behind one set of calls.
//!
//! Why an enum and not a trait object or a generic engine: the engine and its io_uring
//! reactor only need five things from a connection — encode a READ or a WRITE under a request
//! id, lend its transmit bytes and receive space, and hand back answers — and the two
//! protocols differ only inside those calls. A closed enum keeps the reactor and the engine
//! loop single (no monomorphised copies), the match costs nothing next to a system call, and
//! every protocol-specific detail (the native namespace, NBD's length-less replies) stays in
//! its own core.

use anyhow::{Context, Result};
use reflex_client::{ConnectionCore, REPORT_REQUEST_ID};

use super::nbd_core::NbdCore;

/// One connection's protocol state.
pub enum Wire {
    /// Native protocol v1 on namespace `namespace`.
    Native {
        core: ConnectionCore,
        namespace: u32,
    },
    Nbd(NbdCore),
}

/// An answer taken out of a connection's receive buffer.
pub struct Answer<'a> {
    pub request_id: u64,
    /// Why the server failed the request, `None` on success.
    pub failure: Option<String>,
    /// READ data on success (borrowed from the receive buffer).
    pub data: &'a [u8],
    /// A native RENEGOTIATE notice, which answers no request.
    pub notice: bool,
    /// The share of its reservation a device notice says the tenant is granted now (`None`
    /// for deficit-limit notices and answers).
    pub granted_share: Option<f64>,
}

impl Wire {
    /// Sizes the buffers for `requests` ids `0..requests` of up to `io_size_bytes`, before
    /// any buffer is lent to the kernel.
    pub fn reserve(&mut self, requests: usize, io_size_bytes: u32) {
        match self {
            Wire::Native { core, .. } => core.reserve(requests, io_size_bytes),
            Wire::Nbd(core) => core.reserve(requests, io_size_bytes),
        }
    }

    pub fn submit_read(
        &mut self,
        request_id: u64,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<()> {
        match self {
            Wire::Native { core, namespace } => core
                .submit_read(request_id, *namespace, offset_bytes, length_bytes)
                .context("bench READ refused by the connection core"),
            Wire::Nbd(core) => core
                .submit_read(request_id, offset_bytes, length_bytes)
                .context("bench READ refused by the NBD core"),
        }
    }

    /// Queues a REPORT of what the connection's latency-critical tenant measured (native
    /// only); false when it cannot go now (NBD, a full window, the last one unanswered).
    pub fn submit_report(&mut self, report: &reflex_proto::native::ReportBody) -> bool {
        match self {
            Wire::Native { core, .. } => core.submit_report(REPORT_REQUEST_ID, report).is_ok(),
            Wire::Nbd(_) => false,
        }
    }

    /// Queues a WRITE whose payload `fill` writes in place.
    pub fn submit_write_with(
        &mut self,
        request_id: u64,
        offset_bytes: u64,
        length_bytes: u32,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<()> {
        match self {
            Wire::Native { core, namespace } => core
                .submit_write_with(
                    request_id,
                    *namespace,
                    offset_bytes,
                    length_bytes,
                    false,
                    fill,
                )
                .context("bench WRITE refused by the connection core"),
            Wire::Nbd(core) => core
                .submit_write_with(request_id, offset_bytes, length_bytes, false, fill)
                .context("bench WRITE refused by the NBD core"),
        }
    }

    /// Lends the unsent bytes for one send (see the cores' docs).
    pub fn transmit_start(&mut self) -> Option<&[u8]> {
        match self {
            Wire::Native { core, .. } => core.transmit_start(),
            Wire::Nbd(core) => core.transmit_start(),
        }
    }

    pub fn transmit_done(&mut self, sent_bytes: usize) {
        match self {
            Wire::Native { core, .. } => core.transmit_done(sent_bytes),
            Wire::Nbd(core) => core.transmit_done(sent_bytes),
        }
    }

    /// Lends free receive space for one receive.
    pub fn receive_start(&mut self) -> Option<&mut [u8]> {
        match self {
            Wire::Native { core, .. } => core.receive_start(),
            Wire::Nbd(core) => core.receive_start(),
        }
    }

    pub fn receive_done(&mut self, received_bytes: usize) {
        match self {
            Wire::Native { core, .. } => core.receive_done(received_bytes),
            Wire::Nbd(core) => core.receive_done(received_bytes),
        }
    }

    /// The next complete answer, `None` until more bytes arrive; an error means the
    /// connection is broken (a reply the client cannot accept) and stays so.
    pub fn poll_answer(&mut self) -> Result<Option<Answer<'_>>> {
        match self {
            Wire::Native { core, .. } => {
                let Some(completion) = core.poll_completion()? else {
                    return Ok(None);
                };
                let notice = completion.is_notice();
                let granted_share = completion.notice().and_then(granted_share);
                let failure = if completion.is_ok() || notice {
                    None
                } else {
                    completion.result().err().map(|error| error.to_string())
                };
                Ok(Some(Answer {
                    request_id: completion.request_id,
                    failure,
                    data: completion.data,
                    notice,
                    granted_share,
                }))
            }
            Wire::Nbd(core) => {
                let Some(completion) = core.poll_completion()? else {
                    return Ok(None);
                };
                Ok(Some(Answer {
                    request_id: completion.cookie,
                    failure: completion.error_text(),
                    data: completion.data,
                    notice: false,
                    granted_share: None,
                }))
            }
        }
    }
}

/// What a device notice grants, as a share of the reservation (1.0 when recovered).
fn granted_share(body: reflex_client::RenegotiateBody) -> Option<f64> {
    use reflex_proto::native::RenegotiateReason;
    match body.reason {
        RenegotiateReason::DeficitLimit => None,
        _ if body.reserved_tokens_per_sec == 0 => Some(1.0),
        _ => Some(
            (body.granted_tokens_per_sec as f64 / body.reserved_tokens_per_sec as f64).min(1.0),
        ),
    }
}
