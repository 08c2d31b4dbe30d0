//! Namespaces at run time, as the server sees them: opening a backend, reading its profile and
//! naming its NBD export, then the control plane's [`ControlPlane::add_namespace`] (which every
//! dataplane thread adopts); removal through [`ControlPlane::remove_namespace`]. The admin API
//! (`POST`/`DELETE /v1/namespaces`), the state file's restore at start and SIGHUP's reload of
//! new `[[namespace]]` tables all come through here, with the validation start-up applies.
//!
//! Invariant: a refused add changes nothing the server serves (a backend file the spec asked
//! to create may stay on disk when a later step refuses).

use std::sync::{Arc, Mutex};

use reflex_dataplane::control::{
    ControlPlane, NamespaceChangeError, NewNamespace, RemovedNamespace,
};
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_qos::DeviceProfile;

use crate::admin::state_file::PersistedNamespace;
use crate::config::NamespaceConfig;

/// Longest NBD export name a namespace added at run time may have, in characters (at most 4
/// bytes each: within the configuration's 256 bytes).
pub const EXPORT_NAME_CHARS_MAX: usize = 64;

/// What the server knows of a namespace slot besides the dataplane's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceMeta {
    /// Its NBD export's name (served when NBD is on; empty once removed).
    pub export: String,
    /// The backend spec it was opened from.
    pub device: String,
    /// Added through the admin API (persisted in the state file), not by the configuration.
    pub runtime: Option<PersistedNamespace>,
}

/// Why a namespace was not added (nothing changed).
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    /// The request is malformed (an id of 0, a bad name, options that do not apply).
    #[error("{0}")]
    Invalid(String),
    #[error("namespace {namespace_id}: cannot read QoS profile {path}: {reason}")]
    Profile {
        namespace_id: u32,
        path: String,
        reason: String,
    },
    #[error("namespace {namespace_id}: {source}")]
    Open {
        namespace_id: u32,
        source: reflex_flash::FlashError,
    },
    /// Conflicts with what is served (a duplicate id or export name, no slot left).
    #[error(transparent)]
    Conflict(NamespaceChangeError),
}

/// The server's namespaces and how they came to be.
pub struct NamespaceManager {
    control: Arc<ControlPlane>,
    nbd: bool,
    meta: Mutex<Vec<NamespaceMeta>>,
}

impl NamespaceManager {
    /// `meta[i]` describes the start-up namespace in slot `i`; `nbd`: exports follow
    /// namespaces.
    pub fn new(
        control: Arc<ControlPlane>,
        nbd: bool,
        meta: Vec<NamespaceMeta>,
    ) -> NamespaceManager {
        NamespaceManager {
            control,
            nbd,
            meta: Mutex::new(meta),
        }
    }

    fn meta_lock(&self) -> std::sync::MutexGuard<'_, Vec<NamespaceMeta>> {
        self.meta
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The namespaces the threads serve now.
    pub fn namespaces(&self) -> Option<Arc<NamespaceSet>> {
        self.control.catalog().map(|catalog| catalog.namespaces)
    }

    pub fn meta(&self, namespace_index: u16) -> Option<NamespaceMeta> {
        self.meta_lock().get(usize::from(namespace_index)).cloned()
    }

    /// The live namespaces added through the admin API, in slot order (the state file's).
    pub fn runtime_namespaces(&self) -> Vec<PersistedNamespace> {
        let Some(namespaces) = self.namespaces() else {
            return Vec::new();
        };
        let meta = self.meta_lock();
        namespaces
            .live_indices()
            .filter_map(|index| meta.get(usize::from(index))?.runtime.clone())
            .collect()
    }

    /// Adds a namespace as `namespace` describes it (`runtime`: through the admin API, kept in
    /// the state file; otherwise from the configuration). Checked as at start-up: the id and
    /// export name are free, the profile reads and parses, the backend opens; every thread
    /// opens its device queue for the new slot before it reads another request.
    pub fn add(&self, namespace: &NamespaceConfig, runtime: bool) -> Result<u16, AddError> {
        let id = namespace.id;
        if id == 0 {
            return Err(AddError::Invalid(
                "namespace id 0 is not valid (ids start at 1)".into(),
            ));
        }
        if namespace.tenant.is_some() {
            return Err(AddError::Invalid(
                "a namespace added at run time binds no tenant: add tenants to it afterwards"
                    .into(),
            ));
        }
        let export_name = namespace.export_name();
        if export_name.is_empty()
            || export_name.chars().count() > EXPORT_NAME_CHARS_MAX
            || export_name.contains('\0')
        {
            return Err(AddError::Invalid(format!(
                "NBD export name {export_name:?} must be 1 to {EXPORT_NAME_CHARS_MAX} characters without NUL"
            )));
        }
        if namespace.backend.is_empty() {
            return Err(AddError::Invalid("backend is empty".into()));
        }
        if reflex_dataplane::composite::CompositeSpec::is_composite(namespace.backend.trim()) {
            return Err(AddError::Invalid(
                "a striped or concatenated namespace comes from the configuration at startup;                  it cannot be added at run time"
                    .into(),
            ));
        }
        if namespace.profile.as_ref().is_some_and(String::is_empty) {
            return Err(AddError::Invalid("profile is empty".into()));
        }
        // Conflicts first: nothing is opened (or created) for a request that cannot succeed.
        let current = self
            .control
            .catalog()
            .ok_or(AddError::Conflict(NamespaceChangeError::Fixed))?;
        if current.namespaces.index_of(id).is_some() {
            return Err(AddError::Conflict(NamespaceChangeError::Set(
                reflex_dataplane::namespaces::NamespaceSetError::Duplicate(id),
            )));
        }
        if let Some(exports) = &current.nbd_exports
            && exports
                .table()
                .exports()
                .iter()
                .any(|export| export.name == export_name)
        {
            return Err(AddError::Conflict(NamespaceChangeError::Export(
                reflex_proto::nbd::ExportError::DuplicateName(export_name),
            )));
        }
        let profile = match &namespace.profile {
            None => None,
            Some(path) => {
                let fail = |reason: String| AddError::Profile {
                    namespace_id: id,
                    path: path.clone(),
                    reason,
                };
                let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
                Some(DeviceProfile::from_toml(&text).map_err(|e| fail(e.to_string()))?)
            }
        };
        let device = crate::open_device(namespace).map_err(|error| match error {
            crate::ServerError::Device { id, source } => AddError::Open {
                namespace_id: id,
                source,
            },
            other => AddError::Invalid(other.to_string()),
        })?;
        let export = if self.nbd {
            let minimum_bytes = u64::from(reflex_proto::nbd::BlockSizes::default().minimum_bytes);
            let size_bytes = device.info().size_bytes / minimum_bytes * minimum_bytes;
            Some(
                reflex_proto::nbd::Export::new(export_name.clone(), size_bytes)
                    .with_description(format!("reflexd namespace {id}")),
            )
        } else {
            None
        };
        let description = device.info().description.clone();
        let added = self
            .control
            .add_namespace(NewNamespace {
                id,
                device,
                read_only: namespace.read_only,
                profile,
                export,
            })
            .map_err(AddError::Conflict)?;
        let mut meta = self.meta_lock();
        let index = usize::from(added.namespace_index);
        if meta.len() < index {
            meta.resize_with(index, || NamespaceMeta {
                export: String::new(),
                device: String::new(),
                runtime: None,
            });
        }
        let entry = NamespaceMeta {
            export: export_name.clone(),
            device: namespace.backend.clone(),
            runtime: runtime.then(|| PersistedNamespace {
                namespace_id: id,
                backend: namespace.backend.clone(),
                size_bytes: namespace.size_bytes,
                read_only: namespace.read_only,
                nbd_export: namespace.name.clone(),
                profile: namespace.profile.clone(),
            }),
        };
        if meta.len() == index {
            meta.push(entry);
        } else {
            meta[index] = entry;
        }
        tracing::info!(namespace = id, nbd_export = %export_name, device = %description,
            runtime, "namespace added at run time");
        Ok(added.namespace_index)
    }

    /// Removes namespace `namespace_id` (see [`ControlPlane::remove_namespace`]).
    pub fn remove(
        &self,
        namespace_id: u32,
        force: bool,
    ) -> Result<RemovedNamespace, NamespaceChangeError> {
        let removed = self.control.remove_namespace(namespace_id, force)?;
        if let Some(meta) = self
            .meta_lock()
            .get_mut(usize::from(removed.namespace_index))
        {
            meta.export.clear();
            meta.runtime = None;
        }
        Ok(removed)
    }
}

impl PersistedNamespace {
    /// The namespace as a configuration table would have it.
    pub fn to_config(&self) -> NamespaceConfig {
        NamespaceConfig {
            id: self.namespace_id,
            backend: self.backend.clone(),
            size_bytes: self.size_bytes,
            read_only: self.read_only,
            name: self.nbd_export.clone(),
            tenant: None,
            profile: self.profile.clone(),
        }
    }
}
