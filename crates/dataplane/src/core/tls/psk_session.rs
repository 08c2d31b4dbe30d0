//! OpenSSL's TLS 1.3 external-PSK callback that hands over a whole session
//! (`SSL_CTX_set_psk_find_session_callback`), which the `openssl` crate does not bind. Why:
//! its PSK callback (`set_psk_server_callback`, OpenSSL's pre-TLS-1.3 interface) takes every
//! key as a SHA-256 one, so a 48-byte NVMe/TCP key (TLS_AES_256_GCM_SHA384, TP 8011) cannot
//! be served through it. A session built here carries the TLS PSK as its master key and the
//! cipher suite of the key's hash, and OpenSSL uses the PSK only with a suite of that hash.
//!
//! The only module of this crate with `unsafe`: the raw OpenSSL calls, each block small with
//! its own `SAFETY` comment. Callers see [`set_session_finder`] and a plain closure.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uchar};
use std::sync::OnceLock;

use foreign_types::ForeignTypeRef;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslContext, SslContextBuilder, SslRef};
use openssl_sys::{SSL, SSL_CIPHER, SSL_CTX, SSL_SESSION, TLS1_3_VERSION};
use reflex_proto::nvme_tcp::tls_key::TlsCipher;

/// The key a client's identity selects.
pub struct SessionKey {
    pub cipher: TlsCipher,
    /// The TLS PSK (as long as the cipher suite's hash).
    pub key: Vec<u8>,
    /// What [`crate::core::tls::psk::PskSession::peer_name`] reports once the handshake
    /// proved the key.
    pub name: String,
}

/// Looks an offered identity up; `None`: no key for it (the handshake fails).
pub type SessionFinder = Box<dyn Fn(&[u8]) -> Option<SessionKey> + Send + Sync>;

/// What the callback reads from its context.
struct Finder {
    find: SessionFinder,
    name_index: Index<Ssl, String>,
}

/// OpenSSL's `SSL_psk_find_session_cb_func`.
type FindSessionCallback = unsafe extern "C" fn(
    ssl: *mut SSL,
    identity: *const c_uchar,
    identity_bytes: usize,
    session_out: *mut *mut SSL_SESSION,
) -> c_int;

// OpenSSL 1.1.1 and later (libssl), not declared by openssl-sys.
unsafe extern "C" {
    fn SSL_CTX_set_psk_find_session_callback(
        context: *mut SSL_CTX,
        callback: Option<FindSessionCallback>,
    );
    fn SSL_SESSION_new() -> *mut SSL_SESSION;
    fn SSL_SESSION_set1_master_key(
        session: *mut SSL_SESSION,
        key: *const c_uchar,
        key_bytes: usize,
    ) -> c_int;
    fn SSL_SESSION_set_cipher(session: *mut SSL_SESSION, cipher: *const SSL_CIPHER) -> c_int;
    fn SSL_SESSION_set_protocol_version(session: *mut SSL_SESSION, version: c_int) -> c_int;
    fn SSL_CIPHER_find(ssl: *mut SSL, cipher_id: *const c_uchar) -> *const SSL_CIPHER;
}

fn finder_index() -> Result<Index<SslContext, Finder>, ErrorStack> {
    static INDEX: OnceLock<Index<SslContext, Finder>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = SslContext::new_ex_index::<Finder>()?;
    Ok(*INDEX.get_or_init(|| index))
}

/// Serves TLS 1.3 external PSKs from `find` on contexts built by `builder`; the name of the
/// key found goes to each session's `name_index`.
pub fn set_session_finder(
    builder: &mut SslContextBuilder,
    find: SessionFinder,
    name_index: Index<Ssl, String>,
) -> Result<(), ErrorStack> {
    builder.set_ex_data(finder_index()?, Finder { find, name_index });
    // SAFETY: `builder.as_ptr()` is the live context `builder` owns; the callback is a plain
    // function that reads its state from the context's ex data set above, which lives as
    // long as the context (and every SSL made from it holds a reference to the context).
    unsafe { SSL_CTX_set_psk_find_session_callback(builder.as_ptr(), Some(find_session)) };
    Ok(())
}

/// The callback: 1 with a session (or none, for an unknown identity), 0 to abort.
///
/// # Safety
///
/// Only OpenSSL calls it, during a handshake on the live `ssl`, with `identity` pointing at
/// `identity_bytes` readable bytes (or null) and `session_out` writable.
unsafe extern "C" fn find_session(
    ssl: *mut SSL,
    identity: *const c_uchar,
    identity_bytes: usize,
    session_out: *mut *mut SSL_SESSION,
) -> c_int {
    if ssl.is_null() || session_out.is_null() {
        return 0;
    }
    // SAFETY: OpenSSL calls this from inside a handshake step on `ssl`, a live SSL, and no
    // Rust reference to it is used while the callback runs (the caller is in SSL_accept).
    let ssl = unsafe { SslRef::from_ptr_mut(ssl) };
    let identity: &[u8] = if identity.is_null() || identity_bytes == 0 {
        &[]
    } else {
        // SAFETY: OpenSSL passes the identity of the ClientHello it parsed, `identity_bytes`
        // long, alive for the call; it is only read here and copied if kept.
        unsafe { std::slice::from_raw_parts(identity, identity_bytes) }
    };
    let Ok(index) = finder_index() else {
        return 0;
    };
    let (found, name_index) = match ssl.ssl_context().ex_data(index) {
        Some(finder) => ((finder.find)(identity), finder.name_index),
        None => return 0,
    };
    let session = match found {
        None => std::ptr::null_mut(),
        Some(found) => match new_session(ssl, found.cipher, &found.key) {
            Some(session) => {
                ssl.set_ex_data(name_index, found.name);
                session
            }
            None => return 0,
        },
    };
    // SAFETY: `session_out` is OpenSSL's out parameter, non-null (checked), valid for one
    // write during the call; OpenSSL takes over the session's reference.
    unsafe { *session_out = session };
    1
}

/// A TLS 1.3 session whose master key is `key` and cipher `cipher` (owned by the caller; a
/// reference OpenSSL frees), or `None` when OpenSSL refuses.
fn new_session(ssl: &mut SslRef, cipher: TlsCipher, key: &[u8]) -> Option<*mut SSL_SESSION> {
    let cipher_id: [u8; 2] = match cipher {
        TlsCipher::Aes128GcmSha256 => [0x13, 0x01],
        TlsCipher::Aes256GcmSha384 => [0x13, 0x02],
    };
    // SAFETY: `ssl` is live; SSL_CIPHER_find reads the two bytes of `cipher_id` and returns
    // a pointer into OpenSSL's static cipher table, or null.
    let cipher = unsafe { SSL_CIPHER_find(ssl.as_ptr(), cipher_id.as_ptr()) };
    if cipher.is_null() {
        return None;
    }
    // SAFETY: no arguments; the result is a new session we own, or null.
    let session = unsafe { SSL_SESSION_new() };
    if session.is_null() {
        return None;
    }
    // SAFETY: `session` is the one just made and owned here; `key` is alive for the call and
    // copied (at most 48 bytes, OpenSSL's master key length: ours are 32 or 48); `cipher`
    // points into the static table.
    let set = unsafe {
        SSL_SESSION_set1_master_key(session, key.as_ptr(), key.len()) == 1
            && SSL_SESSION_set_cipher(session, cipher) == 1
            && SSL_SESSION_set_protocol_version(session, TLS1_3_VERSION) == 1
    };
    if !set {
        // SAFETY: `session` is ours and not handed out: this frees its only reference.
        unsafe { openssl_sys::SSL_SESSION_free(session) };
        return None;
    }
    Some(session)
}
