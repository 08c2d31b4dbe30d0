//! The control plane's state that survives a restart: tenants created through the admin API,
//! and SLO changes made to configured tenants, each with its namespace.
//!
//! Crash safety: the file is replaced whole, never edited in place. A new version is written
//! to `<file>.tmp`, fsynced, renamed over the file, and the directory is fsynced, so after a
//! crash (kill -9 included) at any point the file holds the old state or the new one, never a
//! mixture; a `.tmp` left behind by a crash is ignored and overwritten. The file is JSON with
//! a version number; one that does not parse stops the server with the path and the reason
//! (it is never silently replaced).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use reflex_qos::TenantSpec;
use serde::{Deserialize, Serialize};

/// The format's version; a file of another version is refused.
pub const STATE_VERSION: u32 = 1;

/// Largest state file read (a file beyond it is refused rather than read into memory).
pub const STATE_FILE_BYTES_MAX: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("state file {path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// Where a persisted tenant came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Created through the admin API: created again at start.
    Admin,
    /// Declared in the configuration; only its SLO was changed through the admin API, and
    /// that SLO is applied again at start.
    Config,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedTenant {
    pub namespace_id: u32,
    pub name: String,
    pub spec: TenantSpec,
    pub read_only: bool,
    pub origin: Origin,
    /// RT_alone set through the admin API for the fairness monitors (µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rt_alone_us: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedState {
    pub version: u32,
    /// Increases with every write (a reader can tell two versions apart).
    pub generation: u64,
    pub tenants: Vec<PersistedTenant>,
    /// Namespaces added through the admin API, added again at start (before the tenants).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<PersistedNamespace>,
}

/// A namespace added through the admin API, as it was asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedNamespace {
    pub namespace_id: u32,
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_export: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

impl PersistedState {
    /// The entry for `name` on `namespace_id`.
    pub fn find(&self, namespace_id: u32, name: &str) -> Option<&PersistedTenant> {
        self.tenants
            .iter()
            .find(|tenant| tenant.namespace_id == namespace_id && tenant.name == name)
    }

    /// Sets (adds or replaces) the entry for a tenant.
    pub fn upsert(&mut self, tenant: PersistedTenant) {
        match self
            .tenants
            .iter_mut()
            .find(|known| known.namespace_id == tenant.namespace_id && known.name == tenant.name)
        {
            Some(known) => *known = tenant,
            None => self.tenants.push(tenant),
        }
    }

    /// Forgets the entry for `name` on `namespace_id`.
    pub fn remove(&mut self, namespace_id: u32, name: &str) {
        self.tenants
            .retain(|tenant| !(tenant.namespace_id == namespace_id && tenant.name == name));
    }
}

/// The state file at a path.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn shown(&self) -> String {
        self.path.display().to_string()
    }

    fn temporary(&self) -> PathBuf {
        let mut name = self.path.file_name().unwrap_or_default().to_os_string();
        name.push(".tmp");
        self.path.with_file_name(name)
    }

    /// The persisted state; an empty one when there is no file yet.
    pub fn load(&self) -> Result<PersistedState, StateError> {
        let io = |source| StateError::Io {
            path: self.shown(),
            source,
        };
        let file = match File::open(&self.path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(PersistedState {
                    version: STATE_VERSION,
                    ..PersistedState::default()
                });
            }
            Err(error) => return Err(io(error)),
        };
        let size = file.metadata().map_err(io)?.len();
        if size > STATE_FILE_BYTES_MAX {
            return Err(StateError::Invalid {
                path: self.shown(),
                reason: format!("{size} bytes, more than the {STATE_FILE_BYTES_MAX} read"),
            });
        }
        let text = std::fs::read_to_string(&self.path).map_err(io)?;
        let state: PersistedState =
            serde_json::from_str(&text).map_err(|error| StateError::Invalid {
                path: self.shown(),
                reason: error.to_string(),
            })?;
        if state.version != STATE_VERSION {
            return Err(StateError::Invalid {
                path: self.shown(),
                reason: format!(
                    "version {} (this reflexd reads version {STATE_VERSION})",
                    state.version
                ),
            });
        }
        Ok(state)
    }

    /// Replaces the file with `state`: temporary file, fsync, rename, fsync of the directory.
    pub fn store(&self, state: &PersistedState) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            path: self.shown(),
            source,
        };
        let directory = match self.path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&directory).map_err(io)?;
        let text = serde_json::to_vec_pretty(state).map_err(|error| StateError::Invalid {
            path: self.shown(),
            reason: error.to_string(),
        })?;
        let temporary = self.temporary();
        let mut file = File::create(&temporary).map_err(io)?;
        file.write_all(&text).map_err(io)?;
        file.write_all(b"\n").map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&temporary, &self.path).map_err(io)?;
        File::open(&directory)
            .and_then(|directory| directory.sync_all())
            .map_err(io)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_and_a_missing_file_is_empty() {
        let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = StateFile::new(directory.path().join("sub").join("state.json"));
        let empty = file.load().unwrap_or_else(|e| panic!("{e}"));
        assert!(empty.tenants.is_empty());
        let mut state = PersistedState {
            version: STATE_VERSION,
            generation: 3,
            tenants: Vec::new(),
            namespaces: Vec::new(),
        };
        state.upsert(PersistedTenant {
            namespace_id: 1,
            name: "gold".into(),
            spec: TenantSpec::LatencyCritical {
                latency_us_p95: 500,
                iops: 1000,
                read_percent: 90,
            },
            read_only: false,
            rt_alone_us: None,
            origin: Origin::Admin,
        });
        file.store(&state).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(file.load().unwrap_or_else(|e| panic!("{e}")), state);
        assert!(!file.temporary().exists());
        state.remove(1, "gold");
        file.store(&state).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            file.load()
                .unwrap_or_else(|e| panic!("{e}"))
                .tenants
                .is_empty()
        );
    }

    #[test]
    fn a_damaged_file_is_refused_with_its_path() {
        let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = directory.path().join("state.json");
        std::fs::write(&path, "{\"version\": 1, \"tenants\": [").unwrap_or_else(|e| panic!("{e}"));
        let error = StateFile::new(&path).load().err().map(|e| e.to_string());
        let error = error.unwrap_or_default();
        assert!(error.contains("state.json"), "{error}");
        std::fs::write(
            &path,
            "{\"version\": 9, \"generation\": 0, \"tenants\": []}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let error = StateFile::new(&path).load().err().map(|e| e.to_string());
        assert!(error.unwrap_or_default().contains("version 9"));
    }
}
