//! The admin API's resources: JSON in and out, every route listed in [`ROUTES`] and described
//! by `docs/admin-openapi.json` (a test checks the two agree, and schemathesis checks the
//! running server against the document).
//!
//! Bad input never changes anything: malformed JSON, unknown fields, values out of range,
//! duplicate names, a refused admission and removing what the configuration owns are all
//! answered with a 4xx whose JSON body names the problem (`{"error": "..."}`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use reflex_dataplane::control::{AdminError, ControlPlane, NamespaceChangeError, TenantInfo};
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_qos::{Plan, TenantSpec};
use serde::{Deserialize, Serialize};

use super::state_file::{Origin, PersistedState, PersistedTenant, StateFile};
use super::stats::Sampler;
use crate::namespaces::{AddError, NamespaceManager};

/// Every route of the admin API: (method, path) as the OpenAPI document writes them.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/v1/server"),
    ("get", "/v1/namespaces"),
    ("post", "/v1/namespaces"),
    ("get", "/v1/namespaces/{namespace_id}"),
    ("delete", "/v1/namespaces/{namespace_id}"),
    ("get", "/v1/tenants"),
    ("post", "/v1/namespaces/{namespace_id}/tenants"),
    ("get", "/v1/namespaces/{namespace_id}/tenants/{name}"),
    ("patch", "/v1/namespaces/{namespace_id}/tenants/{name}"),
    ("delete", "/v1/namespaces/{namespace_id}/tenants/{name}"),
    ("get", "/v1/stats"),
    ("get", "/v1/fairness"),
    ("get", "/v1/scaling"),
    ("post", "/v1/scaling"),
    ("get", "/metrics"),
];

/// Longest tenant name the API accepts, in characters (at most 4 bytes each: within the
/// configuration's and the wire's 256 bytes).
pub const TENANT_NAME_CHARS_MAX: usize = 64;
const _: () = assert!(TENANT_NAME_CHARS_MAX * 4 <= crate::config::TENANT_NAME_BYTES_MAX);

/// What the handlers share.
pub struct AdminState {
    pub control: Arc<ControlPlane>,
    /// The namespaces, their export names and device labels (they change at run time).
    pub manager: Arc<NamespaceManager>,
    pub sampler: Arc<Mutex<Sampler>>,
    /// The state file and what it holds, when state persists.
    pub persistence: Mutex<Option<(StateFile, PersistedState)>>,
    pub allow_remote: bool,
    /// `[admin] allow` (`None`: every peer).
    pub allow: Option<reflex_dataplane::access::AllowList>,
    /// The bearer token every peer outside `token_exempt` presents (`None`: none asked).
    pub token: Option<String>,
    pub token_exempt: reflex_dataplane::access::AllowList,
    pub refused: Arc<crate::admin::stats::AdminRefusals>,
    /// Log lines about refused requests (rate-limited: a peer hammering the API with bad
    /// tokens cannot flood the log), and the clock they are measured on.
    pub refusal_log: std::sync::Mutex<(std::time::Instant, reflex_dataplane::access::RefusalLog)>,
    pub version: &'static str,
    pub threads: usize,
    /// Thread scaling, when the server runs several threads.
    pub scaling: Option<Arc<crate::scaling::ScalingControl>>,
}

pub type Shared = Arc<AdminState>;

/// A 4xx or 5xx with a JSON body naming the problem.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorBody {
                error: &self.message,
            }),
        )
            .into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        let status = match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            StatusCode::UNPROCESSABLE_ENTITY => StatusCode::UNPROCESSABLE_ENTITY,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> ApiError {
        ApiError::bad_request(rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> ApiError {
        ApiError::bad_request(rejection.body_text())
    }
}

impl From<NamespaceChangeError> for ApiError {
    fn from(error: NamespaceChangeError) -> ApiError {
        let status = match &error {
            NamespaceChangeError::NoSuchNamespace(_) => StatusCode::NOT_FOUND,
            NamespaceChangeError::Qos { .. }
            | NamespaceChangeError::Fixed
            | NamespaceChangeError::Set(_)
            | NamespaceChangeError::Export(_)
            | NamespaceChangeError::InUse { .. }
            | NamespaceChangeError::Composite(_)
            | NamespaceChangeError::Member { .. } => StatusCode::CONFLICT,
        };
        ApiError::new(status, error.to_string())
    }
}

impl From<AddError> for ApiError {
    fn from(error: AddError) -> ApiError {
        match error {
            AddError::Conflict(error) => error.into(),
            AddError::Invalid(_) => ApiError::bad_request(error.to_string()),
            // The body is well formed; what it names cannot be served here (a missing file,
            // an unknown backend kind, an unreadable profile): a conflict with the server's
            // surroundings, like an admission refusal.
            AddError::Profile { .. } | AddError::Open { .. } => {
                ApiError::new(StatusCode::CONFLICT, error.to_string())
            }
        }
    }
}

impl From<AdminError> for ApiError {
    fn from(error: AdminError) -> ApiError {
        let status = match &error {
            AdminError::NoSuchNamespace(_) | AdminError::NoSuchTenant { .. } => {
                StatusCode::NOT_FOUND
            }
            AdminError::NoQos(_)
            | AdminError::Duplicate { .. }
            | AdminError::NotChangeable { .. }
            | AdminError::Refused(_) => StatusCode::CONFLICT,
        };
        ApiError::new(status, error.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

// ----- Bodies -------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassBody {
    Lc,
    Be,
}

/// `POST /v1/namespaces/{namespace_id}/tenants`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantCreate {
    pub name: String,
    pub class: ClassBody,
    #[serde(default)]
    pub latency_us_p95: Option<u64>,
    #[serde(default)]
    pub iops: Option<u64>,
    #[serde(default)]
    pub read_percent: Option<u8>,
    #[serde(default)]
    pub read_only: bool,
    /// RT_alone for the fairness monitors (µs); absent: learned from the windows.
    #[serde(default)]
    pub rt_alone_us: Option<u32>,
}

/// `POST /v1/namespaces`: a namespace to serve from now on (and after a restart).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceCreate {
    pub namespace_id: u32,
    /// As a configuration's `backend`: `file:PATH` or a path, `mem:SIZE`, `null[:SIZE]`,
    /// `emu:NAME`, a block device, a `fault(...)` wrapper.
    pub backend: String,
    #[serde(default)]
    pub size_bytes: Option<u64>,
    #[serde(default)]
    pub read_only: bool,
    /// NBD export name (default `ns<ID>`).
    #[serde(default)]
    pub nbd_export: Option<String>,
    /// Device profile (TOML path): QoS on for the namespace.
    #[serde(default)]
    pub profile: Option<String>,
}

/// `DELETE /v1/namespaces/{namespace_id}?force=true`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceDelete {
    #[serde(default)]
    pub force: bool,
}

/// `PATCH /v1/namespaces/{namespace_id}/tenants/{name}`: what is given replaces the tenant's
/// value, the rest stays (a class change to `lc` needs `latency_us_p95` and `iops`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPatch {
    #[serde(default)]
    pub class: Option<ClassBody>,
    #[serde(default)]
    pub latency_us_p95: Option<u64>,
    #[serde(default)]
    pub iops: Option<u64>,
    #[serde(default)]
    pub read_percent: Option<u8>,
    /// RT_alone for the fairness monitors (µs); `null` goes back to learning it.
    #[serde(default, deserialize_with = "present")]
    pub rt_alone_us: Option<Option<u32>>,
}

/// A field that may be given as `null`: `Some(None)` then, `None` when absent (with
/// `#[serde(default)]`).
fn present<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

/// RT_alone is a response time: above 0, at most a minute.
fn check_rt_alone(rt_alone_us: Option<u32>) -> ApiResult<()> {
    match rt_alone_us {
        Some(0) => Err(ApiError::bad_request("rt_alone_us must be above 0")),
        Some(us) if us > crate::config::RT_ALONE_US_MAX => Err(ApiError::bad_request(format!(
            "rt_alone_us {us} above {} (one minute)",
            crate::config::RT_ALONE_US_MAX
        ))),
        _ => Ok(()),
    }
}

#[derive(Debug, Serialize)]
pub struct TenantView {
    pub name: String,
    pub namespace_id: u32,
    /// The wire handle (hex): what a native client BINDs to.
    pub handle: String,
    pub class: ClassBody,
    pub latency_us_p95: Option<u64>,
    pub iops: Option<u64>,
    pub read_percent: Option<u8>,
    pub read_only: bool,
    /// `config` (the configuration file), `default` (the namespace's default best-effort
    /// tenant), `admin` (this API) or `wire` (a client's REGISTER).
    pub origin: &'static str,
    pub connections: u32,
    /// Its connections on each dataplane thread, in thread order: whether two flows meet at
    /// one thread's fairness stage depends on where the kernel placed them.
    pub connections_per_thread: Vec<u32>,
    pub renegotiation_notices: u64,
    pub in_deficit_episode: bool,
    /// RT_alone set for the fairness monitors (µs); `null`: learned from the windows.
    pub rt_alone_us: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct PlanView {
    pub latency_us_p95: Option<u64>,
    pub device_tokens_per_sec: f64,
    pub lc_reserved_tokens_per_sec: f64,
    pub left_tokens_per_sec: f64,
    pub be_tokens_per_sec_each: f64,
    pub lc_tenants: u32,
    pub be_tenants_bound: u32,
    pub rate_scale: f64,
    /// The share of LC tenants' unused tokens that best-effort tenants may spend.
    pub spare_share: f64,
    pub overcommitted: bool,
    pub read_only_admission: bool,
}

impl PlanView {
    fn of(plan: &Plan) -> PlanView {
        let device = plan.device_tokens_per_sec[0].as_tokens_per_sec_f64();
        let reserved = plan.lc_reserved_tokens_per_sec[0].as_tokens_per_sec_f64();
        PlanView {
            latency_us_p95: plan.latency_us_p95,
            device_tokens_per_sec: device,
            lc_reserved_tokens_per_sec: reserved,
            left_tokens_per_sec: (device - reserved).max(0.0),
            be_tokens_per_sec_each: plan.be_tokens_per_sec_each[0].as_tokens_per_sec_f64(),
            lc_tenants: plan.lc_tenants,
            be_tenants_bound: plan.be_tenants_bound,
            rate_scale: plan.rate_scale,
            spare_share: plan.spare_share,
            overcommitted: plan.overcommitted,
            read_only_admission: plan.read_only_admission,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct AdmissionView {
    pub admitted: bool,
    pub reason: String,
}

#[derive(Debug, Serialize)]
pub struct TenantChanged {
    pub tenant: TenantView,
    pub admission: AdmissionView,
    pub plan: Option<PlanView>,
}

#[derive(Debug, Serialize)]
pub struct NamespaceView {
    pub namespace_id: u32,
    pub nbd_export: String,
    pub size_bytes: u64,
    pub read_only: bool,
    pub device: String,
    pub qos: bool,
    pub tenants: Vec<String>,
    pub plan: Option<PlanView>,
}

#[derive(Debug, Serialize)]
pub struct ServerView {
    pub version: &'static str,
    pub threads: usize,
    pub namespaces: usize,
    pub tenants: usize,
    pub persistent_state: Option<String>,
}

// ----- Handlers -----------------------------------------------------------------------------

fn json<T: Serialize>(value: T) -> Response {
    Json(value).into_response()
}

impl AdminState {
    /// What the state file keeps of a configured or admin tenant after a change: `spec` and
    /// `rt_alone_us` as they now are.
    fn persisted(
        &self,
        namespace_id: u32,
        info: &TenantInfo,
        spec: TenantSpec,
        rt_alone_us: Option<u32>,
    ) -> PersistedTenant {
        PersistedTenant {
            namespace_id,
            name: info.name.clone(),
            spec,
            read_only: info.read_only,
            origin: if self.control.is_managed(info.handle) {
                Origin::Admin
            } else {
                Origin::Config
            },
            rt_alone_us,
        }
    }

    fn origin(&self, info: &TenantInfo) -> &'static str {
        if info.dynamic {
            "wire"
        } else if self.control.is_managed(info.handle) {
            "admin"
        } else if info.name == "(default)" {
            "default"
        } else {
            "config"
        }
    }

    fn tenant_view(&self, info: &TenantInfo) -> TenantView {
        let (class, latency_us_p95, iops, read_percent) = match info.spec {
            TenantSpec::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            } => (
                ClassBody::Lc,
                Some(latency_us_p95),
                Some(iops),
                Some(read_percent),
            ),
            TenantSpec::BestEffort => (ClassBody::Be, None, None, None),
        };
        TenantView {
            name: info.name.clone(),
            namespace_id: info.namespace_id,
            handle: format!("{:016x}", info.handle),
            class,
            latency_us_p95,
            iops,
            read_percent,
            read_only: info.read_only,
            origin: self.origin(info),
            connections: info.connections_per_thread.iter().sum(),
            connections_per_thread: info.connections_per_thread.clone(),
            renegotiation_notices: info.deficit_episodes,
            in_deficit_episode: info.in_deficit_episode,
            rt_alone_us: info.rt_alone_us,
        }
    }

    fn namespaces(&self) -> Arc<NamespaceSet> {
        self.manager
            .namespaces()
            .unwrap_or_else(|| Arc::new(NamespaceSet::new(Vec::new())))
    }

    fn namespace_view(&self, index: u16) -> NamespaceView {
        let namespaces = self.namespaces();
        let id = namespaces.id(index);
        let plan = self.control.plan(index);
        let meta = self.manager.meta(index);
        NamespaceView {
            namespace_id: id,
            nbd_export: meta
                .as_ref()
                .map(|meta| meta.export.clone())
                .unwrap_or_default(),
            size_bytes: namespaces.size_bytes(index),
            read_only: namespaces.is_read_only(index),
            device: meta.map(|meta| meta.device).unwrap_or_default(),
            qos: plan.is_some(),
            tenants: self
                .control
                .tenants()
                .into_iter()
                .filter(|tenant| tenant.namespace_id == id)
                .map(|tenant| tenant.name)
                .collect(),
            plan: plan.as_ref().map(PlanView::of),
        }
    }

    fn namespace_index(&self, namespace_id: u32) -> ApiResult<u16> {
        self.namespaces().index_of(namespace_id).ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no namespace {namespace_id}"),
            )
        })
    }

    /// Records a tenant's new state in the state file (when state persists). Called with the
    /// change already made; on failure the caller undoes it.
    fn persist(&self, change: impl FnOnce(&mut PersistedState)) -> ApiResult<()> {
        let mut persistence = self
            .persistence
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some((file, state)) = persistence.as_mut() else {
            return Ok(());
        };
        let mut next = state.clone();
        change(&mut next);
        next.generation += 1;
        match file.store(&next) {
            Ok(()) => {
                *state = next;
                Ok(())
            }
            Err(error) => {
                tracing::error!(%error, "cannot write the state file; the change is undone");
                Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the change could not be made durable: {error}"),
                ))
            }
        }
    }
}

/// The spec a create body asks for, or what is wrong with it.
fn spec_of(
    class: ClassBody,
    latency_us_p95: Option<u64>,
    iops: Option<u64>,
    read_percent: Option<u8>,
) -> ApiResult<TenantSpec> {
    match class {
        ClassBody::Be => {
            if latency_us_p95.is_some() || iops.is_some() || read_percent.is_some() {
                return Err(ApiError::bad_request(
                    "a best-effort tenant takes no latency_us_p95, iops or read_percent",
                ));
            }
            Ok(TenantSpec::BestEffort)
        }
        ClassBody::Lc => {
            let (Some(latency_us_p95), Some(iops)) = (latency_us_p95, iops) else {
                return Err(ApiError::bad_request(
                    "a latency-critical tenant needs latency_us_p95 and iops",
                ));
            };
            let read_percent = read_percent.unwrap_or(100);
            if latency_us_p95 == 0 || latency_us_p95 > reflex_qos::registry::LATENCY_SLO_US_MAX {
                return Err(ApiError::bad_request(format!(
                    "latency_us_p95 {latency_us_p95} not in 1..={}",
                    reflex_qos::registry::LATENCY_SLO_US_MAX
                )));
            }
            if iops == 0 || iops > reflex_qos::registry::IOPS_MAX {
                return Err(ApiError::bad_request(format!(
                    "iops {iops} not in 1..={}",
                    reflex_qos::registry::IOPS_MAX
                )));
            }
            if read_percent > 100 {
                return Err(ApiError::bad_request(format!(
                    "read_percent {read_percent} above 100"
                )));
            }
            Ok(TenantSpec::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            })
        }
    }
}

/// Fields whose `null` means something (clear the value) rather than a mistake.
const NULLABLE_FIELDS: &[&str] = &["rt_alone_us"];

/// A request body that must be a JSON object of `T`'s fields. Numbers with no fractional part
/// count as integers whatever their spelling (`70.0` is 70), as JSON Schema has it. A body
/// that is not an object, or fields of the wrong type, are a 422 naming the field.
fn object_body<T: serde::de::DeserializeOwned>(
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> ApiResult<T> {
    /// 2^64: the first float above every u64.
    const U64_END: f64 = 18_446_744_073_709_551_616.0;
    let Json(mut value) = body?;
    let Some(object) = value.as_object_mut() else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the body must be a JSON object",
        ));
    };
    if let Some((key, _)) = object
        .iter()
        .find(|(key, field)| field.is_null() && !NULLABLE_FIELDS.contains(&key.as_str()))
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("{key}: null is not a value (leave the field out instead)"),
        ));
    }
    for field in object.values_mut() {
        if field.is_f64()
            && let Some(number) = field.as_f64()
            && number.fract() == 0.0
            && (0.0..U64_END).contains(&number)
        {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let integral = number as u64;
            *field = serde_json::Value::from(integral);
        }
    }
    serde_path_to_error::deserialize(value).map_err(|error| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid body: {error}"),
        )
    })
}

fn check_name(name: &str) -> ApiResult<()> {
    if name.is_empty() || name.chars().count() > TENANT_NAME_CHARS_MAX {
        return Err(ApiError::bad_request(format!(
            "tenant name must be 1..={TENANT_NAME_CHARS_MAX} characters"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(ApiError::bad_request(
            "tenant name must not contain control characters",
        ));
    }
    if name == "(default)" || name.starts_with("tenant ") {
        return Err(ApiError::bad_request(
            "tenant names \"(default)\" and \"tenant ...\" are the server's own",
        ));
    }
    Ok(())
}

fn admission_reason(plan: Option<&Plan>) -> String {
    match plan {
        Some(plan) => {
            let view = PlanView::of(plan);
            format!(
                "admitted: {:.0} of {:.0} tokens/s reserved for latency-critical tenants, {:.0} left{}",
                view.lc_reserved_tokens_per_sec,
                view.device_tokens_per_sec,
                view.left_tokens_per_sec,
                plan.latency_us_p95
                    .map(|us| format!(" at {us} µs"))
                    .unwrap_or_default()
            )
        }
        None => "admitted".to_string(),
    }
}

pub async fn get_server(State(state): State<Shared>) -> Response {
    let persistent_state = state
        .persistence
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .as_ref()
        .map(|(file, _)| file.path().display().to_string());
    json(ServerView {
        version: state.version,
        threads: state.threads,
        namespaces: state.namespaces().live_count(),
        tenants: state.control.tenants().len(),
        persistent_state,
    })
}

pub async fn list_namespaces(State(state): State<Shared>) -> Response {
    let views: Vec<NamespaceView> = state
        .namespaces()
        .live_indices()
        .map(|index| state.namespace_view(index))
        .collect();
    json(views)
}

pub async fn create_namespace(
    State(state): State<Shared>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> ApiResult<Response> {
    let body: NamespaceCreate = object_body(body)?;
    let namespace_id = body.namespace_id;
    let config = crate::config::NamespaceConfig {
        id: namespace_id,
        backend: body.backend,
        size_bytes: body.size_bytes,
        read_only: body.read_only,
        name: body.nbd_export,
        tenant: None,
        profile: body.profile,
    };
    let index = state.manager.add(&config, true)?;
    let runtime = state.manager.runtime_namespaces();
    if let Err(error) = state.persist(|file| file.namespaces = runtime) {
        let _ = state.manager.remove(namespace_id, true);
        return Err(error);
    }
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/v1/namespaces/{namespace_id}"))],
        Json(state.namespace_view(index)),
    )
        .into_response())
}

pub async fn delete_namespace(
    State(state): State<Shared>,
    path: Result<Path<u32>, PathRejection>,
    query: Result<Query<NamespaceDelete>, QueryRejection>,
) -> ApiResult<Response> {
    let Path(namespace_id) = path?;
    let Query(query) = query?;
    state.namespace_index(namespace_id)?;
    state.manager.remove(namespace_id, query.force)?;
    let runtime = state.manager.runtime_namespaces();
    state
        .persist(|file| {
            file.namespaces = runtime;
            file.tenants
                .retain(|tenant| tenant.namespace_id != namespace_id);
        })
        .inspect_err(|_| {
            tracing::error!(
                namespace = namespace_id,
                "namespace removed, but the state file still has it: it comes back at restart"
            );
        })?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn get_namespace(
    State(state): State<Shared>,
    path: Result<Path<u32>, PathRejection>,
) -> ApiResult<Response> {
    let Path(namespace_id) = path?;
    let index = state.namespace_index(namespace_id)?;
    Ok(json(state.namespace_view(index)))
}

pub async fn list_tenants(State(state): State<Shared>) -> Response {
    let views: Vec<TenantView> = state
        .control
        .tenants()
        .iter()
        .map(|info| state.tenant_view(info))
        .collect();
    json(views)
}

fn find(state: &AdminState, namespace_id: u32, name: &str) -> ApiResult<TenantInfo> {
    state.namespace_index(namespace_id)?;
    state
        .control
        .find_tenant(namespace_id, name)
        .and_then(|handle| state.control.tenant(handle))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no tenant {name:?} on namespace {namespace_id}"),
            )
        })
}

pub async fn get_tenant(
    State(state): State<Shared>,
    path: Result<Path<(u32, String)>, PathRejection>,
) -> ApiResult<Response> {
    let Path((namespace_id, name)) = path?;
    let info = find(&state, namespace_id, &name)?;
    Ok(json(state.tenant_view(&info)))
}

pub async fn create_tenant(
    State(state): State<Shared>,
    path: Result<Path<u32>, PathRejection>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> ApiResult<Response> {
    let Path(namespace_id) = path?;
    let body: TenantCreate = object_body(body)?;
    state.namespace_index(namespace_id)?;
    check_name(&body.name)?;
    check_rt_alone(body.rt_alone_us)?;
    let spec = spec_of(
        body.class,
        body.latency_us_p95,
        body.iops,
        body.read_percent,
    )?;
    let mut outcome =
        state
            .control
            .admin_register(namespace_id, &body.name, spec, body.read_only)?;
    if body.rt_alone_us.is_some() {
        outcome.tenant =
            state
                .control
                .admin_set_alone(namespace_id, &body.name, body.rt_alone_us)?;
    }
    let persisted = PersistedTenant {
        namespace_id,
        name: body.name.clone(),
        spec,
        read_only: body.read_only,
        origin: Origin::Admin,
        rt_alone_us: body.rt_alone_us,
    };
    if let Err(error) = state.persist(|file| file.upsert(persisted)) {
        let _ = state.control.admin_remove(namespace_id, &body.name);
        return Err(error);
    }
    let response = TenantChanged {
        tenant: state.tenant_view(&outcome.tenant),
        admission: AdmissionView {
            admitted: true,
            reason: admission_reason(outcome.plan.as_ref()),
        },
        plan: outcome.plan.as_ref().map(PlanView::of),
    };
    Ok((
        StatusCode::CREATED,
        [(
            header::LOCATION,
            format!("/v1/namespaces/{namespace_id}/tenants/{}", body.name),
        )],
        Json(response),
    )
        .into_response())
}

pub async fn update_tenant(
    State(state): State<Shared>,
    path: Result<Path<(u32, String)>, PathRejection>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> ApiResult<Response> {
    let Path((namespace_id, name)) = path?;
    let body: TenantPatch = object_body(body)?;
    let info = find(&state, namespace_id, &name)?;
    if let Some(rt_alone_us) = body.rt_alone_us {
        check_rt_alone(rt_alone_us)?;
    }
    let slo_given = body.class.is_some()
        || body.latency_us_p95.is_some()
        || body.iops.is_some()
        || body.read_percent.is_some();
    if !slo_given && let Some(rt_alone_us) = body.rt_alone_us {
        // RT_alone alone: no admission, and the default tenant (untenanted flows) takes it too.
        return set_alone_only(&state, namespace_id, &name, &info, rt_alone_us);
    }
    if info.name == "(default)" {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "the namespace's default tenant stays best-effort",
        ));
    }
    let (class, latency, iops, read_percent) = match info.spec {
        TenantSpec::LatencyCritical {
            latency_us_p95,
            iops,
            read_percent,
        } => (
            ClassBody::Lc,
            Some(latency_us_p95),
            Some(iops),
            Some(read_percent),
        ),
        TenantSpec::BestEffort => (ClassBody::Be, None, None, None),
    };
    let class_after = body.class.unwrap_or(class);
    // What is wrong only given the tenant's present class is a conflict with its state (the
    // body alone is valid): SLO fields for a best-effort tenant, or too few to become LC.
    let slo_given =
        body.latency_us_p95.is_some() || body.iops.is_some() || body.read_percent.is_some();
    if body.class.is_none() && class == ClassBody::Be && slo_given {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "tenant {name} is best-effort: give \"class\": \"lc\" with latency_us_p95 and iops to make it latency-critical"
            ),
        ));
    }
    if class_after == ClassBody::Lc
        && (body.latency_us_p95.or(latency).is_none() || body.iops.or(iops).is_none())
    {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "tenant {name} is best-effort: a change to latency-critical needs latency_us_p95 and iops"
            ),
        ));
    }
    let spec = match class_after {
        ClassBody::Be => spec_of(
            ClassBody::Be,
            body.latency_us_p95,
            body.iops,
            body.read_percent,
        )?,
        ClassBody::Lc => spec_of(
            ClassBody::Lc,
            body.latency_us_p95.or(latency),
            body.iops.or(iops),
            body.read_percent.or(read_percent),
        )?,
    };
    let old_spec = info.spec;
    let mut outcome = state.control.admin_update(namespace_id, &name, spec)?;
    if let Some(rt_alone_us) = body.rt_alone_us {
        outcome.tenant = state
            .control
            .admin_set_alone(namespace_id, &name, rt_alone_us)?;
    }
    let persisted = state.persisted(
        namespace_id,
        &info,
        spec,
        body.rt_alone_us.unwrap_or(info.rt_alone_us),
    );
    // A wire tenant's SLO is its client's business: it does not outlive the server.
    if !info.dynamic
        && let Err(error) = state.persist(|file| file.upsert(persisted))
    {
        let _ = state.control.admin_update(namespace_id, &name, old_spec);
        let _ = state
            .control
            .admin_set_alone(namespace_id, &name, info.rt_alone_us);
        return Err(error);
    }
    Ok(json(TenantChanged {
        tenant: state.tenant_view(&outcome.tenant),
        admission: AdmissionView {
            admitted: true,
            reason: admission_reason(outcome.plan.as_ref()),
        },
        plan: outcome.plan.as_ref().map(PlanView::of),
    }))
}

/// A PATCH that sets only RT_alone: no admission runs (the SLO is unchanged), so the
/// namespace's default tenant (the untenanted flows) may take one too. Kept in the state file
/// for tenants that outlive the server, like an SLO change; the default tenant's lasts until
/// the restart.
fn set_alone_only(
    state: &Shared,
    namespace_id: u32,
    name: &str,
    info: &TenantInfo,
    rt_alone_us: Option<u32>,
) -> ApiResult<Response> {
    let tenant = state
        .control
        .admin_set_alone(namespace_id, name, rt_alone_us)?;
    if !info.dynamic && info.name != "(default)" {
        let persisted = state.persisted(namespace_id, info, info.spec, rt_alone_us);
        if let Err(error) = state.persist(|file| file.upsert(persisted)) {
            let _ = state
                .control
                .admin_set_alone(namespace_id, name, info.rt_alone_us);
            return Err(error);
        }
    }
    let plan = state.control.plan(state.namespace_index(namespace_id)?);
    Ok(json(TenantChanged {
        tenant: state.tenant_view(&tenant),
        admission: AdmissionView {
            admitted: true,
            reason: admission_reason(plan.as_ref()),
        },
        plan: plan.as_ref().map(PlanView::of),
    }))
}

pub async fn delete_tenant(
    State(state): State<Shared>,
    path: Result<Path<(u32, String)>, PathRejection>,
) -> ApiResult<Response> {
    let Path((namespace_id, name)) = path?;
    let info = find(&state, namespace_id, &name)?;
    let managed = state.control.is_managed(info.handle);
    if !managed && !info.dynamic {
        return Err(AdminError::NotChangeable {
            name,
            reason: "comes from the configuration file: remove it there",
        }
        .into());
    }
    if managed {
        // Durable first: a crash after this leaves the tenant gone at the next start, which
        // is what was asked; the change in memory cannot fail for a managed tenant.
        state.persist(|file| file.remove(namespace_id, &name))?;
    }
    state.control.admin_remove(namespace_id, &name)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub async fn get_stats(State(state): State<Shared>) -> Response {
    let view = state
        .sampler
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .view();
    json(view)
}

/// `GET /v1/fairness`: the fairness stages and their monitors, per namespace and thread.
pub async fn get_fairness(State(state): State<Shared>) -> Response {
    let view = state
        .sampler
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .fairness_view();
    json(view)
}

/// Thread scaling as `GET /v1/scaling` shows it.
#[derive(Debug, Serialize)]
pub struct ScalingView {
    /// Whether the load parks and wakes threads (`[scaling] enabled`); an operator can
    /// either way.
    pub enabled: bool,
    pub threads: usize,
    pub active: u16,
    pub active_per_thread: Vec<bool>,
    pub connections_per_thread: Vec<u32>,
    pub parks_total: u64,
    pub wakes_total: u64,
    /// Connections handed from one thread to another (parks, rebalancings, spreading).
    pub connections_moved_total: u64,
    /// Of those, the ones a rebalancing onto a woken thread moved.
    pub connections_rebalanced_total: u64,
    /// Of those, the ones moved after a BIND to spread their tenant's connections over the
    /// threads (`[scaling] spread_tenants`).
    pub connections_spread_total: u64,
    /// The newest events, oldest first.
    pub events: Vec<crate::scaling::ScalingEvent>,
}

/// `POST /v1/scaling`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalingChange {
    /// Threads to keep active (clamped to `active_min ..= threads`).
    pub active: u16,
}

impl AdminState {
    fn scaling_view(&self) -> ScalingView {
        match &self.scaling {
            Some(scaling) => ScalingView {
                enabled: scaling.config().enabled,
                threads: self.threads,
                active: scaling.active(),
                active_per_thread: scaling.active_per_thread(),
                connections_per_thread: scaling.connections_per_thread(),
                parks_total: scaling.parks(),
                wakes_total: scaling.wakes(),
                connections_moved_total: scaling.connections_moved(),
                connections_rebalanced_total: scaling.connections_rebalanced(),
                connections_spread_total: scaling.connections_spread(),
                events: scaling.events(),
            },
            None => ScalingView {
                enabled: false,
                threads: self.threads,
                active: self.threads as u16,
                active_per_thread: vec![true; self.threads],
                connections_per_thread: Vec::new(),
                parks_total: 0,
                wakes_total: 0,
                connections_moved_total: 0,
                connections_rebalanced_total: 0,
                connections_spread_total: 0,
                events: Vec::new(),
            },
        }
    }
}

/// `GET /v1/scaling`: the active threads, each thread's connections and the scaling events.
pub async fn get_scaling(State(state): State<Shared>) -> Response {
    json(state.scaling_view())
}

/// `POST /v1/scaling`: an operator parks or wakes threads until `active` take connections.
pub async fn change_scaling(
    State(state): State<Shared>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> ApiResult<Response> {
    let body: ScalingChange = object_body(body)?;
    let Some(scaling) = &state.scaling else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "the server runs one dataplane thread: nothing to scale",
        ));
    };
    scaling.force(body.active);
    Ok(json(state.scaling_view()))
}

/// `GET /metrics`: OpenMetrics for clients that ask for it (Prometheus does), the Prometheus
/// text format 0.0.4 for the rest.
pub async fn get_metrics(
    State(state): State<Shared>,
    headers: axum::http::HeaderMap,
) -> ApiResult<Response> {
    let text = crate::metrics::encode(&state.sampler).map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics",
        )
    })?;
    let open_metrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("application/openmetrics-text"));
    let (content_type, text) = if open_metrics {
        (
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            text,
        )
    } else {
        (
            "text/plain; version=0.0.4; charset=utf-8",
            crate::metrics::prometheus_text(&text),
        )
    };
    Ok(([(header::CONTENT_TYPE, content_type)], text).into_response())
}

/// Whether the request's `Authorization` header is `Bearer <token>`, compared in constant
/// time (the time taken does not depend on how much of the token matched).
fn bearer_matches(headers: &header::HeaderMap, token: &str) -> bool {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return false;
    };
    let Some(presented) = value.as_bytes().strip_prefix(b"Bearer ") else {
        return false;
    };
    constant_time_eq(presented, token.as_bytes())
}

/// Compares two byte strings in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such resource")
}

/// The admin API's access control, in order: the allow-list (403), peers not on this
/// machine unless `allow_remote` is set (403), and the bearer token from every peer outside
/// `token_exempt` when a token is configured (401). A remote peer so needs `allow_remote`,
/// the allow-list (when set) and the token. Each refusal is counted and logged.
pub async fn only_local(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use crate::admin::stats::AdminRefusal;
    let refuse = |refusal: AdminRefusal, response: Response| {
        state.refused.add(refusal);
        let mut log = state
            .refusal_log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = reflex_qos::Nanos(log.0.elapsed().as_nanos() as u64);
        if let Some(suppressed) = log.1.admit(now) {
            tracing::warn!(peer = %peer.ip(), reason = refusal.label(),
                method = %request.method(), path = %request.uri().path(),
                refused_unlogged = suppressed, "admin API request refused");
        }
        response
    };
    if let Some(allow) = &state.allow
        && !allow.allows(peer.ip())
    {
        return refuse(
            AdminRefusal::NotAllowed,
            ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "{} is not on the admin API's allow-list ([admin] allow)",
                    peer.ip()
                ),
            )
            .into_response(),
        );
    }
    if let Some(token) = &state.token
        && !state.token_exempt.allows(peer.ip())
        && !bearer_matches(request.headers(), token)
    {
        let mut response = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this request needs the admin token: Authorization: Bearer <token> ([admin] token_file)",
        )
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer realm=\"reflexd\""),
        );
        return refuse(AdminRefusal::Unauthorized, response);
    }
    if !state.allow_remote && !peer.ip().is_loopback() {
        return refuse(
            AdminRefusal::Remote,
            ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "the admin API serves only this machine; {} is not a loopback address \
                     ([admin] allow_remote = true opens it)",
                    peer.ip()
                ),
            )
            .into_response(),
        );
    }
    next.run(request).await
}
