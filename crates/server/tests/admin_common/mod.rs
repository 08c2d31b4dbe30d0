//! Helpers of the admin API's tests: a reflexd with the admin API on a free loopback port,
//! and a small JSON client over it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reflex_server::admin::AdminConfig;
use reflex_server::{Config, NamespaceConfig, Server, ServerHandle, TenantConfig};

/// Where the shipped profiles live.
pub fn profile(name: &str) -> String {
    format!("{}/../../profiles/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A server on an emulated device with a QoS profile, configured tenant `gold` (LC 500 µs,
/// 10K IOPS) bound to namespace 1, and the admin API on a free port.
pub fn config(state_file: Option<String>) -> Config {
    let namespace = NamespaceConfig {
        profile: Some(profile("device-a-small.toml")),
        tenant: Some("gold".into()),
        ..NamespaceConfig::new(1, "emu:device-a-small").sized(64 << 20)
    };
    Config {
        tenants: vec![TenantConfig::latency_critical("gold", 500, 10_000, 100)],
        admin: AdminConfig {
            state_file,
            stats_window: Duration::from_millis(200),
            ..AdminConfig::loopback()
        },
        driver: driver(),
        ..Config::loopback(vec![namespace])
    }
}

pub fn driver() -> reflex_server::DriverChoice {
    match std::env::var("REFLEX_DRIVER").as_deref() {
        Ok("epoll") => reflex_server::DriverChoice::Epoll,
        Ok("uring") => reflex_server::DriverChoice::Uring,
        _ => reflex_server::DriverChoice::Auto,
    }
}

pub fn start(config: Config) -> (ServerHandle, Api) {
    let server = Server::start(config).unwrap_or_else(|e| panic!("server start: {e}"));
    let addr = server
        .admin_addr()
        .unwrap_or_else(|| panic!("no admin listener"));
    (server, Api::new(addr))
}

/// A JSON client of the admin API that returns every status (4xx included).
pub struct Api {
    base: String,
    agent: ureq::Agent,
}

/// A response: status and body text (JSON parsed when it is).
pub struct Reply {
    pub status: u16,
    pub text: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }

    /// The error message of a 4xx/5xx.
    pub fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message: {}", self.text))
            .to_string()
    }
}

impl Api {
    pub fn new(addr: SocketAddr) -> Api {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Api {
            base: format!("http://{addr}"),
            agent,
        }
    }

    fn reply(result: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
        let mut response = result.unwrap_or_else(|e| panic!("HTTP: {e}"));
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .unwrap_or_else(|e| panic!("body: {e}"));
        Reply { status, text }
    }

    pub fn addr(&self) -> SocketAddr {
        self.base
            .trim_start_matches("http://")
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", self.base))
    }

    /// A request's status, or `None` when the server did not answer (it died).
    pub fn try_status(&self, method: &str, path: &str, body: Option<&str>) -> Option<u16> {
        let url = format!("{}{path}", self.base);
        let result = match (method, body) {
            ("post", Some(body)) => self
                .agent
                .post(url)
                .header("content-type", "application/json")
                .send(body),
            ("patch", Some(body)) => self
                .agent
                .patch(url)
                .header("content-type", "application/json")
                .send(body),
            ("delete", _) => self.agent.delete(url).call(),
            _ => self.agent.get(url).call(),
        };
        let mut response = result.ok()?;
        response.body_mut().read_to_string().ok()?;
        Some(response.status().as_u16())
    }

    pub fn get_with_accept(&self, path: &str, accept: &str) -> Reply {
        Self::reply(
            self.agent
                .get(format!("{}{path}", self.base))
                .header("accept", accept)
                .call(),
        )
    }

    pub fn get(&self, path: &str) -> Reply {
        Self::reply(self.agent.get(format!("{}{path}", self.base)).call())
    }

    pub fn delete(&self, path: &str) -> Reply {
        Self::reply(self.agent.delete(format!("{}{path}", self.base)).call())
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        Self::reply(
            self.agent
                .post(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .send(body),
        )
    }

    /// A POST whose body is declared as `content_type`.
    pub fn post_as(&self, path: &str, content_type: &str, body: &str) -> Reply {
        Self::reply(
            self.agent
                .post(format!("{}{path}", self.base))
                .header("content-type", content_type)
                .send(body),
        )
    }

    pub fn patch(&self, path: &str, body: &str) -> Reply {
        Self::reply(
            self.agent
                .patch(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .send(body),
        )
    }

    /// Polls `GET path` until `done` holds for its JSON (bounded: 30 s).
    pub fn wait_for(
        &self,
        path: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let started = Instant::now();
        loop {
            let value = self.get(path).json();
            if done(&value) {
                return value;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{path} never satisfied the condition: {value}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The tenant called `name` in a list of tenants.
pub fn tenant<'a>(list: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    list.as_array()?
        .iter()
        .find(|tenant| tenant["name"] == name)
}
