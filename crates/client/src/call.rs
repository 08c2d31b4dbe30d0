//! The requests of one blocking [`crate::Client`] call and how far each got.
//!
//! Why a type of its own: a call may outlive the connection it started on. With a
//! [`crate::ReconnectPolicy`] the client reconnects in the middle of a call, and the call
//! must then know, per request, whether it was answered (its data copied, its error kept),
//! interrupted and safe to repeat (submitted again on the new connection under the same id),
//! or interrupted and not safe to repeat (reported as of unknown outcome). Without a policy
//! the same bookkeeping simply runs on one connection.
//!
//! Requests are numbered `first_id + index`; a READ or WRITE larger than the server's
//! `max_io_size` is one request per chunk, submitted in order up to the window.
//! Invariants: each index is answered at most once (the core matches answers to outstanding
//! ids, and an id is outstanding on one connection at a time), and an index is in at most
//! one of: unsubmitted, answered, unknown.

use std::collections::{BTreeMap, VecDeque};

use reflex_proto::native::{RegisterBody, ReportBody};

use crate::core::{Completion, ConnectionCore, InterruptedRequest};
use crate::error::ClientError;

/// What one blocking call asks for.
pub(crate) enum Work<'a> {
    Read {
        namespace: u32,
        offset: u64,
        buf: &'a mut [u8],
    },
    Write {
        namespace: u32,
        offset: u64,
        data: &'a [u8],
        fua: bool,
    },
    Flush {
        namespace: u32,
    },
    Trim {
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    },
    Register(&'a RegisterBody),
    Unregister(u64),
    Bind(u64),
    Report(ReportBody),
    /// No request: waiting for notices.
    Nothing,
}

impl Work<'_> {
    /// Payload bytes of a READ or WRITE.
    fn transfer_bytes(&self) -> Option<usize> {
        match self {
            Work::Read { buf, .. } => Some(buf.len()),
            Work::Write { data, .. } => Some(data.len()),
            _ => None,
        }
    }
}

pub(crate) struct Call<'a> {
    work: Work<'a>,
    first_id: u64,
    request_count: usize,
    /// READ and WRITE: payload bytes per request (the last may be shorter).
    chunk_bytes: usize,
    /// Indices to submit on the current connection, ascending.
    unsubmitted: VecDeque<usize>,
    answered: Vec<bool>,
    answered_count: usize,
    first_error: Option<ClientError>,
    /// REGISTER: the handle it answered.
    handle: Option<u64>,
    /// Interrupted and not repeated: their outcome is unknown.
    unknown: Vec<InterruptedRequest>,
    /// Interrupted and queued to be repeated, by index, until answered.
    repeating: BTreeMap<usize, InterruptedRequest>,
}

impl<'a> Call<'a> {
    /// How many request ids `work` needs when READs and WRITEs are cut at `chunk_bytes`.
    pub(crate) fn request_count(work: &Work<'_>, chunk_bytes: usize) -> usize {
        assert!(chunk_bytes > 0);
        match (work, work.transfer_bytes()) {
            (Work::Nothing, _) => 0,
            // A zero-length request is still sent: the server answers it (INVALID).
            (_, Some(total_bytes)) => total_bytes.div_ceil(chunk_bytes).max(1),
            (_, None) => 1,
        }
    }

    pub(crate) fn new(work: Work<'a>, first_id: u64, chunk_bytes: usize) -> Call<'a> {
        let request_count = Call::request_count(&work, chunk_bytes);
        Call {
            work,
            first_id,
            request_count,
            chunk_bytes,
            unsubmitted: (0..request_count).collect(),
            answered: vec![false; request_count],
            answered_count: 0,
            first_error: None,
            handle: None,
            unknown: Vec::new(),
            repeating: BTreeMap::new(),
        }
    }

    /// Every request answered or given up as of unknown outcome.
    pub(crate) fn is_done(&self) -> bool {
        self.answered_count + self.unknown.len() == self.request_count
    }

    fn index_of(&self, request_id: u64) -> Option<usize> {
        let index = request_id.checked_sub(self.first_id)?;
        (index < self.request_count as u64).then_some(index as usize)
    }

    /// Takes an answer; false when it belongs to no request of this call (an answer to a
    /// request abandoned after a timeout, without a reconnect policy).
    pub(crate) fn take_answer(&mut self, completion: &Completion<'_>) -> bool {
        let Some(index) = self.index_of(completion.request_id) else {
            return false;
        };
        assert!(!self.answered[index], "request {index} answered twice");
        self.answered[index] = true;
        self.answered_count += 1;
        self.repeating.remove(&index);
        if let Work::Register(_) = self.work {
            match completion.tenant_handle() {
                Ok(handle) => self.handle = Some(handle),
                Err(error) => {
                    self.first_error.get_or_insert(error);
                }
            }
            return true;
        }
        if let Err(error) = completion.result() {
            self.first_error.get_or_insert(error);
            return true;
        }
        let start = index * self.chunk_bytes;
        if let Work::Read { buf, .. } = &mut self.work {
            // The core checked that an OK READ carries exactly the bytes requested.
            let end = start + completion.data.len();
            if let Some(destination) = buf.get_mut(start..end) {
                destination.copy_from_slice(completion.data);
            }
        }
        true
    }

    /// Submits what the window takes, in order.
    pub(crate) fn submit(&mut self, core: &mut ConnectionCore) -> Result<(), ClientError> {
        while let Some(&index) = self.unsubmitted.front() {
            if core.outstanding_count() >= core.window() as usize {
                break;
            }
            self.submit_one(core, index)?;
            self.unsubmitted.pop_front();
        }
        Ok(())
    }

    fn submit_one(&self, core: &mut ConnectionCore, index: usize) -> Result<(), ClientError> {
        let request_id = self.first_id + index as u64;
        let start = index * self.chunk_bytes;
        let end = |total_bytes: usize| (start + self.chunk_bytes).min(total_bytes);
        match &self.work {
            Work::Read {
                namespace,
                offset,
                buf,
            } => core.submit_read(
                request_id,
                *namespace,
                offset.saturating_add(start as u64),
                (end(buf.len()) - start) as u32,
            )?,
            Work::Write {
                namespace,
                offset,
                data,
                fua,
            } => core.submit_write(
                request_id,
                *namespace,
                offset.saturating_add(start as u64),
                &data[start..end(data.len())],
                *fua,
            )?,
            Work::Flush { namespace } => core.submit_flush(request_id, *namespace)?,
            Work::Trim {
                namespace,
                offset,
                length_bytes,
            } => core.submit_trim(request_id, *namespace, *offset, *length_bytes)?,
            Work::Register(body) => core.submit_register(request_id, body)?,
            Work::Unregister(handle) => core.submit_unregister(request_id, *handle)?,
            Work::Bind(handle) => core.submit_bind(request_id, *handle)?,
            Work::Report(report) => core.submit_report(request_id, report)?,
            Work::Nothing => panic!("a call without requests submits nothing"),
        }
        Ok(())
    }

    /// The connection broke with `interrupted` unanswered: this call's requests among them
    /// are queued again when safe to repeat, and otherwise recorded as of unknown outcome.
    pub(crate) fn interrupt(&mut self, interrupted: Vec<InterruptedRequest>) {
        let mut again: Vec<usize> = self.unsubmitted.drain(..).collect();
        for request in interrupted {
            let Some(index) = self.index_of(request.request_id) else {
                continue;
            };
            assert!(!self.answered[index]);
            if request.is_safe_to_repeat() {
                again.push(index);
                self.repeating.insert(index, request);
            } else {
                self.unknown.push(request);
            }
        }
        again.sort_unstable();
        self.unsubmitted = again.into();
    }

    /// What a call that cannot go on leaves unanswered: the requests of unknown outcome and
    /// those waiting to be repeated, by id.
    pub(crate) fn unanswered(&self) -> Vec<InterruptedRequest> {
        let mut unanswered: Vec<InterruptedRequest> = self
            .unknown
            .iter()
            .chain(self.repeating.values())
            .copied()
            .collect();
        unanswered.sort_unstable_by_key(|request| request.request_id);
        unanswered
    }

    /// The call's result once done: unknown outcomes first (they need the caller's decision
    /// whatever else happened), then the first refusal; REGISTER's handle on success.
    pub(crate) fn finish(mut self) -> Result<Option<u64>, ClientError> {
        assert!(self.is_done());
        if !self.unknown.is_empty() {
            self.unknown
                .sort_unstable_by_key(|request| request.request_id);
            return Err(ClientError::OutcomeUnknown {
                requests: self.unknown,
            });
        }
        match self.first_error {
            Some(error) => Err(error),
            None => Ok(self.handle),
        }
    }
}
