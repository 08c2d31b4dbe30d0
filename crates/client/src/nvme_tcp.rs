//! A small NVMe/TCP initiator (host): enough to attach a controller, identify it and its
//! namespaces, and read, write, flush and deallocate through I/O queues, with header and
//! data digests on or off. It tests reflexd's NVMe/TCP target (`docs/NVME-TCP.md`) and, to
//! show the two are not tuned to each other, SPDK's `nvmf_tgt`.
//!
//! Two layers:
//! - [`PduReceiver`], sans-IO: collects received bytes and hands out whole PDUs, their
//!   header digest checked by the codec and their data digest checked here. It never panics
//!   on the target's bytes; a broken PDU is a [`NvmeTcpError::Protocol`].
//! - [`NvmeTcpQueue`], blocking: one TCP connection, one queue (ICReq/ICResp, Connect), and
//!   one command at a time ([`NvmeTcpQueue::execute`]): in-capsule data for writes that fit
//!   the target's in-capsule size, H2CData after each R2T otherwise, C2HData for reads (with
//!   or without the SUCCESS flag). [`NvmeTcpController`] is an admin queue plus the
//!   enable handshake (CC.EN, CSTS.RDY), Identify, Set Features (number of queues), Keep
//!   Alive and I/O queues connected to it.
//!
//! With [`NvmeTcpOptions::with_tls_psk`] every queue starts TLS 1.3 with the host's
//! pre-shared key before its ICReq (TP 8011, `nvme_tcp_tls.rs`).
//!
//! Tests can also drive a queue by hand: [`NvmeTcpQueue::send_raw`] writes bytes as they
//! are, [`NvmeTcpQueue::receive_pdu`] returns the next PDU, whatever it is.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use reflex_proto::nvme_tcp::admin::{
    self, CHANGED_NAMESPACES_LOG_SIZE, IDENTIFY_SIZE, IdentifyController, IdentifyNamespace,
    decode_active_namespaces, decode_namespace_descriptors,
};
use reflex_proto::nvme_tcp::command::{
    CNTLID_DYNAMIC, ConnectData, DSM_RANGE_SIZE, DsmRange, SglDescriptor, admin_opcode, cns,
    feature, io_opcode, log_page, property, sgl,
};
use reflex_proto::nvme_tcp::pdu::{
    self, DataHeader, Digests, Framing, IcReq, Pdu, PduError, PduType, flags,
};
use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, IdentityForm};
use reflex_proto::nvme_tcp::{Command, Completion, Status};
use thiserror::Error;

use crate::nvme_tcp_tls::Link;
pub use crate::nvme_tcp_tls::NvmeTls;

/// Bytes one received PDU may have (header, padding, data and digests): the largest data
/// PDU a target sends the initiator (MDTS-sized reads are capped by [`TRANSFER_BYTES_MAX`]).
pub const PDU_BYTES_MAX: usize = TRANSFER_BYTES_MAX + pdu::HEADER_BYTES_MAX + pdu::DIGEST_SIZE;
/// The largest transfer one command of this initiator moves.
pub const TRANSFER_BYTES_MAX: usize = 1 << 20;
/// How long enabling or shutting down a controller may take.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// In-capsule data the admin queue sends (Connect's data; NVMe/TCP targets take 8 KiB).
const ADMIN_IN_CAPSULE_BYTES: usize = 4096;

const _: () = assert!(TRANSFER_BYTES_MAX >= admin::IDENTIFY_SIZE);

/// What went wrong talking to a target.
#[derive(Debug, Error)]
pub enum NvmeTcpError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The target closed the connection.
    #[error("the target closed the connection")]
    Closed,
    /// The target's bytes broke the transport (a malformed PDU, a wrong digest).
    #[error("protocol: {0}")]
    Protocol(#[from] PduError),
    /// A PDU's data does not match its data digest.
    #[error("data digest mismatch")]
    DataDigest,
    /// The target sent a PDU the initiator did not expect now.
    #[error("unexpected PDU from the target: {0}")]
    Unexpected(&'static str),
    /// The target ended the connection with a C2HTermReq.
    #[error("the target terminated the connection: FES {fes:#x}, FEI {fei}")]
    Terminated { fes: u16, fei: u32 },
    /// A command completed with an error status.
    #[error("command failed: {status}")]
    Status {
        status: Status,
        completion: Completion,
    },
    /// The caller asked for more than this initiator moves in one command.
    #[error("{length_bytes} bytes exceed the transfer limit of {max_bytes}")]
    TooLarge {
        length_bytes: usize,
        max_bytes: usize,
    },
    /// The controller did not become ready (or finish shutting down) in time.
    #[error("the controller did not reach {0} in time")]
    NotReady(&'static str),
    /// TLS could not start: an unusable key, or the target refused the handshake (a wrong
    /// key, an identity it does not know, no TLS on its port).
    #[error("TLS: {0}")]
    Tls(String),
}

/// How an initiator attaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeTcpOptions {
    pub host_nqn: String,
    pub host_id: [u8; 16],
    pub subsystem_nqn: String,
    pub digests: Digests,
    /// Entries of each queue (SQSIZE + 1).
    pub queue_entries: u16,
    /// Keep-alive timeout asked for in Connect (0: none).
    pub keep_alive_ms: u32,
    /// Longest wait for any one answer.
    pub timeout: Duration,
    /// TLS with a pre-shared key (TP 8011) on every queue; `None`: plaintext.
    pub tls: Option<NvmeTls>,
}

impl NvmeTcpOptions {
    pub fn new(host_nqn: &str, subsystem_nqn: &str) -> NvmeTcpOptions {
        let mut host_id = [0u8; 16];
        let digest = pdu::crc32c(host_nqn.as_bytes()).to_le_bytes();
        host_id[..4].copy_from_slice(&digest);
        host_id[15] = 1;
        NvmeTcpOptions {
            host_nqn: host_nqn.to_string(),
            host_id,
            subsystem_nqn: subsystem_nqn.to_string(),
            digests: Digests::NONE,
            queue_entries: 32,
            keep_alive_ms: 0,
            timeout: Duration::from_secs(20),
            tls: None,
        }
    }

    /// Every queue over TLS with `psk`, under the identity of this host and subsystem.
    pub fn with_tls_psk(mut self, psk: ConfiguredPsk) -> NvmeTcpOptions {
        self.tls = Some(NvmeTls {
            psk,
            host_nqn: self.host_nqn.clone(),
            subsystem_nqn: self.subsystem_nqn.clone(),
            identity_form: IdentityForm::Version0,
        });
        self
    }

    /// Offers TP 8018's identity form (`NVMe1R0x ... <PSK digest>`) instead of TP 8011's
    /// (after [`NvmeTcpOptions::with_tls_psk`]; without TLS it changes nothing).
    pub fn with_tls_identity_form(mut self, form: IdentityForm) -> NvmeTcpOptions {
        if let Some(tls) = self.tls.as_mut() {
            tls.identity_form = form;
        }
        self
    }

    pub fn with_digests(mut self, digests: Digests) -> NvmeTcpOptions {
        self.digests = digests;
        self
    }
}

/// One PDU as received: its decoded header and its data (digest checked, removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedPdu {
    pub pdu: Pdu,
    pub flags: u8,
    pub data: Vec<u8>,
}

/// Sans-IO receive side: bytes in, whole PDUs out.
#[derive(Debug, Default)]
pub struct PduReceiver {
    buffer: Vec<u8>,
    digests: Digests,
}

impl PduReceiver {
    /// The digests negotiated by ICReq/ICResp (none before).
    pub fn set_digests(&mut self, digests: Digests) {
        self.digests = digests;
    }

    pub fn handle_bytes(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Bytes received and not yet part of a returned PDU.
    pub fn buffered_bytes(&self) -> usize {
        self.buffer.len()
    }

    /// The next whole PDU (`Ok(None)`: need more bytes).
    pub fn poll_pdu(&mut self) -> Result<Option<ReceivedPdu>, NvmeTcpError> {
        let Some(decoded) = pdu::decode_header(&self.buffer, self.digests)? else {
            return Ok(None);
        };
        if decoded.total_bytes > PDU_BYTES_MAX {
            return Err(NvmeTcpError::Unexpected("a PDU larger than any transfer"));
        }
        if self.buffer.len() < decoded.total_bytes {
            return Ok(None);
        }
        let data = match (decoded.pdu, decoded.data) {
            (Pdu::C2hTermReq(_) | Pdu::H2cTermReq(_), _) => {
                self.buffer[decoded.header_bytes..decoded.total_bytes].to_vec()
            }
            (_, Some(span)) => {
                let end = span.offset + span.length as usize;
                let data = self
                    .buffer
                    .get(span.offset..end)
                    .ok_or(NvmeTcpError::Unexpected("PDU data beyond PLEN"))?;
                if span.digest {
                    let stored = self
                        .buffer
                        .get(end..end + pdu::DIGEST_SIZE)
                        .and_then(|bytes| bytes.first_chunk::<4>())
                        .ok_or(NvmeTcpError::Unexpected("data digest beyond PLEN"))?;
                    if pdu::crc32c(data) != u32::from_le_bytes(*stored) {
                        return Err(NvmeTcpError::DataDigest);
                    }
                }
                data.to_vec()
            }
            (_, None) => Vec::new(),
        };
        self.buffer.drain(..decoded.total_bytes);
        Ok(Some(ReceivedPdu {
            pdu: decoded.pdu,
            flags: decoded.flags,
            data,
        }))
    }
}

/// Where a command's data goes.
#[derive(Debug, Clone, Copy)]
pub enum Transfer<'a> {
    None,
    /// Host to controller (a write).
    ToTarget(&'a [u8]),
    /// Controller to host (a read) of this many bytes.
    FromTarget(usize),
}

/// One queue: one TCP connection.
#[derive(Debug)]
pub struct NvmeTcpQueue {
    stream: Link,
    receiver: PduReceiver,
    /// How this side lays out PDUs (the negotiated digests, CPDA).
    framing: Framing,
    maxh2cdata: u32,
    /// In-capsule data this queue sends (0: always by R2T).
    in_capsule_bytes: usize,
    qid: u16,
    next_cid: u16,
    timeout: Duration,
}

impl NvmeTcpQueue {
    /// Connects TCP and exchanges ICReq/ICResp.
    pub fn open(
        address: SocketAddr,
        digests: Digests,
        timeout: Duration,
    ) -> Result<NvmeTcpQueue, NvmeTcpError> {
        NvmeTcpQueue::open_with(address, digests, timeout, None)
    }

    /// Connects TCP, starts TLS when `tls` is given, and exchanges ICReq/ICResp.
    pub fn open_with(
        address: SocketAddr,
        digests: Digests,
        timeout: Duration,
        tls: Option<&NvmeTls>,
    ) -> Result<NvmeTcpQueue, NvmeTcpError> {
        let stream = TcpStream::connect_timeout(&address, timeout)?;
        stream.set_nodelay(true)?;
        let stream = Link::start(stream, tls, timeout)?;
        let mut queue = NvmeTcpQueue {
            stream,
            receiver: PduReceiver::default(),
            framing: Framing::PLAIN,
            maxh2cdata: pdu::MAXH2CDATA_MIN,
            in_capsule_bytes: 0,
            qid: 0,
            next_cid: 1,
            timeout,
        };
        let request = IcReq {
            pfv: 0,
            hpda: 0,
            digests,
            maxr2t: 0,
        };
        queue.send_raw(&pdu::encode_ic_req(&request))?;
        let received = queue.receive_pdu()?;
        let Pdu::IcResp(response) = received.pdu else {
            return Err(NvmeTcpError::Unexpected("not an ICResp"));
        };
        if response.maxh2cdata < pdu::MAXH2CDATA_MIN {
            return Err(NvmeTcpError::Unexpected("MAXH2CDATA below 4096"));
        }
        let Some(framing) = Framing::new(response.digests, response.cpda) else {
            return Err(NvmeTcpError::Unexpected("CPDA above 31"));
        };
        queue.framing = framing;
        queue.maxh2cdata = response.maxh2cdata;
        queue.receiver.set_digests(response.digests);
        Ok(queue)
    }

    /// The TLS version and cipher suite this queue runs over (`None`: plaintext).
    pub fn tls_session(&self) -> Option<(&'static str, String)> {
        self.stream.tls_session()
    }

    /// The digests the target agreed to.
    pub fn digests(&self) -> Digests {
        self.framing.digests
    }

    pub fn maxh2cdata(&self) -> u32 {
        self.maxh2cdata
    }

    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Sets the in-capsule data this queue sends (from the target's IOCCSZ).
    pub fn set_in_capsule_bytes(&mut self, bytes: usize) {
        self.in_capsule_bytes = bytes;
    }

    /// Fabrics Connect for queue `qid` of controller `cntlid` (dynamic for the admin queue).
    /// Returns the controller id.
    pub fn connect(
        &mut self,
        options: &NvmeTcpOptions,
        qid: u16,
        cntlid: u16,
    ) -> Result<u16, NvmeTcpError> {
        let data = ConnectData {
            host_id: options.host_id,
            cntlid,
            subsystem_nqn: options.subsystem_nqn.clone(),
            host_nqn: options.host_nqn.clone(),
        }
        .encode();
        let keep_alive_ms = if qid == 0 { options.keep_alive_ms } else { 0 };
        let command = Command::connect_command(
            0,
            qid,
            options.queue_entries.saturating_sub(1),
            0,
            keep_alive_ms,
        );
        let saved = self.in_capsule_bytes;
        self.in_capsule_bytes = ADMIN_IN_CAPSULE_BYTES;
        let result = self.execute(command, Transfer::ToTarget(&data));
        self.in_capsule_bytes = saved;
        let (completion, _) = result?;
        self.qid = qid;
        Ok(completion.dw0 as u16)
    }

    /// Sends `command` (its CID replaced, no data) and returns its CID without waiting: for
    /// a command the target holds, as an Asynchronous Event Request until an event.
    pub fn submit_without_data(&mut self, mut command: Command) -> Result<u16, NvmeTcpError> {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        command.set_cid(cid);
        self.submit(&mut command, Transfer::None)?;
        Ok(cid)
    }

    /// Waits (at most the queue's timeout) for the completion of `cid`, sent with
    /// [`Self::submit_without_data`]; it must be the next the target sends.
    pub fn wait_completion(&mut self, cid: u16) -> Result<Completion, NvmeTcpError> {
        self.await_completion(cid, Transfer::None)
            .map(|(completion, _)| completion)
    }

    /// Sends `command` (its CID replaced) with its data and waits for its completion;
    /// returns it and, for a read, the data. An error status is [`NvmeTcpError::Status`].
    pub fn execute(
        &mut self,
        mut command: Command,
        transfer: Transfer<'_>,
    ) -> Result<(Completion, Vec<u8>), NvmeTcpError> {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        command.set_cid(cid);
        self.submit(&mut command, transfer)?;
        self.await_completion(cid, transfer)
    }

    fn submit(
        &mut self,
        command: &mut Command,
        transfer: Transfer<'_>,
    ) -> Result<(), NvmeTcpError> {
        let length = match transfer {
            Transfer::None => 0,
            Transfer::ToTarget(data) => data.len(),
            Transfer::FromTarget(length) => length,
        };
        if length > TRANSFER_BYTES_MAX {
            return Err(NvmeTcpError::TooLarge {
                length_bytes: length,
                max_bytes: TRANSFER_BYTES_MAX,
            });
        }
        let in_capsule = matches!(transfer, Transfer::ToTarget(data)
            if !data.is_empty() && data.len() <= self.in_capsule_bytes);
        command.set_sgl(SglDescriptor {
            address: 0,
            length: length as u32,
            identifier: if in_capsule {
                sgl::DATA_BLOCK_OFFSET
            } else {
                sgl::TRANSPORT_DATA_BLOCK
            },
        });
        let mut message = Vec::new();
        match transfer {
            Transfer::ToTarget(data) if in_capsule => {
                let header = self.framing.capsule_cmd(&command.0, data.len() as u32);
                message.extend_from_slice(header.as_bytes());
                message.extend_from_slice(data);
                if self.framing.digests.data {
                    message.extend_from_slice(&pdu::crc32c(data).to_le_bytes());
                }
            }
            _ => {
                let header = self.framing.capsule_cmd(&command.0, 0);
                message.extend_from_slice(header.as_bytes());
            }
        }
        self.send_raw(&message)
    }

    fn await_completion(
        &mut self,
        cid: u16,
        transfer: Transfer<'_>,
    ) -> Result<(Completion, Vec<u8>), NvmeTcpError> {
        let mut read_data = match transfer {
            Transfer::FromTarget(length) => vec![0u8; length],
            _ => Vec::new(),
        };
        let mut read_bytes = 0usize;
        loop {
            let received = self.receive_pdu()?;
            match received.pdu {
                Pdu::CapsuleResp(cqe) => {
                    let completion = Completion::from_bytes(&cqe);
                    if completion.cid != cid {
                        return Err(NvmeTcpError::Unexpected("a completion for another CID"));
                    }
                    if !completion.status.is_success() {
                        return Err(NvmeTcpError::Status {
                            status: completion.status,
                            completion,
                        });
                    }
                    if read_bytes != read_data.len() {
                        return Err(NvmeTcpError::Unexpected("success before all read data"));
                    }
                    return Ok((completion, read_data));
                }
                Pdu::C2hData(header) => {
                    if header.cccid != cid {
                        return Err(NvmeTcpError::Unexpected("C2HData for another CID"));
                    }
                    let start = header.offset as usize;
                    let Some(slot) = read_data.get_mut(start..start + received.data.len()) else {
                        return Err(NvmeTcpError::Unexpected("C2HData beyond the read"));
                    };
                    slot.copy_from_slice(&received.data);
                    read_bytes += received.data.len();
                    if received.flags & flags::SUCCESS != 0 {
                        if read_bytes != read_data.len() {
                            return Err(NvmeTcpError::Unexpected("SUCCESS before all read data"));
                        }
                        return Ok((Completion::new(cid, Status::SUCCESS), read_data));
                    }
                }
                Pdu::R2t(r2t) => {
                    let Transfer::ToTarget(data) = transfer else {
                        return Err(NvmeTcpError::Unexpected("R2T for a command without data"));
                    };
                    if r2t.cccid != cid {
                        return Err(NvmeTcpError::Unexpected("R2T for another CID"));
                    }
                    self.send_r2t_data(r2t, data)?;
                }
                Pdu::C2hTermReq(term) => {
                    return Err(NvmeTcpError::Terminated {
                        fes: term.fes,
                        fei: term.fei,
                    });
                }
                _ => return Err(NvmeTcpError::Unexpected("a PDU a host does not receive")),
            }
        }
    }

    /// Sends the data an R2T asks for, in H2CData PDUs of at most MAXH2CDATA.
    fn send_r2t_data(&mut self, r2t: DataHeader, data: &[u8]) -> Result<(), NvmeTcpError> {
        let start = r2t.offset as usize;
        let Some(wanted) = data.get(start..start + r2t.length as usize) else {
            return Err(NvmeTcpError::Unexpected("R2T beyond the command's data"));
        };
        let chunk_bytes = self.maxh2cdata as usize;
        let chunks = wanted.len().div_ceil(chunk_bytes);
        for (index, chunk) in wanted.chunks(chunk_bytes).enumerate() {
            let last = index + 1 == chunks;
            let header = self.framing.data_pdu(
                PduType::H2cData,
                if last { flags::LAST_PDU } else { 0 },
                DataHeader {
                    cccid: r2t.cccid,
                    ttag: r2t.ttag,
                    offset: (start + index * chunk_bytes) as u32,
                    length: chunk.len() as u32,
                },
            );
            let mut message = Vec::with_capacity(header.len() + chunk.len() + 4);
            message.extend_from_slice(header.as_bytes());
            message.extend_from_slice(chunk);
            if self.framing.digests.data {
                message.extend_from_slice(&pdu::crc32c(chunk).to_le_bytes());
            }
            self.send_raw(&message)?;
        }
        Ok(())
    }

    /// Writes bytes as they are.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), NvmeTcpError> {
        self.stream.write_all(bytes)?;
        Ok(())
    }

    /// The next PDU from the target, waiting at most the queue's timeout.
    pub fn receive_pdu(&mut self) -> Result<ReceivedPdu, NvmeTcpError> {
        let deadline = Instant::now() + self.timeout;
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            if let Some(received) = self.receiver.poll_pdu()? {
                return Ok(received);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
            }
            self.stream.tcp().set_read_timeout(Some(left))?;
            let count = match self.stream.read(&mut buffer) {
                Ok(count) => count,
                // A signal (the server's threads in the same test process use them) is no
                // error of the connection: read again.
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error.into()),
            };
            if count == 0 {
                return Err(NvmeTcpError::Closed);
            }
            self.receiver.handle_bytes(&buffer[..count]);
        }
    }

    /// Waits until the target closes the connection, discarding what it sends; false if it
    /// is still open after `timeout`.
    pub fn closed_within(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut buffer = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stream.tcp().set_read_timeout(Some(left)).is_err() {
                return false;
            }
            match self.stream.read(&mut buffer) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return false;
                }
                Err(_) => return true,
            }
        }
    }
}

/// Identify Namespace with the block size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub size_blocks: u64,
    pub block_bytes: u32,
    pub identify: IdentifyNamespace,
}

/// An attached controller: its admin queue, enabled.
#[derive(Debug)]
pub struct NvmeTcpController {
    address: SocketAddr,
    options: NvmeTcpOptions,
    admin: NvmeTcpQueue,
    cntlid: u16,
    identify: IdentifyController,
    io_queues_granted: u16,
    next_qid: u16,
}

impl NvmeTcpController {
    /// Connects the admin queue, enables the controller (CC.EN = 1, wait for CSTS.RDY),
    /// identifies it and asks for `io_queues` I/O queues.
    pub fn attach(
        address: SocketAddr,
        options: NvmeTcpOptions,
        io_queues: u16,
    ) -> Result<NvmeTcpController, NvmeTcpError> {
        let mut admin = NvmeTcpQueue::open_with(
            address,
            options.digests,
            options.timeout,
            options.tls.as_ref(),
        )?;
        let cntlid = admin.connect(&options, 0, CNTLID_DYNAMIC)?;
        let cap = admin.property_get(property::CAP, true)?;
        let cc: u32 =
            property::CC_EN | (6 << property::CC_IOSQES_SHIFT) | (4 << property::CC_IOCQES_SHIFT);
        admin.property_set(property::CC, u64::from(cc))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        while admin.property_get(property::CSTS, false)? as u32 & property::CSTS_RDY == 0 {
            if Instant::now() >= deadline {
                return Err(NvmeTcpError::NotReady("CSTS.RDY"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut controller = NvmeTcpController {
            address,
            options,
            admin,
            cntlid,
            identify: IdentifyController::decode(&[0; IDENTIFY_SIZE]),
            io_queues_granted: 0,
            next_qid: 1,
        };
        let data = controller.identify_raw(cns::CONTROLLER, 0)?;
        controller.identify = IdentifyController::decode(&data);
        // I/O queues no longer than CAP.MQES allows.
        let entries_max = admin::queue_entries_max(cap).min(u32::from(u16::MAX)) as u16;
        controller.options.queue_entries = controller.options.queue_entries.min(entries_max);
        if io_queues > 0 {
            let wanted = u32::from(io_queues - 1);
            let (completion, _) = controller.admin.execute(
                set_features(feature::NUMBER_OF_QUEUES, wanted | (wanted << 16)),
                Transfer::None,
            )?;
            let granted = (completion.dw0 & 0xFFFF).min(completion.dw0 >> 16) + 1;
            controller.io_queues_granted = granted as u16;
        }
        Ok(controller)
    }

    pub fn cntlid(&self) -> u16 {
        self.cntlid
    }

    pub fn identify(&self) -> &IdentifyController {
        &self.identify
    }

    pub fn io_queues_granted(&self) -> u16 {
        self.io_queues_granted
    }

    pub fn admin(&mut self) -> &mut NvmeTcpQueue {
        &mut self.admin
    }

    /// Identify with `cns` for `nsid`: the 4 KiB structure.
    pub fn identify_raw(
        &mut self,
        cns: u8,
        nsid: u32,
    ) -> Result<[u8; IDENTIFY_SIZE], NvmeTcpError> {
        let mut command = Command::zeroed();
        command
            .set_opcode(admin_opcode::IDENTIFY)
            .set_nsid(nsid)
            .set_cdw(10, u32::from(cns));
        let (_, data) = self
            .admin
            .execute(command, Transfer::FromTarget(IDENTIFY_SIZE))?;
        let mut out = [0u8; IDENTIFY_SIZE];
        out.copy_from_slice(&data);
        Ok(out)
    }

    /// The active namespace ids.
    pub fn active_namespaces(&mut self) -> Result<Vec<u32>, NvmeTcpError> {
        let data = self.identify_raw(cns::ACTIVE_NAMESPACES, 0)?;
        Ok(decode_active_namespaces(&data))
    }

    pub fn namespace(&mut self, nsid: u32) -> Result<NamespaceInfo, NvmeTcpError> {
        let data = self.identify_raw(cns::NAMESPACE, nsid)?;
        let identify = IdentifyNamespace::decode(&data);
        Ok(NamespaceInfo {
            nsid,
            size_blocks: identify.size_blocks,
            block_bytes: 1u32
                .checked_shl(u32::from(identify.block_size_log2))
                .unwrap_or(0),
            identify,
        })
    }

    /// Namespace identification descriptors: `(NIDT, value)`.
    pub fn namespace_descriptors(&mut self, nsid: u32) -> Result<Vec<(u8, Vec<u8>)>, NvmeTcpError> {
        let data = self.identify_raw(cns::NAMESPACE_DESCRIPTORS, nsid)?;
        Ok(decode_namespace_descriptors(&data))
    }

    /// Get Log Page `log_page` for all namespaces: `length` bytes (a multiple of 4) from
    /// offset 0; `retain_event` sets RAE (the event of the log stays masked).
    pub fn log_page(
        &mut self,
        log_page: u8,
        length: usize,
        retain_event: bool,
    ) -> Result<Vec<u8>, NvmeTcpError> {
        let dwords = (length / 4).saturating_sub(1) as u32;
        let mut command = Command::zeroed();
        command
            .set_opcode(admin_opcode::GET_LOG_PAGE)
            .set_nsid(u32::MAX)
            .set_cdw(
                10,
                u32::from(log_page) | (u32::from(retain_event) << 15) | ((dwords & 0xFFFF) << 16),
            )
            .set_cdw(11, dwords >> 16);
        let (_, data) = self.admin.execute(command, Transfer::FromTarget(length))?;
        Ok(data)
    }

    /// The Changed Namespace List (log page 04h, which the read clears): the NSIDs, or
    /// `[0xFFFFFFFF]` when more than 1024 changed.
    pub fn changed_namespaces(&mut self) -> Result<Vec<u32>, NvmeTcpError> {
        let data = self.log_page(
            log_page::CHANGED_NAMESPACES,
            CHANGED_NAMESPACES_LOG_SIZE,
            false,
        )?;
        Ok(data
            .chunks_exact(4)
            .map(|entry| u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]))
            .take_while(|&nsid| nsid != 0)
            .collect())
    }

    /// Sends an Asynchronous Event Request, which the target holds until an event; its CID
    /// (wait for it with [`NvmeTcpQueue::wait_completion`] on [`Self::admin`]).
    pub fn async_event_request(&mut self) -> Result<u16, NvmeTcpError> {
        let mut command = Command::zeroed();
        command.set_opcode(admin_opcode::ASYNC_EVENT_REQUEST);
        self.admin.submit_without_data(command)
    }

    pub fn keep_alive(&mut self) -> Result<(), NvmeTcpError> {
        let mut command = Command::zeroed();
        command.set_opcode(admin_opcode::KEEP_ALIVE);
        self.admin.execute(command, Transfer::None).map(|_| ())
    }

    /// Connects the next I/O queue (a new TCP connection).
    pub fn connect_io_queue(&mut self) -> Result<NvmeTcpQueue, NvmeTcpError> {
        let qid = self.next_qid;
        let mut queue = NvmeTcpQueue::open_with(
            self.address,
            self.options.digests,
            self.options.timeout,
            self.options.tls.as_ref(),
        )?;
        queue.connect(&self.options, qid, self.cntlid)?;
        let ioccsz_bytes = (self.identify.ioccsz as usize * 16).saturating_sub(64);
        queue.set_in_capsule_bytes(ioccsz_bytes);
        self.next_qid += 1;
        Ok(queue)
    }

    /// Shutdown notification (CC.SHN normal), waiting for CSTS.SHST complete.
    pub fn shutdown(&mut self) -> Result<(), NvmeTcpError> {
        let cc = self.admin.property_get(property::CC, false)? as u32;
        let cc = (cc & !property::CC_SHN_MASK) | (1 << property::CC_SHN_SHIFT);
        self.admin.property_set(property::CC, u64::from(cc))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let csts = self.admin.property_get(property::CSTS, false)? as u32;
            if csts & property::CSTS_SHST_MASK == property::SHST_COMPLETE {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NvmeTcpError::NotReady("CSTS.SHST complete"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl NvmeTcpQueue {
    pub fn property_get(&mut self, offset: u32, eight_bytes: bool) -> Result<u64, NvmeTcpError> {
        let command = Command::property(0, offset, eight_bytes, None);
        let (completion, _) = self.execute(command, Transfer::None)?;
        Ok(u64::from(completion.dw0) | (u64::from(completion.dw1) << 32))
    }

    pub fn property_set(&mut self, offset: u32, value: u64) -> Result<(), NvmeTcpError> {
        let command = Command::property(0, offset, false, Some(value));
        self.execute(command, Transfer::None).map(|_| ())
    }

    /// Reads `blocks` blocks of `block_bytes` at `slba` of namespace `nsid`.
    pub fn read(
        &mut self,
        nsid: u32,
        slba: u64,
        blocks: u32,
        block_bytes: u32,
    ) -> Result<Vec<u8>, NvmeTcpError> {
        let length = blocks as usize * block_bytes as usize;
        check_blocks(blocks, length)?;
        let command = Command::io(io_opcode::READ, 0, nsid, slba, blocks, false);
        let (_, data) = self.execute(command, Transfer::FromTarget(length))?;
        Ok(data)
    }

    /// Writes `data` (whole blocks of `block_bytes`) at `slba` of namespace `nsid`.
    pub fn write(
        &mut self,
        nsid: u32,
        slba: u64,
        data: &[u8],
        block_bytes: u32,
        fua: bool,
    ) -> Result<(), NvmeTcpError> {
        let blocks = (data.len() / block_bytes.max(1) as usize) as u32;
        check_blocks(blocks, data.len())?;
        let command = Command::io(io_opcode::WRITE, 0, nsid, slba, blocks, fua);
        self.execute(command, Transfer::ToTarget(data)).map(|_| ())
    }

    pub fn flush(&mut self, nsid: u32) -> Result<(), NvmeTcpError> {
        let mut command = Command::zeroed();
        command.set_opcode(io_opcode::FLUSH).set_nsid(nsid);
        self.execute(command, Transfer::None).map(|_| ())
    }

    pub fn write_zeroes(&mut self, nsid: u32, slba: u64, blocks: u32) -> Result<(), NvmeTcpError> {
        check_blocks(blocks, 0)?;
        let command = Command::io(io_opcode::WRITE_ZEROES, 0, nsid, slba, blocks, false);
        self.execute(command, Transfer::None).map(|_| ())
    }

    /// Dataset Management, deallocate: the ranges `(slba, blocks)`.
    pub fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), NvmeTcpError> {
        if ranges.is_empty() || ranges.len() > 256 {
            return Err(NvmeTcpError::TooLarge {
                length_bytes: ranges.len() * DSM_RANGE_SIZE,
                max_bytes: 256 * DSM_RANGE_SIZE,
            });
        }
        let mut data = Vec::with_capacity(ranges.len() * DSM_RANGE_SIZE);
        for &(slba, block_count) in ranges {
            data.extend_from_slice(
                &DsmRange {
                    attributes: 0,
                    block_count,
                    slba,
                }
                .encode(),
            );
        }
        let mut command = Command::zeroed();
        command
            .set_opcode(io_opcode::DATASET_MANAGEMENT)
            .set_nsid(nsid)
            .set_cdw(10, ranges.len() as u32 - 1)
            .set_cdw(11, 1 << 2);
        self.execute(command, Transfer::ToTarget(&data)).map(|_| ())
    }
}

fn check_blocks(blocks: u32, length: usize) -> Result<(), NvmeTcpError> {
    if blocks == 0 || blocks > 0x1_0000 || length > TRANSFER_BYTES_MAX {
        return Err(NvmeTcpError::TooLarge {
            length_bytes: length,
            max_bytes: TRANSFER_BYTES_MAX,
        });
    }
    Ok(())
}

/// A Set Features command for `feature` with CDW11 `value`.
pub fn set_features(feature: u8, value: u32) -> Command {
    features_command(admin_opcode::SET_FEATURES, feature, value)
}

/// A Get Features command for `feature` (current value) with CDW11 `value` (the selection
/// some features take, such as Temperature Threshold's sensor and threshold type).
pub fn get_features(feature: u8, value: u32) -> Command {
    features_command(admin_opcode::GET_FEATURES, feature, value)
}

fn features_command(opcode: u8, feature: u8, value: u32) -> Command {
    let mut command = Command::zeroed();
    command
        .set_opcode(opcode)
        .set_cdw(10, u32::from(feature))
        .set_cdw(11, value);
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_receive(chunks: &[&[u8]], digests: Digests) -> Result<Vec<ReceivedPdu>, String> {
        let mut receiver = PduReceiver::default();
        receiver.set_digests(digests);
        let mut found = Vec::new();
        for chunk in chunks {
            receiver.handle_bytes(chunk);
            while let Some(received) = receiver.poll_pdu().map_err(|e| e.to_string())? {
                found.push(received);
            }
        }
        Ok(found)
    }

    fn c2h(digests: Digests, data: &[u8]) -> Vec<u8> {
        let framing = Framing::new(digests, 0).unwrap_or(Framing::PLAIN);
        let header = framing.data_pdu(
            PduType::C2hData,
            flags::LAST_PDU | flags::SUCCESS,
            DataHeader {
                cccid: 7,
                ttag: 0,
                offset: 0,
                length: data.len() as u32,
            },
        );
        let mut out = header.as_bytes().to_vec();
        out.extend_from_slice(data);
        if digests.data {
            out.extend_from_slice(&pdu::crc32c(data).to_le_bytes());
        }
        out
    }

    #[test]
    fn a_pdu_split_anywhere_comes_out_whole() {
        let data: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        for digests in [Digests::NONE, Digests::BOTH] {
            let bytes = c2h(digests, &data);
            for split in [1, 8, 23, 24, 100, bytes.len() - 1] {
                let found = check_receive(&[&bytes[..split], &bytes[split..]], digests)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(found.len(), 1);
                assert_eq!(found[0].data, data);
                assert!(matches!(found[0].pdu, Pdu::C2hData(header) if header.cccid == 7));
            }
        }
    }

    #[test]
    fn a_wrong_data_digest_is_a_protocol_error() {
        let mut bytes = c2h(Digests::BOTH, &[1, 2, 3, 4]);
        let last = bytes.len() - 1;
        bytes[last] ^= 0xFF;
        let error = check_receive(&[&bytes], Digests::BOTH).err();
        assert!(error.is_some_and(|e| e.contains("data digest")));
    }

    #[test]
    fn a_wrong_header_digest_is_a_protocol_error() {
        let mut bytes = c2h(Digests::BOTH, &[1, 2, 3, 4]);
        bytes[10] ^= 0xFF;
        let error = check_receive(&[&bytes], Digests::BOTH).err();
        assert!(error.is_some_and(|e| e.contains("header digest")));
    }
}
