//! Helpers of the admin API's tests: a reflexd with the admin API on a free loopback port,
//! and a small JSON client over it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use reflex_proto::nbd::{self, ClientHandshake};

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

/// A minimal NBD client: the fixed newstyle handshake for one export, then simple replies.
pub struct Nbd {
    stream: TcpStream,
    cookie: u64,
}

impl Nbd {
    /// Connects and negotiates `export`; `Err` when the server refuses it.
    pub fn connect(addr: SocketAddr, export: &str) -> Result<Nbd, String> {
        let mut stream = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let mut handshake = ClientHandshake::new(export).map_err(|e| e.to_string())?;
        let mut buffer = [0u8; 4096];
        while handshake.outcome().is_none() {
            let pending = handshake.pending_output().to_vec();
            if !pending.is_empty() {
                stream.write_all(&pending).map_err(|e| e.to_string())?;
                handshake.consume_output(pending.len());
                continue;
            }
            let count = stream.read(&mut buffer).map_err(|e| e.to_string())?;
            if count == 0 {
                return Err(handshake.handle_eof().to_string());
            }
            let consumed = handshake
                .handle_bytes(&buffer[..count])
                .map_err(|e| e.to_string())?;
            assert_eq!(consumed, count, "bytes after the handshake");
        }
        let pending = handshake.pending_output().to_vec();
        stream.write_all(&pending).map_err(|e| e.to_string())?;
        Ok(Nbd { stream, cookie: 0 })
    }

    /// The reply's error (0: success), after reading `data_bytes` of READ data into `data`.
    fn reply(&mut self, data: &mut [u8]) -> u32 {
        let mut header = [0u8; 16];
        self.stream
            .read_exact(&mut header)
            .unwrap_or_else(|e| panic!("reply: {e}"));
        let (reply, _) = nbd::decode_simple_reply(&header)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("short reply"));
        assert_eq!(reply.cookie, self.cookie);
        if reply.error == 0 && !data.is_empty() {
            self.stream
                .read_exact(data)
                .unwrap_or_else(|e| panic!("data: {e}"));
        }
        reply.error
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.cookie += 1;
        let mut request = nbd::write_request(self.cookie, offset, data.len() as u32, 0).to_vec();
        request.extend_from_slice(data);
        self.stream
            .write_all(&request)
            .unwrap_or_else(|e| panic!("send: {e}"));
        self.reply(&mut [])
    }

    pub fn read(&mut self, offset: u64, data: &mut [u8]) -> u32 {
        self.cookie += 1;
        let request = nbd::read_request(self.cookie, offset, data.len() as u32);
        self.stream
            .write_all(&request)
            .unwrap_or_else(|e| panic!("send: {e}"));
        self.reply(data)
    }
}

/// `promtool check metrics` (Debian's prometheus package, which `scripts/test.sh` installs)
/// finds nothing wrong with the exposition's names, types and help.
pub fn promtool_accepts(text: &str) {
    use std::process::{Command, Stdio};
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("promtool (Debian's prometheus package; scripts/test.sh installs it): {e}")
        });
    promtool
        .stdin
        .take()
        .unwrap_or_else(|| panic!("stdin"))
        .write_all(text.as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let output = promtool
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        output.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
