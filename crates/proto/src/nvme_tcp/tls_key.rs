//! NVMe/TCP TLS keys (TP 8011, "TLS for NVMe/TCP"): the PSK interchange format, the retained
//! PSK, the TLS PSK and the PSK identity, as SPDK v24.01 and the Linux kernel's first TLS
//! support compute them. Why here: both ends (reflexd's target and the client's initiator)
//! must derive the same bytes from the same configured key, and a pure function is what the
//! test vectors (taken from SPDK's own code run on the same keys) can pin down.
//!
//! The chain, for one host and one subsystem:
//! 1. the configured PSK, `NVMeTLSkey-1:HH:<base64(key || crc32(key) little-endian)>:`, 32
//!    or 48 bytes; `HH` names the hash of step 2 (00: none, 01: SHA-256, 02: SHA-384);
//! 2. the retained PSK = HKDF(hash `HH`, key, salt empty, info = HkdfLabel(length = key
//!    length, "tls13 HostNQN", host NQN)), or the configured key itself for `00`;
//! 3. the identity `NVMe0R0C <host NQN> <subsystem NQN>` (`C` 1: TLS_AES_128_GCM_SHA256, for
//!    a 32-byte key; 2: TLS_AES_256_GCM_SHA384, for a 48-byte key);
//! 4. the TLS PSK = HKDF(the cipher suite's hash, retained PSK, salt empty, info =
//!    HkdfLabel(length = retained length, "tls13 nvme-tls-psk", identity)), as long as that
//!    hash's output. HkdfLabel is RFC 8446 §7.1's layout (u16 length, u8-prefixed label,
//!    u8-prefixed context); SPDK puts the *input* key's length in its length field and runs
//!    full HKDF (extract and expand), and interoperating means doing the same.
//!
//! The newer identity form (TP 8018, NVMe/TCP transport 1.0c §3.6.1.3, which newer SPDK,
//! the Linux kernel and libnvme use) is `NVMe1R0C <host NQN> <subsystem NQN> <PSK digest>`:
//! - PSK digest = base64(HMAC(the cipher suite's hash, retained PSK, host NQN || " " ||
//!   subsystem NQN || " " || "NVMe-over-Fabrics")), 44 characters for SHA-256, 64 for
//!   SHA-384 (the Linux kernel's `nvme_auth_generate_digest`, libnvme's `derive_psk_digest`);
//! - TLS PSK = HKDF(the same hash, retained PSK, salt empty, info = HkdfLabel(length = hash
//!   length, `"tls13 nvme-tls-psk"`, `"0C <PSK digest>"`)) (`nvme_auth_derive_tls_psk`: the
//!   context is the identity's hash digits, a space and the digest, not the whole identity).
//!
//! The retained and TLS PSK lengths equal the hash length here (a key's cipher follows from
//! its length), so SPDK's length field and RFC 8446's agree.

use base64::Engine;
use ring::hkdf;

/// The interchange format's prefix (version 1).
const INTERCHANGE_PREFIX: &str = "NVMeTLSkey-1:";
/// Bytes of the CRC-32 after the key in the base64 text.
const CRC_BYTES: usize = 4;
/// The identity's format specifier, TLS version 0 and the "retained" PSK type.
const IDENTITY_PREFIX: &str = "NVMe0R";
/// The same for TP 8018's form, TLS version 1 (with a PSK digest).
const IDENTITY_PREFIX_V1: &str = "NVMe1R";
/// The digest's HMAC input after the NQNs (the same seed DH-HMAC-CHAP uses).
const DIGEST_SEED: &[u8] = b"NVMe-over-Fabrics";
/// Longest identity: its length is one byte of the HkdfLabel context (and OpenSSL's
/// pre-TLS-1.3 callbacks take at most 256 bytes).
pub const IDENTITY_BYTES_MAX: usize = 255;

/// Bytes of a SHA-256 key (and hash).
pub const SHA256_BYTES: usize = 32;
/// Bytes of a SHA-384 key (and hash).
pub const SHA384_BYTES: usize = 48;

/// The hash of the retained-PSK derivation (the interchange format's `HH` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PskHash {
    /// `00`: the configured key is the retained key.
    None,
    /// `01`.
    Sha256,
    /// `02`.
    Sha384,
}

/// The TLS 1.3 cipher suite a key is used with, chosen by its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsCipher {
    /// TLS_AES_128_GCM_SHA256: 32-byte keys.
    Aes128GcmSha256,
    /// TLS_AES_256_GCM_SHA384: 48-byte keys.
    Aes256GcmSha384,
}

impl TlsCipher {
    /// The cipher suite for a configured key of `key_bytes`.
    pub fn for_key_bytes(key_bytes: usize) -> Option<TlsCipher> {
        match key_bytes {
            SHA256_BYTES => Some(TlsCipher::Aes128GcmSha256),
            SHA384_BYTES => Some(TlsCipher::Aes256GcmSha384),
            _ => None,
        }
    }

    /// The name OpenSSL (and the TLS registry) gives it.
    pub fn name(self) -> &'static str {
        match self {
            TlsCipher::Aes128GcmSha256 => "TLS_AES_128_GCM_SHA256",
            TlsCipher::Aes256GcmSha384 => "TLS_AES_256_GCM_SHA384",
        }
    }

    /// The identity's hash digits.
    fn identity_digits(self) -> &'static str {
        match self {
            TlsCipher::Aes128GcmSha256 => "01",
            TlsCipher::Aes256GcmSha384 => "02",
        }
    }

    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            TlsCipher::Aes128GcmSha256 => hkdf::HKDF_SHA256,
            TlsCipher::Aes256GcmSha384 => hkdf::HKDF_SHA384,
        }
    }

    fn hash_bytes(self) -> usize {
        match self {
            TlsCipher::Aes128GcmSha256 => SHA256_BYTES,
            TlsCipher::Aes256GcmSha384 => SHA384_BYTES,
        }
    }
}

/// Why a configured key or an identity was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsKeyError {
    #[error("not a PSK interchange string: it must be NVMeTLSkey-1:HH:<base64>:")]
    Format,
    #[error("unknown hash {0:?} in the PSK interchange string (00, 01 or 02)")]
    Hash(String),
    #[error("the PSK's base64 does not decode")]
    Base64,
    #[error("the PSK is {0} bytes: it must be 32 or 48, and 32 for hash 01, 48 for hash 02")]
    Length(usize),
    #[error("the PSK's CRC-32 does not match its key: mistyped or cut")]
    Crc,
    #[error("the host NQN is {0} bytes: at most 255")]
    NqnTooLong(usize),
    #[error("the PSK identity would be {0} bytes: at most 255 (shorter NQNs)")]
    IdentityTooLong(usize),
}

/// A configured PSK, decoded and checked. Its bytes are secret: `Debug` does not show them.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredPsk {
    hash: PskHash,
    key: Vec<u8>,
}

impl std::fmt::Debug for ConfiguredPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfiguredPsk")
            .field("hash", &self.hash)
            .field("key_bytes", &self.key.len())
            .finish()
    }
}

impl ConfiguredPsk {
    /// A key from its bytes (32 or 48; 32 for SHA-256, 48 for SHA-384, as SPDK insists).
    pub fn new(hash: PskHash, key: &[u8]) -> Result<ConfiguredPsk, TlsKeyError> {
        let fits = match hash {
            PskHash::None => TlsCipher::for_key_bytes(key.len()).is_some(),
            PskHash::Sha256 => key.len() == SHA256_BYTES,
            PskHash::Sha384 => key.len() == SHA384_BYTES,
        };
        if !fits {
            return Err(TlsKeyError::Length(key.len()));
        }
        Ok(ConfiguredPsk {
            hash,
            key: key.to_vec(),
        })
    }

    /// Reads `NVMeTLSkey-1:HH:<base64>:` (surrounding white space, such as a key file's
    /// final newline, is ignored).
    pub fn parse_interchange(text: &str) -> Result<ConfiguredPsk, TlsKeyError> {
        let text = text.trim();
        let rest = text
            .strip_prefix(INTERCHANGE_PREFIX)
            .ok_or(TlsKeyError::Format)?;
        let (digits, rest) = rest.split_once(':').ok_or(TlsKeyError::Format)?;
        let encoded = rest.strip_suffix(':').ok_or(TlsKeyError::Format)?;
        if encoded.contains(':') {
            return Err(TlsKeyError::Format);
        }
        let hash = match digits {
            "00" => PskHash::None,
            "01" => PskHash::Sha256,
            "02" => PskHash::Sha384,
            other => return Err(TlsKeyError::Hash(other.to_string())),
        };
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|_| TlsKeyError::Base64)?;
        let Some(key_bytes) = decoded.len().checked_sub(CRC_BYTES) else {
            return Err(TlsKeyError::Length(0));
        };
        let (key, crc) = decoded.split_at(key_bytes);
        let psk = ConfiguredPsk::new(hash, key)?;
        let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc != crc32fast::hash(key) {
            return Err(TlsKeyError::Crc);
        }
        Ok(psk)
    }

    /// The interchange string (`nvme gen-tls-key`'s output form).
    pub fn to_interchange(&self) -> String {
        let mut bytes = self.key.clone();
        bytes.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        let digits = match self.hash {
            PskHash::None => "00",
            PskHash::Sha256 => "01",
            PskHash::Sha384 => "02",
        };
        format!(
            "{INTERCHANGE_PREFIX}{digits}:{}:",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    pub fn hash(&self) -> PskHash {
        self.hash
    }

    /// The cipher suite this key's sessions use.
    pub fn cipher(&self) -> TlsCipher {
        match TlsCipher::for_key_bytes(self.key.len()) {
            Some(cipher) => cipher,
            None => unreachable!("a configured key is 32 or 48 bytes (checked in new)"),
        }
    }

    /// The retained PSK for `host_nqn` (step 2); `Err` for a host NQN longer than 255 bytes
    /// (the spec allows 223).
    pub fn retained(&self, host_nqn: &str) -> Result<Vec<u8>, TlsKeyError> {
        if host_nqn.len() > usize::from(u8::MAX) {
            return Err(TlsKeyError::NqnTooLong(host_nqn.len()));
        }
        let algorithm = match self.hash {
            PskHash::None => return Ok(self.key.clone()),
            PskHash::Sha256 => TlsCipher::Aes128GcmSha256,
            PskHash::Sha384 => TlsCipher::Aes256GcmSha384,
        };
        Ok(hkdf_with_label(
            algorithm,
            &self.key,
            b"tls13 HostNQN",
            host_nqn.as_bytes(),
        ))
    }

    /// The identity and TLS PSK a session between `host_nqn` and `subsystem_nqn` uses
    /// (steps 2 to 4) in TP 8011's identity form: what the initiator offers and what the
    /// target expects.
    pub fn session_key(
        &self,
        host_nqn: &str,
        subsystem_nqn: &str,
    ) -> Result<(String, Vec<u8>), TlsKeyError> {
        self.session_key_in(IdentityForm::Version0, host_nqn, subsystem_nqn)
    }

    /// The identity and TLS PSK in the identity form `form`.
    pub fn session_key_in(
        &self,
        form: IdentityForm,
        host_nqn: &str,
        subsystem_nqn: &str,
    ) -> Result<(String, Vec<u8>), TlsKeyError> {
        let cipher = self.cipher();
        let retained = self.retained(host_nqn)?;
        let mut identity = PskIdentity {
            cipher,
            host_nqn: host_nqn.to_string(),
            subsystem_nqn: subsystem_nqn.to_string(),
            digest: None,
        };
        match form {
            IdentityForm::Version0 => {
                let identity = identity.encode()?;
                let key = derive_tls_psk(cipher, &retained, &identity);
                Ok((identity, key))
            }
            IdentityForm::Version1 => {
                let digest = psk_digest(cipher, &retained, host_nqn, subsystem_nqn);
                let context = format!("{} {digest}", cipher.identity_digits());
                identity.digest = Some(digest);
                let identity = identity.encode()?;
                let key =
                    hkdf_with_label(cipher, &retained, b"tls13 nvme-tls-psk", context.as_bytes());
                Ok((identity, key))
            }
        }
    }
}

/// TP 8018's PSK digest: base64(HMAC(hash, retained PSK, host NQN " " subsystem NQN " "
/// "NVMe-over-Fabrics")).
fn psk_digest(cipher: TlsCipher, retained: &[u8], host_nqn: &str, subsystem_nqn: &str) -> String {
    let algorithm = match cipher {
        TlsCipher::Aes128GcmSha256 => ring::hmac::HMAC_SHA256,
        TlsCipher::Aes256GcmSha384 => ring::hmac::HMAC_SHA384,
    };
    let key = ring::hmac::Key::new(algorithm, retained);
    let mut context = ring::hmac::Context::with_key(&key);
    context.update(host_nqn.as_bytes());
    context.update(b" ");
    context.update(subsystem_nqn.as_bytes());
    context.update(b" ");
    context.update(DIGEST_SEED);
    base64::engine::general_purpose::STANDARD.encode(context.sign().as_ref())
}

/// The TLS PSK from a retained PSK and the identity (step 4; an identity of
/// [`PskIdentity::encode`], at most 255 bytes).
pub fn derive_tls_psk(cipher: TlsCipher, retained: &[u8], identity: &str) -> Vec<u8> {
    hkdf_with_label(cipher, retained, b"tls13 nvme-tls-psk", identity.as_bytes())
}

/// HKDF (extract with an empty salt, then expand) to the hash's length, with info laid out
/// as SPDK lays it: u16 big-endian `key.len()`, u8 label length, label, u8 context length,
/// context. Label and context are at most 255 bytes (checked by the callers' bounds).
fn hkdf_with_label(cipher: TlsCipher, key: &[u8], label: &[u8], context: &[u8]) -> Vec<u8> {
    let (Ok(label_length), Ok(context_length), Ok(key_length)) = (
        u8::try_from(label.len()),
        u8::try_from(context.len()),
        u16::try_from(key.len()),
    ) else {
        unreachable!("labels, NQNs and identities are checked to fit a byte, keys are 32 or 48");
    };
    let key_bytes = key_length.to_be_bytes();
    let label_bytes = [label_length];
    let context_bytes = [context_length];
    let info: [&[u8]; 5] = [&key_bytes, &label_bytes, label, &context_bytes, context];
    let output_bytes = cipher.hash_bytes();
    let prk = hkdf::Salt::new(cipher.hkdf(), &[]).extract(key);
    let mut out = vec![0u8; output_bytes];
    let filled = prk
        .expand(&info, OutputBytes(output_bytes))
        .and_then(|okm| okm.fill(&mut out));
    // Expand fails only past 255 hash lengths of output; ours is one.
    assert!(filled.is_ok(), "HKDF expand of one hash length failed");
    out
}

/// An HKDF output length for ring.
struct OutputBytes(usize);

impl hkdf::KeyType for OutputBytes {
    fn len(&self) -> usize {
        self.0
    }
}

/// A PSK identity: TP 8011's first form `NVMe0R0C <host NQN> <subsystem NQN>`, or TP 8018's
/// `NVMe1R0C <host NQN> <subsystem NQN> <PSK digest>` when `digest` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PskIdentity {
    pub cipher: TlsCipher,
    pub host_nqn: String,
    pub subsystem_nqn: String,
    /// The base64 PSK digest of the `NVMe1R` form; `None` for `NVMe0R`.
    pub digest: Option<String>,
}

/// Which identity form an initiator offers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IdentityForm {
    /// `NVMe0R0C <host NQN> <subsystem NQN>`: TP 8011, what SPDK v24.01 sends.
    #[default]
    Version0,
    /// `NVMe1R0C <host NQN> <subsystem NQN> <PSK digest>`: TP 8018 (NVMe/TCP 1.0c).
    Version1,
}

impl PskIdentity {
    /// The identity string; `Err` when it would be longer than [`IDENTITY_BYTES_MAX`].
    pub fn encode(&self) -> Result<String, TlsKeyError> {
        let identity = match &self.digest {
            None => format!(
                "{IDENTITY_PREFIX}{} {} {}",
                self.cipher.identity_digits(),
                self.host_nqn,
                self.subsystem_nqn
            ),
            Some(digest) => format!(
                "{IDENTITY_PREFIX_V1}{} {} {} {digest}",
                self.cipher.identity_digits(),
                self.host_nqn,
                self.subsystem_nqn
            ),
        };
        if identity.len() > IDENTITY_BYTES_MAX {
            return Err(TlsKeyError::IdentityTooLong(identity.len()));
        }
        Ok(identity)
    }

    /// Reads an identity a client offered; `None` when it is of neither form. NQNs and
    /// digests hold no spaces, so the fields end at spaces.
    pub fn parse(identity: &str) -> Option<PskIdentity> {
        let (version1, rest) = match identity.strip_prefix(IDENTITY_PREFIX) {
            Some(rest) => (false, rest),
            None => (true, identity.strip_prefix(IDENTITY_PREFIX_V1)?),
        };
        let (digits, rest) = rest.split_once(' ')?;
        let cipher = match digits {
            "01" => TlsCipher::Aes128GcmSha256,
            "02" => TlsCipher::Aes256GcmSha384,
            _ => return None,
        };
        let mut fields = rest.split(' ');
        let host_nqn = fields.next().filter(|field| !field.is_empty())?;
        let subsystem_nqn = fields.next().filter(|field| !field.is_empty())?;
        let digest = if version1 {
            Some(fields.next().filter(|field| !field.is_empty())?.to_string())
        } else {
            None
        };
        if fields.next().is_some() {
            return None;
        }
        Some(PskIdentity {
            cipher,
            host_nqn: host_nqn.to_string(),
            subsystem_nqn: subsystem_nqn.to_string(),
            digest,
        })
    }
}

/// Why an offered identity gets no key (the handshake then fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdentityRefusal {
    #[error("not an NVMe/TCP PSK identity (NVMe0R0x or NVMe1R0x)")]
    Form,
    #[error("no key for this host and subsystem")]
    Unknown,
    #[error("the identity's hash does not match the key's (32-byte keys: 01, 48-byte: 02)")]
    Cipher,
    #[error("the identity's PSK digest does not match the key")]
    Digest,
}

/// The configured keys of a target, by host and subsystem, answering the identities hosts
/// offer in either form.
#[derive(Debug, Clone, Default)]
pub struct TlsKeyTable {
    keys: std::collections::HashMap<(String, String), ConfiguredPsk>,
}

impl TlsKeyTable {
    /// Adds `psk` for `host_nqn` and `subsystem_nqn`; `Err` when their identity does not fit.
    pub fn insert(
        &mut self,
        host_nqn: &str,
        subsystem_nqn: &str,
        psk: ConfiguredPsk,
    ) -> Result<(), TlsKeyError> {
        psk.session_key(host_nqn, subsystem_nqn)?;
        self.keys
            .insert((host_nqn.to_string(), subsystem_nqn.to_string()), psk);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `identity` (either form) names a host and subsystem with a key.
    pub fn knows(&self, identity: &str) -> bool {
        PskIdentity::parse(identity).is_some_and(|offered| {
            self.keys
                .contains_key(&(offered.host_nqn, offered.subsystem_nqn))
        })
    }

    /// The cipher suite of the key of the host and subsystem `identity` names.
    pub fn cipher_for(&self, identity: &str) -> Option<TlsCipher> {
        let offered = PskIdentity::parse(identity)?;
        self.keys
            .get(&(offered.host_nqn, offered.subsystem_nqn))
            .map(ConfiguredPsk::cipher)
    }

    /// The cipher suite and TLS PSK for an offered identity (either form; a digest is
    /// checked against the configured key).
    pub fn tls_psk(&self, identity: &str) -> Result<(TlsCipher, Vec<u8>), IdentityRefusal> {
        let offered = PskIdentity::parse(identity).ok_or(IdentityRefusal::Form)?;
        let psk = self
            .keys
            .get(&(offered.host_nqn.clone(), offered.subsystem_nqn.clone()))
            .ok_or(IdentityRefusal::Unknown)?;
        if psk.cipher() != offered.cipher {
            return Err(IdentityRefusal::Cipher);
        }
        let form = match offered.digest {
            None => IdentityForm::Version0,
            Some(_) => IdentityForm::Version1,
        };
        // The NQNs were checked when the key was added; the identity is the one offered.
        let (expected, key) = psk
            .session_key_in(form, &offered.host_nqn, &offered.subsystem_nqn)
            .map_err(|_| IdentityRefusal::Unknown)?;
        if expected != identity {
            return Err(IdentityRefusal::Digest);
        }
        Ok((offered.cipher, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6";
    const SUBSYSTEM: &str = "nqn.2016-06.io.spdk:cnode1";
    const KEY_32_SHA256: &str = "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
    const KEY_32_NONE: &str = "NVMeTLSkey-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
    const KEY_48_SHA384: &str =
        "NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:";
    const KEY_48_NONE: &str =
        "NVMeTLSkey-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// One vector: what SPDK v24.01's `nvme_tcp_parse_interchange_psk`,
    /// `nvme_tcp_generate_psk_identity`, `nvme_tcp_derive_retained_psk` and
    /// `nvme_tcp_derive_tls_psk` (include/spdk_internal/nvme_tcp.h, built and run on these
    /// keys with OpenSSL 3.0) printed.
    fn check(interchange: &str, identity: &str, retained: &str, tls: &str) {
        let psk = ConfiguredPsk::parse_interchange(interchange).unwrap();
        assert_eq!(
            hex(&psk.retained(HOST).unwrap()),
            retained,
            "{interchange}: retained"
        );
        let (got_identity, key) = psk.session_key(HOST, SUBSYSTEM).unwrap();
        assert_eq!(got_identity, identity, "{interchange}: identity");
        assert_eq!(hex(&key), tls, "{interchange}: TLS PSK");
        assert_eq!(psk.to_interchange(), interchange, "round trip");
    }

    #[test]
    fn derivations_match_spdk() {
        let id1 = format!("NVMe0R01 {HOST} {SUBSYSTEM}");
        let id2 = format!("NVMe0R02 {HOST} {SUBSYSTEM}");
        check(
            KEY_32_SHA256,
            &id1,
            "2777170cfb82b52c5ec8cb00cc26fa9145d942315f2c892822b0772f5debe85d",
            "90da01aec6268cc94ee1618b06b0350a0003550394c3ef78956f8866ae50dba8",
        );
        check(
            KEY_32_NONE,
            &id1,
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
            "2fecd7e800e554d035cc90b13b738bc59c2a413e850ab976961136b6b6574bd6",
        );
        check(
            KEY_48_SHA384,
            &id2,
            "9199e9844a95310712a6436350cb36769e36bb02461989493acb7f9419f9d1ca\
             81374a176479e87994f6c7c17c5f2800",
            "ea440db81efc27082414976e1e426cc85c7be8d744a56075fe3ef829b53ec3f2\
             92401dccb759c751354bbca8208cdf05",
        );
        check(
            KEY_48_NONE,
            &id2,
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\
             202122232425262728292a2b2c2d2e2f",
            "f2808a6d64f5b18588e640516e99416eb4b4fcee8bf0b36e645468ce94c42966\
             d84c52545e1b6783a33e4009a7787ef2",
        );
    }

    #[test]
    fn bad_interchange_strings_say_why() {
        let cases: [(&str, TlsKeyError); 9] = [
            ("", TlsKeyError::Format),
            ("NVMeTLSkey-2:01:AAAA:", TlsKeyError::Format),
            (
                "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR",
                TlsKeyError::Format,
            ),
            ("NVMeTLSkey-1:03:AAAA:", TlsKeyError::Hash("03".to_string())),
            ("NVMeTLSkey-1:01:!!!!:", TlsKeyError::Base64),
            ("NVMeTLSkey-1:01:AAA=:", TlsKeyError::Length(0)),
            // A 32-byte key under hash 02, a 48-byte one under 01.
            (
                "NVMeTLSkey-1:02:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
                TlsKeyError::Length(32),
            ),
            (
                "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vcSEgBQ==:",
                TlsKeyError::Length(48),
            ),
            // The last CRC byte changed (SPDK: "CRC-32 checksums do not match!").
            (
                "NVMeTLSkey-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:",
                TlsKeyError::Crc,
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(
                ConfiguredPsk::parse_interchange(text),
                Err(expected),
                "{text:?}"
            );
        }
        // A key file's newline is not part of the key.
        assert!(ConfiguredPsk::parse_interchange(&format!("{KEY_32_SHA256}\n")).is_ok());
    }

    #[test]
    fn identities_round_trip_and_stay_in_bounds() {
        let identity = PskIdentity {
            cipher: TlsCipher::Aes128GcmSha256,
            host_nqn: HOST.to_string(),
            subsystem_nqn: SUBSYSTEM.to_string(),
            digest: None,
        };
        let text = identity.encode().unwrap();
        assert_eq!(PskIdentity::parse(&text), Some(identity));
        for bad in [
            "",
            "NVMe0R01",
            "NVMe0R03 a b",
            "NVMe1R01 a b",
            "NVMe1R01 a b d e",
            "NVMe1R03 a b d",
            "NVMe0R01 a",
            "NVMe0R01  b",
            "NVMe0R01 a b c",
        ] {
            assert_eq!(PskIdentity::parse(bad), None, "{bad:?}");
        }
        let long = PskIdentity {
            cipher: TlsCipher::Aes128GcmSha256,
            host_nqn: "h".repeat(200),
            subsystem_nqn: "s".repeat(50),
            digest: None,
        };
        assert_eq!(long.encode(), Err(TlsKeyError::IdentityTooLong(260)));
        let psk = ConfiguredPsk::parse_interchange(KEY_32_SHA256).unwrap();
        assert!(matches!(
            psk.session_key(&long.host_nqn, &long.subsystem_nqn),
            Err(TlsKeyError::IdentityTooLong(_))
        ));
        // Each host and each subsystem gets its own TLS key from one configured key.
        let (_, a) = psk.session_key("nqn.host-a", "nqn.sub-x").unwrap();
        let (_, b) = psk.session_key("nqn.host-b", "nqn.sub-x").unwrap();
        let (_, c) = psk.session_key("nqn.host-a", "nqn.sub-y").unwrap();
        assert!(a != b && a != c && b != c);
        assert!(
            !format!("{psk:?}").contains("00010203"),
            "Debug shows no key"
        );
    }

    /// TP 8018's identity form. The vectors come from an independent Python derivation
    /// (hmac, hashlib) of the definitions in the module comment, which reproduces SPDK's
    /// retained keys above.
    #[test]
    fn version1_identities_carry_the_digest_and_their_own_tls_psk() {
        let cases = [
            (
                KEY_32_SHA256,
                "NVMe1R01",
                "3b0DrtgnErqrCJBibilhjErsCHPyzZBhOGOE9g109QI=",
                "f7b99f8c640fdd9fa2001a45a730907261776ab93e879ed3610b2414c36c4269",
            ),
            (
                KEY_48_SHA384,
                "NVMe1R02",
                "u0NhJjF+rxrzO5WbtpSdWWSMAXO9ZWyVh+iAw110iANOEMKLyxmWHTyFR8JI6t4D",
                "d4205439313bc546ac8f205204a440dd7ed4fcd6b006780c4f71e4f8f1de4d56\
                 d85af34fe8e6e29f087e0549a1835aae",
            ),
        ];
        for (interchange, prefix, digest, tls) in cases {
            let psk = ConfiguredPsk::parse_interchange(interchange).unwrap();
            let (identity, key) = psk
                .session_key_in(IdentityForm::Version1, HOST, SUBSYSTEM)
                .unwrap();
            assert_eq!(identity, format!("{prefix} {HOST} {SUBSYSTEM} {digest}"));
            assert_eq!(hex(&key), tls, "{interchange}");
            let parsed = PskIdentity::parse(&identity).unwrap();
            assert_eq!(parsed.digest.as_deref(), Some(digest));
            assert_eq!(parsed.encode().unwrap(), identity);
        }
    }

    /// A target's table answers both forms with the key the initiator derived, and refuses
    /// a wrong digest, hash, host or subsystem, and what is no identity at all.
    #[test]
    fn the_key_table_accepts_both_forms_and_checks_the_digest() {
        let mut table = TlsKeyTable::default();
        for interchange in [KEY_32_SHA256, KEY_48_SHA384] {
            let psk = ConfiguredPsk::parse_interchange(interchange).unwrap();
            let subsystem = format!("{SUBSYSTEM}-{}", psk.cipher().name());
            table.insert(HOST, &subsystem, psk.clone()).unwrap();
            for form in [IdentityForm::Version0, IdentityForm::Version1] {
                let (identity, key) = psk.session_key_in(form, HOST, &subsystem).unwrap();
                assert_eq!(
                    table.tls_psk(&identity),
                    Ok((psk.cipher(), key)),
                    "{identity}"
                );
            }
            let (identity, _) = psk
                .session_key_in(IdentityForm::Version1, HOST, &subsystem)
                .unwrap();
            // One digest character changed.
            let mut wrong = identity.clone().into_bytes();
            let last = wrong.len() - 2;
            wrong[last] = if wrong[last] == b'A' { b'B' } else { b'A' };
            let wrong = String::from_utf8(wrong).unwrap();
            assert_eq!(table.tls_psk(&wrong), Err(IdentityRefusal::Digest));
            // The other hash's digits.
            let other = if psk.cipher() == TlsCipher::Aes128GcmSha256 {
                identity.replacen("NVMe1R01", "NVMe1R02", 1)
            } else {
                identity.replacen("NVMe1R02", "NVMe1R01", 1)
            };
            assert_eq!(table.tls_psk(&other), Err(IdentityRefusal::Cipher));
        }
        assert_eq!(table.len(), 2);
        let psk = ConfiguredPsk::parse_interchange(KEY_32_SHA256).unwrap();
        for (host, subsystem) in [("nqn.other", SUBSYSTEM), (HOST, SUBSYSTEM)] {
            let (identity, _) = psk
                .session_key_in(IdentityForm::Version1, host, subsystem)
                .unwrap();
            assert_eq!(table.tls_psk(&identity), Err(IdentityRefusal::Unknown));
        }
        assert_eq!(table.tls_psk("A"), Err(IdentityRefusal::Form));
    }
}
