//! The server's TLS setup from `[tls]`: certificate, key and client CA read from PEM files
//! into one rustls configuration, and pre-shared keys from a `psktool` file into one OpenSSL
//! context, that every dataplane thread shares.
//!
//! Why these choices: TLS 1.3 and 1.2 with rustls' safe defaults (the NBD spec asks for 1.2
//! at least); no session tickets or resumption state (each connection is long-lived, and a
//! ticket key would be one more secret to rotate); with a client CA, a client certificate is
//! mandatory and its subject's common name is the connection's identity.
//!
//! NVMe/TCP's keys (TP 8011) are the hosts' configured PSKs by host and subsystem
//! (`reflex_proto::nvme_tcp::tls_key::TlsKeyTable`), turned into the TLS PSK of the identity
//! a host offers (`NVMe0R0x` or `NVMe1R0x`), in an OpenSSL context of their own.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use std::collections::HashMap;

use reflex_dataplane::{PskKeys, TlsCurrent};

use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, TlsKeyTable};

use crate::config::{Config, TlsConfig, TlsMode};

/// Why `[tls]` could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("tls.{field} {path}: {reason}")]
    File {
        field: &'static str,
        path: String,
        reason: String,
    },
    #[error("tls: {0}")]
    Rustls(String),
}

/// What new TLS sessions use, as `config`'s `[tls]` and NVMe/TCP hosts' keys describe;
/// `None` when no listener uses TLS.
pub fn load(config: &Config) -> Result<Option<TlsCurrent>, TlsSetupError> {
    if !config.tls_in_use() {
        return Ok(None);
    }
    let (server_config, psk) = if config.tls.enabled() {
        let server_config = server_config(&config.tls)?;
        let psk = psk_keys(&config.tls)?;
        if server_config.is_none() && psk.is_none() {
            return Err(TlsSetupError::Rustls(
                "tls.certificate and tls.key, or tls.psk_file, are required".to_string(),
            ));
        }
        (server_config, psk)
    } else {
        (None, None)
    };
    Ok(Some(TlsCurrent {
        server_config,
        psk,
        nvme_psk: nvme_psk_keys(config)?,
        identities: Arc::new(identities(config)),
    }))
}

/// A host's configured key (interchange format) for one subsystem, checked: it decodes and
/// its identity fits; `Err` says why not (never showing the key).
pub fn nvme_host_key(
    interchange: &str,
    host_nqn: &str,
    subsystem_nqn: &str,
) -> Result<ConfiguredPsk, String> {
    let configured = ConfiguredPsk::parse_interchange(interchange).map_err(|e| e.to_string())?;
    configured
        .session_key(host_nqn, subsystem_nqn)
        .map_err(|e| e.to_string())?;
    Ok(configured)
}

/// The NVMe/TCP hosts' keys (`psk` or `psk_file` of `[[nvme_tcp.subsystem.host]]` and
/// `[[nvme_tcp.discovery.host]]`) by PSK identity; `None` when NVMe/TCP has no TLS.
fn nvme_psk_keys(config: &Config) -> Result<Option<Arc<PskKeys>>, TlsSetupError> {
    if !config.nvme_tcp.enabled || config.nvme_tcp.tls == TlsMode::Off {
        return Ok(None);
    }
    let mut keys = TlsKeyTable::default();
    // The discovery subsystem's keys are keyed by its NQN like any subsystem's: the identity
    // `NVMe0R0x <host NQN> nqn.2014-08.org.nvmexpress.discovery` selects them.
    let subsystems = config.effective_nvme_subsystems();
    let keyed = subsystems
        .iter()
        .map(|subsystem| (subsystem.nqn.as_str(), &subsystem.hosts))
        .chain(std::iter::once((
            reflex_proto::nvme_tcp::command::DISCOVERY_NQN,
            &config.nvme_tcp.discovery.hosts,
        )));
    for (subsystem_nqn, hosts) in keyed {
        for host in hosts {
            let (field, path, text) = match (&host.psk, &host.psk_file) {
                (Some(text), _) => (
                    "nvme_tcp.subsystem.host.psk",
                    host.nqn.clone(),
                    text.clone(),
                ),
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path).map_err(|e| TlsSetupError::File {
                        field: "nvme_tcp.subsystem.host.psk_file",
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                    ("nvme_tcp.subsystem.host.psk_file", path.clone(), text)
                }
                (None, None) => continue,
            };
            let key = nvme_host_key(&text, &host.nqn, subsystem_nqn)
                .and_then(|key| {
                    keys.insert(&host.nqn, subsystem_nqn, key)
                        .map_err(|e| e.to_string())
                })
                .map_err(|reason| TlsSetupError::File {
                    field,
                    path,
                    reason: format!("host {:?}, subsystem {subsystem_nqn:?}: {reason}", host.nqn),
                });
            key?;
        }
    }
    let keys = PskKeys::for_nvme_tcp(keys).map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
    Ok(Some(Arc::new(keys)))
}

/// The pre-shared keys of `tls.psk_file`, if it is set.
fn psk_keys(config: &TlsConfig) -> Result<Option<Arc<PskKeys>>, TlsSetupError> {
    let Some(path) = &config.psk_file else {
        return Ok(None);
    };
    let error = |reason: String| TlsSetupError::File {
        field: "psk_file",
        path: path.clone(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let keys = reflex_proto::psk_file::parse(&text).map_err(|e| error(e.to_string()))?;
    let keys = PskKeys::new(keys).map_err(|e| error(e.to_string()))?;
    Ok(Some(Arc::new(keys)))
}

/// The rustls server configuration of `[tls]`'s certificate and key; `None` without them.
fn server_config(config: &TlsConfig) -> Result<Option<Arc<rustls::ServerConfig>>, TlsSetupError> {
    let (Some(certificate), Some(key)) = (&config.certificate, &config.key) else {
        return Ok(None);
    };
    let chain = certificates("certificate", certificate)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsSetupError::File {
        field: "key",
        path: key.clone(),
        reason: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
    let builder = match &config.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for certificate in certificates("client_ca", path)? {
                roots.add(certificate).map_err(|e| TlsSetupError::File {
                    field: "client_ca",
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut server = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsSetupError::Rustls(format!("certificate and key: {e}")))?;
    server.send_tls13_tickets = 0;
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Some(Arc::new(server)))
}

/// Every certificate of a PEM file (at least one).
fn certificates(
    field: &'static str,
    path: &str,
) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let error = |reason: String| TlsSetupError::File {
        field,
        path: path.to_string(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|e| error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(e.to_string()))?;
    if chain.is_empty() {
        return Err(error("no certificate in the file".to_string()));
    }
    Ok(chain)
}

/// Per tenant name, the namespaces the configuration binds it to (through the namespace, an
/// original port, an NVMe/TCP host or an NBD export): where a certificate naming that tenant
/// may go on namespaces without QoS.
fn identities(config: &Config) -> HashMap<String, Vec<u32>> {
    let mut identities: HashMap<String, Vec<u32>> = HashMap::new();
    let mut add = |name: &str, id: u32| {
        let ids = identities.entry(name.to_string()).or_default();
        if !ids.contains(&id) {
            ids.push(id);
        }
    };
    for namespace in config.effective_namespaces() {
        for name in config.tenants_bound_to(namespace.id) {
            add(&name, namespace.id);
        }
    }
    for export in &config.nbd.exports {
        if let Some(name) = &export.tenant {
            add(name, export.namespace);
        }
    }
    identities
}
