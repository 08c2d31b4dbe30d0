//! OpenSSL's TLS 1.3 external-PSK callback on the initiator's side that hands over a whole
//! session (`SSL_CTX_set_psk_use_session_callback`), which the `openssl` crate does not
//! bind. Why: its PSK client callback (OpenSSL's pre-TLS-1.3 interface) takes every key as a
//! SHA-256 one, so a 48-byte NVMe/TCP key (TLS_AES_256_GCM_SHA384, TP 8011) cannot be
//! offered through it. The session offered carries the TLS PSK as its master key and the
//! cipher suite of the key's hash.
//!
//! With `sys.rs`, the only modules of this crate with `unsafe`: the raw OpenSSL calls, each
//! block small with its own `SAFETY` comment. Callers see [`offer_session_psk`].

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uchar};
use std::sync::OnceLock;

use foreign_types::ForeignTypeRef;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::hash::MessageDigest;
use openssl::ssl::{SslContext, SslContextBuilder, SslRef};
use openssl_sys::{EVP_MD, SSL, SSL_CIPHER, SSL_CTX, SSL_SESSION, TLS1_3_VERSION};
use reflex_proto::nvme_tcp::tls_key::TlsCipher;

/// What a context offers: one identity and its TLS PSK.
struct Offer {
    identity: Vec<u8>,
    key: Vec<u8>,
    cipher: TlsCipher,
}

/// OpenSSL's `SSL_psk_use_session_cb_func`.
type UseSessionCallback = unsafe extern "C" fn(
    ssl: *mut SSL,
    digest: *const EVP_MD,
    identity_out: *mut *const c_uchar,
    identity_bytes_out: *mut usize,
    session_out: *mut *mut SSL_SESSION,
) -> c_int;

// OpenSSL 1.1.1 and later (libssl), not declared by openssl-sys.
unsafe extern "C" {
    fn SSL_CTX_set_psk_use_session_callback(
        context: *mut SSL_CTX,
        callback: Option<UseSessionCallback>,
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

fn offer_index() -> Result<Index<SslContext, Offer>, ErrorStack> {
    static INDEX: OnceLock<Index<SslContext, Offer>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = SslContext::new_ex_index::<Offer>()?;
    Ok(*INDEX.get_or_init(|| index))
}

/// Makes sessions of contexts built by `builder` offer `identity` with the TLS PSK `key`
/// under `cipher` (TLS 1.3).
pub(crate) fn offer_session_psk(
    builder: &mut SslContextBuilder,
    identity: Vec<u8>,
    key: Vec<u8>,
    cipher: TlsCipher,
) -> Result<(), ErrorStack> {
    builder.set_ex_data(
        offer_index()?,
        Offer {
            identity,
            key,
            cipher,
        },
    );
    // SAFETY: `builder.as_ptr()` is the live context `builder` owns; the callback is a plain
    // function reading the offer from the context's ex data set above, which lives as long
    // as the context (every SSL made from it holds a reference to the context).
    unsafe { SSL_CTX_set_psk_use_session_callback(builder.as_ptr(), Some(use_session)) };
    Ok(())
}

/// The callback: 1 with the identity and session set, 0 to abort the handshake.
///
/// # Safety
///
/// Only OpenSSL calls it, during a handshake on the live `ssl`, with `digest` null or one of
/// its digests and the three out parameters writable.
unsafe extern "C" fn use_session(
    ssl: *mut SSL,
    digest: *const EVP_MD,
    identity_out: *mut *const c_uchar,
    identity_bytes_out: *mut usize,
    session_out: *mut *mut SSL_SESSION,
) -> c_int {
    if ssl.is_null() || identity_out.is_null() || identity_bytes_out.is_null() {
        return 0;
    }
    if session_out.is_null() {
        return 0;
    }
    // SAFETY: OpenSSL calls this from inside a handshake step on `ssl`, a live SSL, and no
    // Rust reference to it is used while the callback runs (the caller is in SSL_connect).
    let ssl = unsafe { SslRef::from_ptr_mut(ssl) };
    let Ok(index) = offer_index() else {
        return 0;
    };
    let Some(offer) = ssl.ssl_context().ex_data(index) else {
        return 0;
    };
    if !digest.is_null() {
        // SAFETY: a non-null `digest` is the handshake's EVP_MD (after a HelloRetryRequest),
        // one of OpenSSL's static digests; only its size is read.
        let digest_bytes = unsafe { MessageDigest::from_ptr(digest) }.size();
        let cipher_bytes = match offer.cipher {
            TlsCipher::Aes128GcmSha256 => 32,
            TlsCipher::Aes256GcmSha384 => 48,
        };
        if digest_bytes != cipher_bytes {
            return 0;
        }
    }
    let (identity, key, cipher) = (offer.identity.as_ptr(), offer.key.clone(), offer.cipher);
    let identity_bytes = offer.identity.len();
    let Some(session) = new_session(ssl, cipher, &key) else {
        return 0;
    };
    // SAFETY: the out parameters are non-null (checked) and valid for one write during the
    // call; the identity points into the context's ex data, which outlives the handshake;
    // OpenSSL takes over the session's reference.
    unsafe {
        *identity_out = identity;
        *identity_bytes_out = identity_bytes;
        *session_out = session;
    }
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
