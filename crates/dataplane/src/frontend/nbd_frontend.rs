//! NBD: the handshake (`reflex_proto::nbd::Handshake`), then transmission requests validated
//! against the session the handshake chose.

use std::sync::Arc;

use reflex_proto::nbd::{self, Errno, ExportTable, Handshake, HandshakeConfig, Session};

use super::{Action, Answer, Decoded, IoKind, IoRequest, Tag};
use crate::control::TenantRef;

// ---------------------------------------------------------------------------------------------
// NBD

/// Where an export's I/O goes and whom it is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportBinding {
    pub namespace_index: u16,
    /// The tenant bound to the export in the configuration; `NONE` when none is (or the
    /// namespace has no QoS): the namespace's default tenant.
    pub tenant: TenantRef,
    /// The device submission queue (priority class) of the tenant's configuration; `None`:
    /// the connection's own (the default class).
    pub device_queue: Option<u16>,
}

/// The NBD exports of a server: the codec's table (what clients see) and, at the same index,
/// each export's namespace and tenant. Built at start and shared by the connections; a
/// namespace added or removed at run time, or an export rebound by a reload, makes a new one
/// (sessions already in transmission keep the binding they negotiated).
#[derive(Debug)]
pub struct NbdExports {
    table: Arc<ExportTable>,
    bindings: Vec<ExportBinding>,
    handshake: HandshakeConfig,
    /// Export names served only over TLS (`[tls] nbd_tls_only_exports`), kept for exports
    /// added at run time.
    tls_only: Arc<Vec<String>>,
}

impl NbdExports {
    /// `exports[i]` is offered as export `i`; `default_name` is the export for the empty name.
    pub fn new(
        exports: Vec<(nbd::Export, ExportBinding)>,
        default_name: Option<&str>,
    ) -> Result<NbdExports, nbd::ExportError> {
        let (exports, bindings): (Vec<_>, Vec<_>) = exports.into_iter().unzip();
        let table = ExportTable::new(exports, default_name)?;
        Ok(NbdExports {
            table: Arc::new(table),
            bindings,
            handshake: HandshakeConfig::default(),
            tls_only: Arc::new(Vec::new()),
        })
    }

    /// The same exports with STARTTLS offered or required (`[tls] nbd`).
    pub fn with_tls(mut self, tls: nbd::TlsPolicy) -> NbdExports {
        self.handshake.tls = tls;
        self
    }

    /// The same exports, those named in `names` served only over TLS (the spec's
    /// SELECTIVETLS mode; needs STARTTLS offered, [`Self::with_tls`]). Exports added later
    /// under one of these names are TLS-only too.
    pub fn with_tls_only(self, names: Vec<String>) -> Result<NbdExports, nbd::ExportError> {
        let exports: Vec<nbd::Export> = self
            .table
            .exports()
            .iter()
            .map(|export| {
                if names.contains(&export.name) {
                    export.clone().tls_only()
                } else {
                    export.clone()
                }
            })
            .collect();
        let table = ExportTable::new(exports, self.table.default_name())?;
        Ok(NbdExports {
            table: Arc::new(table),
            bindings: self.bindings,
            handshake: self.handshake,
            tls_only: Arc::new(names),
        })
    }

    pub fn table(&self) -> &ExportTable {
        &self.table
    }

    pub fn binding(&self, export_index: usize) -> Option<ExportBinding> {
        self.bindings.get(export_index).copied()
    }

    /// This table with one more export (a namespace added at run time). Refused when the
    /// name is taken or the table is full.
    pub fn with_added(
        &self,
        export: nbd::Export,
        binding: ExportBinding,
    ) -> Result<NbdExports, nbd::ExportError> {
        let mut exports: Vec<nbd::Export> = self.table.exports().to_vec();
        let export = if self.tls_only.contains(&export.name) {
            export.tls_only()
        } else {
            export
        };
        exports.push(export);
        let table = ExportTable::new(exports, self.table.default_name())?;
        let mut bindings = self.bindings.clone();
        bindings.push(binding);
        Ok(NbdExports {
            table: Arc::new(table),
            bindings,
            handshake: self.handshake,
            tls_only: Arc::clone(&self.tls_only),
        })
    }

    /// This table with export `name`'s tenant and device queue replaced (a configuration
    /// reload moved its binding); `None` when no export is called `name` or nothing changes.
    pub fn with_binding(
        &self,
        name: &str,
        tenant: TenantRef,
        device_queue: Option<u16>,
    ) -> Option<NbdExports> {
        let index = self
            .table
            .exports()
            .iter()
            .position(|export| export.name == name)?;
        let binding = self.bindings.get(index)?;
        if binding.tenant == tenant && binding.device_queue == device_queue {
            return None;
        }
        let mut bindings = self.bindings.clone();
        bindings[index] = ExportBinding {
            tenant,
            device_queue,
            ..*binding
        };
        Some(NbdExports {
            table: Arc::clone(&self.table),
            bindings,
            handshake: self.handshake,
            tls_only: Arc::clone(&self.tls_only),
        })
    }

    /// This table without the exports of namespace slot `namespace_index` (removed at run
    /// time); the default export goes too if it was one of them. Sessions already in
    /// transmission keep their binding (their requests are refused from then on).
    pub fn without_namespace(&self, namespace_index: u16) -> NbdExports {
        let (exports, bindings): (Vec<nbd::Export>, Vec<ExportBinding>) = self
            .table
            .exports()
            .iter()
            .zip(&self.bindings)
            .filter(|(_, binding)| binding.namespace_index != namespace_index)
            .map(|(export, binding)| (export.clone(), *binding))
            .unzip();
        let default = self
            .table
            .default_name()
            .filter(|name| exports.iter().any(|export| export.name == *name));
        match ExportTable::new(exports.clone(), default) {
            Ok(table) => NbdExports {
                table: Arc::new(table),
                bindings,
                handshake: self.handshake,
                tls_only: Arc::clone(&self.tls_only),
            },
            // A subset of a valid table is valid; keep serving the old one rather than fail.
            Err(error) => {
                tracing::error!(%error, "export table without a namespace refused");
                NbdExports {
                    table: Arc::clone(&self.table),
                    bindings: self.bindings.clone(),
                    handshake: self.handshake,
                    tls_only: Arc::clone(&self.tls_only),
                }
            }
        }
    }
}

/// One NBD connection: handshake, then transmission.
#[derive(Debug)]
pub struct NbdFrontend {
    exports: Arc<NbdExports>,
    pub(super) phase: NbdPhase,
}

#[derive(Debug)]
pub(super) enum NbdPhase {
    /// Boxed: the handshake's buffers are large and gone once transmission begins.
    Handshake(Box<Handshake>),
    Transmission(Transmission),
    /// `NBD_OPT_ABORT` or end of stream during the handshake: nothing more to decode.
    Ended,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Transmission {
    pub(super) session: Session,
    binding: ExportBinding,
    /// Requests from now on are answered ESHUTDOWN (except DISC).
    shutting_down: bool,
    /// `NBD_CMD_DISC` arrived: nothing after it is decoded.
    disconnected: bool,
}

impl NbdFrontend {
    /// The device queue the export's configuration gives its I/O, once the handshake chose
    /// an export.
    pub(super) fn device_queue(&self) -> Option<u16> {
        match &self.phase {
            NbdPhase::Transmission(transmission) => transmission.binding.device_queue,
            _ => None,
        }
    }

    pub(super) fn new(exports: Arc<NbdExports>) -> NbdFrontend {
        let handshake = Handshake::new(Arc::clone(&exports.table), exports.handshake);
        NbdFrontend {
            exports,
            phase: NbdPhase::Handshake(Box::new(handshake)),
        }
    }

    pub(super) fn decode(&mut self, input: &[u8]) -> Decoded {
        loop {
            let handshake = match &mut self.phase {
                NbdPhase::Handshake(handshake) => handshake,
                NbdPhase::Transmission(transmission) => return transmission.decode(input),
                NbdPhase::Ended => return Decoded::NeedMore,
            };
            // Output first: replies go out in order, and the last ACK before transmission.
            if !handshake.pending_output().is_empty() {
                return Decoded::Request {
                    header_bytes: 0,
                    payload_bytes: 0,
                    tag: Tag::None,
                    action: Action::Output,
                };
            }
            if handshake.take_start_tls() {
                return Decoded::StartTls { consumed_bytes: 0 };
            }
            match handshake.outcome() {
                Some(nbd::Outcome::Transmission(session)) => {
                    let Some(binding) = self.exports.binding(session.export_index()) else {
                        return Decoded::Close("the handshake chose an export out of range".into());
                    };
                    self.phase = NbdPhase::Transmission(Transmission {
                        session,
                        binding,
                        shutting_down: false,
                        disconnected: false,
                    });
                    // The bytes after NBD_OPT_GO are requests: decode them now.
                    continue;
                }
                Some(nbd::Outcome::Aborted | nbd::Outcome::Disconnected) => {
                    self.phase = NbdPhase::Ended;
                    return Decoded::Finish { consumed_bytes: 0 };
                }
                None => {}
            }
            if input.is_empty() {
                return Decoded::NeedMore;
            }
            return match handshake.handle_bytes(input) {
                Err(e) => Decoded::Close(format!("NBD handshake: {e}")),
                Ok(0) if handshake.pending_output().is_empty() && handshake.outcome().is_none() => {
                    Decoded::NeedMore
                }
                Ok(consumed) => Decoded::Consumed(consumed),
            };
        }
    }

    pub(super) fn begin_shutdown(&mut self) -> bool {
        match &mut self.phase {
            NbdPhase::Handshake(handshake) => {
                handshake.begin_shutdown();
                false
            }
            NbdPhase::Transmission(transmission) => {
                transmission.shutting_down = true;
                !transmission.disconnected
            }
            NbdPhase::Ended => false,
        }
    }
}

impl Transmission {
    fn decode(&mut self, input: &[u8]) -> Decoded {
        if self.disconnected {
            return Decoded::NeedMore;
        }
        let (header, header_bytes) = match nbd::decode_request(input) {
            Ok(Some(decoded)) => decoded,
            Ok(None) => return Decoded::NeedMore,
            Err(e) => return Decoded::Close(e.to_string()),
        };
        let payload_bytes = u64::from(header.payload_length_bytes());
        let refuse = |errno: Errno| Decoded::Request {
            header_bytes,
            payload_bytes,
            tag: Tag::NbdRefused {
                cookie: header.cookie,
            },
            action: Action::Reply(Answer::Nbd(errno)),
        };
        let is_disconnect = header.command() == Ok(nbd::CommandType::Disc);
        if self.shutting_down && !is_disconnect {
            return refuse(Errno::Shutdown);
        }
        let command = match self.session.validate(&header) {
            Ok(command) => command,
            Err(errno) => return refuse(errno),
        };
        let (kind, offset_bytes, length_bytes) = match command.command() {
            nbd::Command::Disconnect => {
                self.disconnected = true;
                return Decoded::Finish {
                    consumed_bytes: header_bytes,
                };
            }
            // Advisory, and no backend has a server-side cache a read would warm (files are
            // O_DIRECT, memory is memory): success at once.
            nbd::Command::Cache { .. } => {
                return Decoded::Request {
                    header_bytes,
                    payload_bytes,
                    tag: Tag::Nbd(command),
                    action: Action::Reply(Answer::Ok),
                };
            }
            nbd::Command::Read {
                offset_bytes,
                length_bytes,
            } => (IoKind::Read, offset_bytes, length_bytes),
            nbd::Command::Write {
                offset_bytes,
                length_bytes,
                fua,
            } => (IoKind::Write { fua }, offset_bytes, length_bytes),
            nbd::Command::Flush => (IoKind::Flush, 0, 0),
            nbd::Command::Trim {
                offset_bytes,
                length_bytes,
                fua,
            } => (IoKind::Trim { fua, hint: true }, offset_bytes, length_bytes),
            nbd::Command::WriteZeroes {
                offset_bytes,
                length_bytes,
                fua,
                no_hole,
                fast_zero,
            } => (
                IoKind::WriteZeroes {
                    fua,
                    no_hole,
                    fast: fast_zero,
                },
                offset_bytes,
                length_bytes,
            ),
            nbd::Command::BlockStatus {
                offset_bytes,
                length_bytes,
                req_one,
            } => (IoKind::BlockStatus { req_one }, offset_bytes, length_bytes),
        };
        Decoded::Request {
            header_bytes,
            payload_bytes,
            tag: Tag::Nbd(command),
            action: Action::Io(IoRequest {
                kind,
                namespace_index: self.binding.namespace_index,
                offset_bytes,
                length_bytes,
                tenant: self.binding.tenant,
            }),
        }
    }
}
