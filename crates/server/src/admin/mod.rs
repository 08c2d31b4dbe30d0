//! The admin API: an HTTP/JSON listener (default `127.0.0.1:7071`) served by a control-plane
//! thread of its own (`reflex-admin`), never by a dataplane thread. It runs axum on a
//! single-threaded tokio runtime; besides the requests it closes a statistics window every
//! [`AdminConfig::stats_window`] (`stats`), and it exposes Prometheus metrics at `/metrics`
//! (`crate::metrics`).
//!
//! Changes go through the same control plane the dataplane uses (`ControlPlane::admin_*`):
//! admission runs under its lock, and the rate updates reach every thread's mailbox (the
//! threads are woken), so a change is in force from each thread's next scheduling round.
//! Tenants created through the API, and SLO changes of configured tenants, are written to the
//! state file (`state_file`) before the answer is sent, and restored at start.
//!
//! Invariants: nothing from the network panics this thread or changes anything when it is
//! refused; the dataplane never waits for this thread (it only reads snapshots the threads
//! publish and takes the control plane's lock like a REGISTER would).

pub mod api;
pub mod state_file;
pub mod stats;

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::get;
use ipnet::IpNet;
use reflex_dataplane::access::AllowList;
use reflex_dataplane::control::{AdminError, ControlPlane};
use serde::Deserialize;

use self::api::{AdminState, Shared};
use self::state_file::{Origin, PersistedState, StateError, StateFile};
use self::stats::Sampler;

/// Default address of the admin listener.
pub const ADMIN_ADDR_DEFAULT: &str = "127.0.0.1:7071";
/// Largest request body the API reads.
pub const BODY_BYTES_MAX: usize = 64 << 10;

/// `[admin]` in the configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Whether to serve the admin API at all.
    pub enabled: bool,
    /// Address and port (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Serve peers that are not on this machine too; needs `token_file` (a remote peer must
    /// present the token).
    pub allow_remote: bool,
    /// Source addresses (CIDR blocks) the admin API serves; `None`: every address (within
    /// `allow_remote`). Checked before everything else.
    pub allow: Option<Vec<IpNet>>,
    /// A file holding the bearer token (one line; surrounding whitespace is ignored): when
    /// set, every request from a peer outside `token_exempt` must carry
    /// `Authorization: Bearer <token>`, or is answered 401. In a configuration file,
    /// relative to the file's folder.
    pub token_file: Option<String>,
    /// Peers that need no token (CIDR blocks): loopback by default (`127.0.0.0/8`, `::1`).
    /// `[]` asks every peer for the token.
    pub token_exempt: Vec<IpNet>,
    /// Where tenants created through the API and SLO changes persist; `None`: nowhere
    /// (they are lost at exit). In a configuration file, relative to the file's folder.
    pub state_file: Option<String>,
    /// The statistics window: rates, quantiles and SLO attainment are per window.
    #[serde(with = "humantime_serde")]
    pub stats_window: Duration,
}

impl Default for AdminConfig {
    fn default() -> AdminConfig {
        AdminConfig {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 7071)),
            allow_remote: false,
            allow: None,
            token_file: None,
            token_exempt: loopback_nets(),
            state_file: Some("./reflex-data/state.json".to_string()),
            stats_window: Duration::from_secs(1),
        }
    }
}

impl AdminConfig {
    /// No admin listener and no state file (embedded servers, tests).
    pub fn disabled() -> AdminConfig {
        AdminConfig {
            enabled: false,
            state_file: None,
            ..AdminConfig::default()
        }
    }

    /// Serving on a free loopback port, state in memory only (tests).
    pub fn loopback() -> AdminConfig {
        AdminConfig {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            state_file: None,
            ..AdminConfig::default()
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.stats_window < Duration::from_millis(100)
            || self.stats_window > Duration::from_secs(3600)
        {
            return Err(format!(
                "admin.stats_window {:?} not in 100ms..=1h",
                self.stats_window
            ));
        }
        if let Some(path) = &self.state_file
            && path.is_empty()
        {
            return Err("admin.state_file is empty".into());
        }
        if self.enabled && self.allow_remote && self.token_file.is_none() {
            return Err(
                "admin.allow_remote needs admin.token_file: a remote peer must present a \
                 credential"
                    .into(),
            );
        }
        if let Some(path) = &self.token_file
            && path.is_empty()
        {
            return Err("admin.token_file is empty".into());
        }
        Ok(())
    }

    /// The bearer token from `token_file` (`None`: none configured).
    pub fn load_token(&self) -> Result<Option<String>, AdminStartError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|source| AdminStartError::Token {
            path: path.clone(),
            reason: source.to_string(),
        })?;
        let token = text.trim();
        if token.is_empty() || token.contains(char::is_whitespace) {
            return Err(AdminStartError::Token {
                path: path.clone(),
                reason: "the token must be one non-empty word".into(),
            });
        }
        if let Ok(metadata) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            let mode = metadata.permissions().mode();
            if mode & 0o077 != 0 {
                tracing::warn!(path = %path, mode = format!("{:o}", mode & 0o777),
                    "the admin token file is readable by other users: chmod 600 it");
            }
        }
        Ok(Some(token.to_string()))
    }
}

/// The loopback blocks: `127.0.0.0/8` and `::1/128`.
pub fn loopback_nets() -> Vec<IpNet> {
    vec![
        IpNet::V4(ipnet::Ipv4Net::new_assert(
            std::net::Ipv4Addr::new(127, 0, 0, 0),
            8,
        )),
        IpNet::V6(ipnet::Ipv6Net::new_assert(
            std::net::Ipv6Addr::LOCALHOST,
            128,
        )),
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum AdminStartError {
    #[error("admin API: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("admin API: {0}")]
    Thread(String),
    #[error("admin API: token file {path}: {reason}")]
    Token { path: String, reason: String },
    #[error(transparent)]
    State(#[from] StateError),
    #[error("state file: namespace {namespace_id}: tenant {name:?}: {error}")]
    Restore {
        namespace_id: u32,
        name: String,
        error: AdminError,
    },
}

/// The persisted state, applied to the control plane at start: admin tenants are admitted
/// again, configured tenants get their changed SLO back. Entries for namespaces that are
/// gone are dropped with a warning; a tenant admission now refuses stops the start (the
/// operator decides).
pub fn restore(
    control: &ControlPlane,
    manager: &crate::namespaces::NamespaceManager,
    file: &StateFile,
) -> Result<PersistedState, AdminStartError> {
    let mut state = file.load()?;
    // Namespaces first: tenants may be bound to them. One that cannot be added again (its
    // backend is gone, the configuration now has its id) is dropped with the reason.
    let mut namespaces_kept = Vec::new();
    for namespace in std::mem::take(&mut state.namespaces) {
        match manager.add(&namespace.to_config(), true) {
            Ok(_) => {
                tracing::info!(namespace = namespace.namespace_id, backend = %namespace.backend,
                    "namespace restored from the state file");
                namespaces_kept.push(namespace);
            }
            Err(error) => {
                tracing::warn!(namespace = namespace.namespace_id, %error,
                    "the state file's namespace cannot be added again; dropped");
            }
        }
    }
    state.namespaces = namespaces_kept;
    let mut kept = Vec::new();
    for tenant in std::mem::take(&mut state.tenants) {
        let result = match tenant.origin {
            Origin::Admin => control
                .admin_register(
                    tenant.namespace_id,
                    &tenant.name,
                    tenant.spec,
                    tenant.read_only,
                )
                .map(|_| ()),
            Origin::Config => control
                .admin_update(tenant.namespace_id, &tenant.name, tenant.spec)
                .map(|_| ()),
        };
        // An RT_alone set through the admin API comes back with its tenant.
        let result = result.and_then(|()| match tenant.rt_alone_us {
            Some(rt_alone_us) => control
                .admin_set_alone(tenant.namespace_id, &tenant.name, Some(rt_alone_us))
                .map(|_| ()),
            None => Ok(()),
        });
        match result {
            Ok(()) => {
                tracing::info!(namespace = tenant.namespace_id, tenant = %tenant.name,
                    origin = ?tenant.origin, "tenant restored from the state file");
                kept.push(tenant);
            }
            Err(AdminError::NoSuchNamespace(_)) | Err(AdminError::NoSuchTenant { .. }) => {
                tracing::warn!(namespace = tenant.namespace_id, tenant = %tenant.name,
                    "the state file names a namespace or tenant the configuration no longer has; dropped");
            }
            Err(error) => {
                return Err(AdminStartError::Restore {
                    namespace_id: tenant.namespace_id,
                    name: tenant.name,
                    error,
                });
            }
        }
    }
    state.tenants = kept;
    Ok(state)
}

/// The running admin API.
pub struct AdminHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl AdminHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and joins the thread.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the admin thread starts from.
pub struct AdminSetup {
    pub config: AdminConfig,
    pub control: Arc<ControlPlane>,
    pub manager: Arc<crate::namespaces::NamespaceManager>,
    pub persistence: Option<(StateFile, PersistedState)>,
    pub threads: usize,
    /// Thread scaling, when the server runs several threads (metrics).
    pub scaling: Option<Arc<crate::scaling::ScalingControl>>,
}

/// The router of every route in [`api::ROUTES`].
pub fn router(state: Shared) -> Router {
    use axum::routing::post;
    Router::new()
        .route("/v1/server", get(api::get_server))
        .route(
            "/v1/namespaces",
            get(api::list_namespaces).post(api::create_namespace),
        )
        .route(
            "/v1/namespaces/{namespace_id}",
            get(api::get_namespace).delete(api::delete_namespace),
        )
        .route("/v1/tenants", get(api::list_tenants))
        .route(
            "/v1/namespaces/{namespace_id}/tenants",
            post(api::create_tenant),
        )
        .route(
            "/v1/namespaces/{namespace_id}/tenants/{name}",
            get(api::get_tenant)
                .patch(api::update_tenant)
                .delete(api::delete_tenant),
        )
        .route("/v1/stats", get(api::get_stats))
        .route("/v1/fairness", get(api::get_fairness))
        .route(
            "/v1/scaling",
            get(api::get_scaling).post(api::change_scaling),
        )
        .route("/metrics", get(api::get_metrics))
        .fallback(api::not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            api::only_local,
        ))
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(state)
}

/// Binds the listener (so a port in use stops start-up with the reason) and starts the
/// control-plane thread that serves it.
pub fn start(setup: AdminSetup) -> Result<AdminHandle, AdminStartError> {
    let token = setup.config.load_token()?;
    let addr = setup.config.listen;
    let listener =
        TcpListener::bind(addr).map_err(|source| AdminStartError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| AdminStartError::Bind { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| AdminStartError::Bind { addr, source })?;
    let mut sampler = Sampler::new(Arc::clone(&setup.control), Arc::clone(&setup.manager));
    sampler.scaling = setup.scaling.clone();
    let sampler = Arc::new(Mutex::new(sampler));
    let refused = Arc::clone(
        &sampler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admin_refused,
    );
    let state = Arc::new(AdminState {
        allow: setup.config.allow.clone().map(AllowList::new),
        token,
        token_exempt: AllowList::new(setup.config.token_exempt.clone()),
        refused,
        refusal_log: Mutex::new((
            std::time::Instant::now(),
            reflex_dataplane::access::RefusalLog::new(),
        )),
        control: setup.control,
        manager: setup.manager,
        sampler: Arc::clone(&sampler),
        persistence: Mutex::new(setup.persistence),
        allow_remote: setup.config.allow_remote,
        version: env!("CARGO_PKG_VERSION"),
        threads: setup.threads,
        scaling: setup.scaling.clone(),
    });
    let window = setup.config.stats_window;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("reflex-admin".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    tracing::error!(%error, "admin API: cannot build its runtime");
                    return;
                }
            };
            runtime.block_on(serve(listener, state, sampler, window, stop_rx));
        })
        .map_err(|error| AdminStartError::Thread(error.to_string()))?;
    tracing::info!(addr = %bound, "admin API listening");
    Ok(AdminHandle {
        addr: bound,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

async fn serve(
    listener: TcpListener,
    state: Shared,
    sampler: Arc<Mutex<Sampler>>,
    window: Duration,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "admin API: cannot serve its listener");
            return;
        }
    };
    let windows = async move {
        let mut ticker = tokio::time::interval(window);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            sampler
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .close_window();
        }
    };
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stop.await;
    });
    tokio::select! {
        result = server => {
            if let Err(error) = result {
                tracing::error!(%error, "admin API stopped");
            }
        }
        () = windows => {}
    }
}
