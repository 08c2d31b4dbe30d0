//! `reflex flood`: crowds and hostile clients for the scale and overload benchmarks
//! (`bench/scale.sh`, `bench/overload.sh`, `docs/BENCHMARKS.md`), against a native port.
//!
//! One run sets up any mix of:
//! - `--idle N`: connections that each complete one request (HELLO) and then send nothing,
//!   so the server counts them as established and parks them;
//! - `--slowloris N`: connections that send the first 2 bytes of a request header and wait;
//!   with `--reconnect`, each one the server closes (eviction, handshake timeout) is replaced;
//! - `--non-reader N`: connections with a tiny receive buffer that pipeline
//!   `--non-reader-requests` READs of `--non-reader-size` and never read an answer;
//! - `--register N`: best-effort tenants registered over `ceil(N / --tenants-per-connection)`
//!   connections, their handles written to `--handles FILE` (one per line), unregistered at
//!   the end;
//! - `--fresh-interval T`: every T, a fresh client connects, sends HELLO and one 4 KiB READ
//!   and closes: the time from connect to the READ's answer is what a newcomer waits.
//!
//! Then it holds everything for `--duration`, checks every `--check-interval` which idle and
//! slowloris connections the server closed, prints a progress line per second on stderr, and
//! reports counts and the fresh clients' latencies (table, or `--json`). `--ready-file` is
//! created once everything is set up, so a script knows when to measure; `--stop-file` ends
//! the hold early when it appears.
//!
//! Bounds: every count is at most [`CONNECTIONS_MAX`] (tenants [`TENANTS_MAX`]), new
//! connections are paced at `--connect-rate`, set-up gives up after `--setup-timeout`, the hold
//! ends after `--duration` (at most [`DURATION_MAX`]), and every blocking read or connect has a
//! timeout. Loopback or a test network only: this is an attack tool for our own server.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use reflex_client::{Client, ClientOptions};
use reflex_proto::native::{
    HELLO_BODY_SIZE, HelloBody, RESPONSE_HEADER_SIZE, RequestHeader, ResponseHeader,
};
use serde::Serialize;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::bench::units::{parse_duration, parse_size};

/// Most connections of one kind one run opens.
pub const CONNECTIONS_MAX: usize = 60_000;
/// Most tenants one run registers.
pub const TENANTS_MAX: usize = 100_000;
/// Longest hold.
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
/// Size of the fresh clients' READ.
const FRESH_READ_BYTES: u32 = 4096;
/// Largest response body the tool reads (a HELLO's capabilities, a 4 KiB READ).
const RESPONSE_BODY_MAX_BYTES: u32 = 1 << 20;
/// How often the hold looks for `--stop-file`.
const STOP_FILE_INTERVAL: Duration = Duration::from_millis(100);
/// The bytes a slowloris connection sends: the start of a request header's magic.
const SLOWLORIS_BYTES: &[u8] = b"RF";

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Server address (native protocol).
    #[arg(long, short = 's', default_value = "127.0.0.1:7070")]
    server: String,
    /// Local address the flood's connections come from (e.g. 127.0.0.2 on loopback, to be a
    /// different source than the clients under test); fresh clients and tenant registrations
    /// use the default.
    #[arg(long)]
    source: Option<IpAddr>,
    /// Namespace for READs and tenants (default: the first the server announces).
    #[arg(long)]
    namespace: Option<u32>,
    /// Connections that complete one request (HELLO) and then stay idle.
    #[arg(long, default_value_t = 0)]
    idle: usize,
    /// Connections that send 2 bytes of a request header and wait.
    #[arg(long, default_value_t = 0)]
    slowloris: usize,
    /// Replace slowloris connections the server closes (a persistent attacker).
    #[arg(long)]
    reconnect: bool,
    /// Connections that pipeline large READs and never read the answers.
    #[arg(long, default_value_t = 0)]
    non_reader: usize,
    /// READs each non-reader sends.
    #[arg(long, default_value_t = 128)]
    non_reader_requests: u32,
    /// Size of each non-reader READ.
    #[arg(long, default_value = "1m", value_parser = parse_size)]
    non_reader_size: u64,
    /// Receive buffer (SO_RCVBUF) of a non-reader; the kernel doubles it and keeps a minimum.
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    non_reader_receive_buffer: u64,
    /// Best-effort tenants to register (and hold, then unregister).
    #[arg(long, default_value_t = 0)]
    register: usize,
    /// Tenants registered per connection (the server's tenants_per_connection_max bounds it).
    #[arg(long, default_value_t = 16)]
    tenants_per_connection: usize,
    /// Write the registered tenants' handles here, one per line.
    #[arg(long, value_name = "FILE")]
    handles: Option<PathBuf>,
    /// Every this long, a fresh client connects, sends HELLO and a 4 KiB READ, and closes.
    #[arg(long, value_parser = parse_duration)]
    fresh_interval: Option<Duration>,
    /// A fresh client that has no READ answer after this long counts as failed.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    fresh_timeout: Duration,
    /// Most new flood connections per second while setting up (0: as fast as they connect).
    #[arg(long, default_value_t = 2000.0)]
    connect_rate: f64,
    /// Most slowloris replacements per second while holding (default: --connect-rate).
    #[arg(long)]
    reconnect_rate: Option<f64>,
    /// How long to hold everything once it is set up.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Give up when setting up takes longer than this.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    setup_timeout: Duration,
    /// How often idle and slowloris connections are checked for being closed by the server.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    check_interval: Duration,
    /// Create this file once everything is set up.
    #[arg(long, value_name = "FILE")]
    ready_file: Option<PathBuf>,
    /// End the hold early once this file exists (looked for every 100 ms, and between the
    /// paced replacements of a check).
    #[arg(long, value_name = "FILE")]
    stop_file: Option<PathBuf>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress line.
    #[arg(long, short = 'q')]
    quiet: bool,
}

/// What a run did, for people (`print_table`) and scripts (`--json`).
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub server: String,
    pub namespace: u32,
    pub setup_sec: f64,
    pub hold_sec: f64,
    pub idle_requested: usize,
    /// Idle connections whose HELLO was answered.
    pub idle_established: usize,
    /// Idle connections refused or closed before their HELLO was answered.
    pub idle_refused: usize,
    /// Established idle connections the server closed during the hold.
    pub idle_closed_by_server: usize,
    pub slowloris_requested: usize,
    /// Slowloris connections made, replacements included.
    pub slowloris_connects: u64,
    /// Slowloris connections the server closed (eviction, handshake timeout).
    pub slowloris_closed_by_server: u64,
    pub slowloris_open_at_end: usize,
    pub non_readers: usize,
    /// READ bytes the non-readers asked for and never took.
    pub non_reader_bytes_requested: u64,
    pub tenants_registered: usize,
    pub tenant_connections: usize,
    pub fresh: Option<FreshReport>,
}

/// The fresh clients: connect, HELLO answered, READ answered (µs from the connect call).
#[derive(Debug, Default, Serialize)]
pub struct FreshReport {
    pub attempts: u64,
    pub failures: u64,
    pub first_failure: Option<String>,
    pub connect_us: Percentiles,
    pub hello_us: Percentiles,
    pub first_read_us: Percentiles,
}

#[derive(Debug, Default, Serialize, Clone, Copy)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// Percentiles of `samples_ns` (sorted here), in µs; exact (no histogram).
    pub fn of(samples_ns: &mut [u64]) -> Percentiles {
        samples_ns.sort_unstable();
        let at = |quantile: f64| -> f64 {
            if samples_ns.is_empty() {
                return 0.0;
            }
            // Nearest rank: the smallest sample with at least `quantile` of them at or below.
            let rank = (quantile * samples_ns.len() as f64).ceil() as usize;
            samples_ns[rank.clamp(1, samples_ns.len()) - 1] as f64 / 1e3
        };
        Percentiles {
            count: samples_ns.len() as u64,
            p50: at(0.50),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

fn check_args(args: &Args) -> Result<()> {
    for (name, count) in [
        ("--idle", args.idle),
        ("--slowloris", args.slowloris),
        ("--non-reader", args.non_reader),
    ] {
        if count > CONNECTIONS_MAX {
            bail!("{name} must be at most {CONNECTIONS_MAX}");
        }
    }
    if args.register > TENANTS_MAX {
        bail!("--register must be at most {TENANTS_MAX}");
    }
    if args.tenants_per_connection == 0 {
        bail!("--tenants-per-connection must be positive");
    }
    if args.duration > DURATION_MAX || args.setup_timeout > DURATION_MAX {
        bail!("--duration and --setup-timeout must be at most 1 h");
    }
    for rate in [Some(args.connect_rate), args.reconnect_rate]
        .into_iter()
        .flatten()
    {
        if !(0.0..=1e6).contains(&rate) {
            bail!("--connect-rate and --reconnect-rate must be between 0 and 1000000");
        }
    }
    if args.check_interval < Duration::from_millis(10) {
        bail!("--check-interval must be at least 10ms");
    }
    if args
        .fresh_interval
        .is_some_and(|interval| interval < Duration::from_millis(1))
    {
        bail!("--fresh-interval must be at least 1ms");
    }
    if args.fresh_timeout.is_zero() || args.fresh_timeout > Duration::from_secs(60) {
        bail!("--fresh-timeout must be between 0 and 60 s");
    }
    if args.non_reader_size == 0
        || !args.non_reader_size.is_multiple_of(512)
        || args.non_reader_size > u64::from(RESPONSE_BODY_MAX_BYTES)
    {
        bail!("--non-reader-size must be a multiple of 512 up to 1 MiB");
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    check_args(&args)?;
    let address = crate::bench::resolve_server(&args.server)?;
    let report = execute(&args, address)?;
    let mut stdout = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut stdout, &report)?;
        writeln!(stdout)?;
    } else {
        print_table(&mut stdout, &report)?;
    }
    stdout.flush()?;
    Ok(())
}

/// The server's namespace to use and its size.
fn namespace_of(args: &Args, address: SocketAddr) -> Result<(u32, u64)> {
    let client = Client::connect(address).with_context(|| format!("connecting to {address}"))?;
    let capabilities = client.capabilities();
    let id = match args.namespace {
        Some(id) => id,
        None => match capabilities.namespaces.first() {
            Some(namespace) => namespace.id,
            None => bail!("the server at {address} announces no namespace"),
        },
    };
    match capabilities.namespace(id) {
        Some(info) => Ok((id, info.size_bytes)),
        None => bail!("the server has no namespace {id}"),
    }
}

/// Paces new connections at `rate` per second (0: no pacing).
struct Pacer {
    started: Instant,
    interval: Option<Duration>,
    count: u32,
}

impl Pacer {
    fn new(rate: f64) -> Pacer {
        Pacer {
            started: Instant::now(),
            interval: (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate)),
            count: 0,
        }
    }

    fn wait(&mut self) {
        if let Some(interval) = self.interval {
            let due = self.started + interval * self.count;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        self.count = self.count.saturating_add(1);
    }
}

/// A connected TCP socket from `source` (if any), with `receive_buffer` set before the
/// connect so the window the server sees is small from the start.
fn connect(
    address: SocketAddr,
    source: Option<IpAddr>,
    receive_buffer: Option<usize>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    if let Some(bytes) = receive_buffer {
        socket.set_recv_buffer_size(bytes)?;
    }
    if let Some(source) = source {
        socket.bind(&SockAddr::from(SocketAddr::new(source, 0)))?;
    }
    socket.connect_timeout(&SockAddr::from(address), timeout)?;
    socket.set_tcp_nodelay(true)?;
    Ok(TcpStream::from(socket))
}

/// Reads one response (header and body) and returns its header; the body is discarded.
fn read_response(stream: &mut TcpStream, body: &mut Vec<u8>) -> std::io::Result<ResponseHeader> {
    let mut header_bytes = [0u8; RESPONSE_HEADER_SIZE];
    stream.read_exact(&mut header_bytes)?;
    let header = match ResponseHeader::decode(&header_bytes) {
        Ok(Some((header, _))) => header,
        other => {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("bad response header: {other:?}"),
            ));
        }
    };
    if header.length_bytes > RESPONSE_BODY_MAX_BYTES {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("response body of {} bytes", header.length_bytes),
        ));
    }
    body.resize(header.length_bytes as usize, 0);
    stream.read_exact(body)?;
    Ok(header)
}

/// Sends HELLO and waits for its answer (OK expected).
fn hello(stream: &mut TcpStream, body: &mut Vec<u8>) -> std::io::Result<()> {
    let mut request = [0u8; 32 + HELLO_BODY_SIZE];
    request[..32].copy_from_slice(&RequestHeader::hello(1).to_bytes());
    let hello = HelloBody {
        version_max: 1,
        io_priority: 0,
    };
    request[32..].copy_from_slice(&hello.to_bytes());
    stream.write_all(&request)?;
    expect_ok(read_response(stream, body)?)
}

fn expect_ok(header: ResponseHeader) -> std::io::Result<()> {
    match header.status() {
        Ok(status) if status.is_ok() => Ok(()),
        status => Err(std::io::Error::other(format!(
            "request {} answered {status:?}",
            header.request_id
        ))),
    }
}

/// Whether the server closed `stream` (end of stream or an error); data is discarded.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut scratch = [0u8; 4096];
    loop {
        match stream.read(&mut scratch) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(error) if error.kind() == ErrorKind::WouldBlock => return false,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}

/// Everything the flood holds open.
#[derive(Default)]
struct Held {
    idle: Vec<TcpStream>,
    slowloris: Vec<Option<TcpStream>>,
    non_readers: Vec<TcpStream>,
    tenant_clients: Vec<(Client, Vec<u64>)>,
}

fn execute(args: &Args, address: SocketAddr) -> Result<Report> {
    let needs_namespace = args.register > 0 || args.non_reader > 0 || args.fresh_interval.is_some();
    let (namespace, size_bytes) = if needs_namespace {
        namespace_of(args, address)?
    } else {
        (args.namespace.unwrap_or(0), 0)
    };
    let mut report = Report {
        server: address.to_string(),
        namespace,
        idle_requested: args.idle,
        slowloris_requested: args.slowloris,
        ..Report::default()
    };
    let setup_started = Instant::now();
    let setup_deadline = setup_started + args.setup_timeout;
    let over_time = |what: &str| -> Result<()> {
        if Instant::now() > setup_deadline {
            bail!(
                "setting up took longer than {:?} ({what})",
                args.setup_timeout
            );
        }
        Ok(())
    };
    let mut held = Held::default();
    let mut pacer = Pacer::new(args.connect_rate);
    let io_timeout = Duration::from_secs(10);

    // Tenants first: registration needs answers, which a flooded server gives later.
    let mut handles_all = Vec::new();
    let mut remaining = args.register;
    while remaining > 0 {
        over_time("registering tenants")?;
        let mut client = Client::connect_with(address, &ClientOptions::default())
            .with_context(|| format!("connecting to {address} to register tenants"))?;
        let mut handles = Vec::new();
        for _ in 0..remaining.min(args.tenants_per_connection) {
            let handle = client.register_be(namespace).with_context(|| {
                format!(
                    "registering tenant {} of {}",
                    handles_all.len() + 1,
                    args.register
                )
            })?;
            handles.push(handle);
            handles_all.push(handle);
        }
        remaining -= handles.len();
        held.tenant_clients.push((client, handles));
    }
    report.tenants_registered = handles_all.len();
    report.tenant_connections = held.tenant_clients.len();
    if let Some(path) = &args.handles {
        let text: String = handles_all.iter().map(|h| format!("{h}\n")).collect();
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }

    let mut body = Vec::new();
    for index in 0..args.idle {
        if index % 1000 == 0 {
            over_time("connecting idle connections")?;
            progress(args, &format!("idle: {index} of {} connected", args.idle));
        }
        pacer.wait();
        let established = connect(address, args.source, None, io_timeout).and_then(|mut stream| {
            stream.set_read_timeout(Some(io_timeout))?;
            hello(&mut stream, &mut body)?;
            stream.set_nonblocking(true)?;
            Ok(stream)
        });
        match established {
            Ok(stream) => held.idle.push(stream),
            Err(_) => report.idle_refused += 1,
        }
    }
    report.idle_established = held.idle.len();

    for _ in 0..args.non_reader {
        over_time("connecting non-readers")?;
        pacer.wait();
        let receive_buffer = Some(args.non_reader_receive_buffer as usize);
        let mut stream = connect(address, args.source, receive_buffer, io_timeout)
            .context("connecting a non-reader")?;
        let size = args.non_reader_size;
        let slots = (size_bytes / size).max(1);
        let mut requests = Vec::with_capacity(args.non_reader_requests as usize * 32);
        for index in 0..u64::from(args.non_reader_requests) {
            let offset = (index % slots) * size;
            requests.extend_from_slice(
                &RequestHeader::read(index + 1, namespace, offset, size as u32).to_bytes(),
            );
        }
        stream.set_write_timeout(Some(io_timeout))?;
        stream
            .write_all(&requests)
            .context("sending a non-reader's READs")?;
        report.non_reader_bytes_requested += size * u64::from(args.non_reader_requests);
        held.non_readers.push(stream);
    }
    report.non_readers = held.non_readers.len();

    for index in 0..args.slowloris {
        if index % 1000 == 0 {
            over_time("connecting slowloris connections")?;
            progress(
                args,
                &format!("slowloris: {index} of {} connected", args.slowloris),
            );
        }
        pacer.wait();
        held.slowloris
            .push(slowloris_connect(address, args.source, io_timeout));
        report.slowloris_connects += 1;
    }
    report.setup_sec = setup_started.elapsed().as_secs_f64();
    if let Some(path) = &args.ready_file {
        std::fs::write(path, b"ready\n").with_context(|| format!("writing {}", path.display()))?;
    }
    progress(
        args,
        &format!(
            "set up in {:.1} s: {} idle, {} slowloris, {} non-readers, {} tenants; holding for {:?}",
            report.setup_sec,
            held.idle.len(),
            held.slowloris.iter().flatten().count(),
            held.non_readers.len(),
            report.tenants_registered,
            args.duration
        ),
    );

    let hold_started = Instant::now();
    let hold_end = hold_started + args.duration;
    let stop = AtomicBool::new(false);
    let fresh = std::thread::scope(|scope| {
        let prober = args.fresh_interval.map(|interval| {
            let stop = &stop;
            scope.spawn(move || fresh_clients(args, address, namespace, size_bytes, interval, stop))
        });
        hold(args, address, &mut held, &mut report, hold_end);
        stop.store(true, Ordering::Relaxed);
        prober.map(|handle| {
            handle
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("fresh-client thread panicked")))
        })
    });
    report.fresh = fresh.transpose()?;
    report.hold_sec = hold_started.elapsed().as_secs_f64();
    report.slowloris_open_at_end = held.slowloris.iter().flatten().count();
    for (client, handles) in &mut held.tenant_clients {
        for &handle in handles.iter() {
            if let Err(error) = client.unregister(handle) {
                eprintln!("warning: unregistering tenant {handle}: {error}");
                break;
            }
        }
    }
    Ok(report)
}

/// A slowloris connection: connected, 2 bytes of a header sent; `None` if that failed.
fn slowloris_connect(
    address: SocketAddr,
    source: Option<IpAddr>,
    timeout: Duration,
) -> Option<TcpStream> {
    let mut stream = connect(address, source, None, timeout).ok()?;
    stream.write_all(SLOWLORIS_BYTES).ok()?;
    stream.set_nonblocking(true).ok()?;
    Some(stream)
}

/// Holds the connections until `end`: checks which the server closed, replaces slowloris
/// connections with `--reconnect`, prints progress.
fn hold(args: &Args, address: SocketAddr, held: &mut Held, report: &mut Report, end: Instant) {
    let mut pacer = Pacer::new(args.reconnect_rate.unwrap_or(args.connect_rate));
    let mut next_progress = Instant::now() + Duration::from_secs(1);
    let mut next_check = Instant::now() + args.check_interval;
    let io_timeout = Duration::from_secs(1);
    loop {
        let now = Instant::now();
        if now >= end || stop_requested(args) {
            return;
        }
        if now >= next_check {
            check(args, address, held, report, end, &mut pacer, io_timeout);
            next_check = Instant::now() + args.check_interval;
        }
        let now = Instant::now();
        if now >= next_progress {
            next_progress = now + Duration::from_secs(1);
            progress(
                args,
                &format!(
                    "holding: {} idle open ({} closed by the server), {} slowloris open ({} closed, {} connects), {} non-readers",
                    held.idle.len(),
                    report.idle_closed_by_server,
                    held.slowloris.iter().flatten().count(),
                    report.slowloris_closed_by_server,
                    report.slowloris_connects,
                    held.non_readers.len()
                ),
            );
        }
        // The stop file is looked for at least every 100 ms, whatever the check interval.
        let wake = next_check.min(end).min(Instant::now() + STOP_FILE_INTERVAL);
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
}

/// Whether `--stop-file` exists.
fn stop_requested(args: &Args) -> bool {
    args.stop_file.as_ref().is_some_and(|path| path.exists())
}

/// Drops the idle and slowloris connections the server closed, replacing slowloris ones with
/// `--reconnect`.
fn check(
    args: &Args,
    address: SocketAddr,
    held: &mut Held,
    report: &mut Report,
    end: Instant,
    pacer: &mut Pacer,
    io_timeout: Duration,
) {
    let mut index = 0;
    while index < held.idle.len() {
        if closed_by_server(&mut held.idle[index]) {
            held.idle.swap_remove(index);
            report.idle_closed_by_server += 1;
        } else {
            index += 1;
        }
    }
    for slot in held.slowloris.iter_mut() {
        if let Some(stream) = slot
            && closed_by_server(stream)
        {
            *slot = None;
            report.slowloris_closed_by_server += 1;
        }
        // Replacements are paced, so a check can take seconds: the stop file ends it too.
        if slot.is_none() && args.reconnect && Instant::now() < end && !stop_requested(args) {
            pacer.wait();
            *slot = slowloris_connect(address, args.source, io_timeout);
            report.slowloris_connects += 1;
        }
    }
}

/// One fresh client every `interval` until `stop`: connect, HELLO, a 4 KiB READ, close.
fn fresh_clients(
    args: &Args,
    address: SocketAddr,
    namespace: u32,
    size_bytes: u64,
    interval: Duration,
    stop: &AtomicBool,
) -> Result<FreshReport> {
    let mut report = FreshReport::default();
    let (mut connect_ns, mut hello_ns, mut read_ns) = (Vec::new(), Vec::new(), Vec::new());
    let mut body = Vec::new();
    let blocks = (size_bytes / u64::from(FRESH_READ_BYTES)).max(1);
    let started = Instant::now();
    let mut next = started;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if next > now {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        // One probe per interval at most: a probe that overran its interval delays the next.
        next = (next + interval).max(now + interval);
        report.attempts += 1;
        let offset = (report.attempts * 7919 % blocks) * u64::from(FRESH_READ_BYTES);
        let begin = Instant::now();
        let result = (|| -> std::io::Result<(u64, u64, u64)> {
            let mut stream = connect(address, None, None, args.fresh_timeout)?;
            let connected = begin.elapsed().as_nanos() as u64;
            let left = args
                .fresh_timeout
                .saturating_sub(begin.elapsed())
                .max(Duration::from_millis(1));
            stream.set_read_timeout(Some(left))?;
            hello(&mut stream, &mut body)?;
            let answered = begin.elapsed().as_nanos() as u64;
            let header = RequestHeader::read(2, namespace, offset, FRESH_READ_BYTES);
            stream.write_all(&header.to_bytes())?;
            expect_ok(read_response(&mut stream, &mut body)?)?;
            let read = begin.elapsed().as_nanos() as u64;
            if read > args.fresh_timeout.as_nanos() as u64 {
                return Err(std::io::Error::new(ErrorKind::TimedOut, "over the timeout"));
            }
            Ok((connected, answered, read))
        })();
        match result {
            Ok((connected, answered, read)) => {
                connect_ns.push(connected);
                hello_ns.push(answered);
                read_ns.push(read);
            }
            Err(error) => {
                report.failures += 1;
                if report.first_failure.is_none() {
                    report.first_failure = Some(format!(
                        "after {:.1} s: {error}",
                        started.elapsed().as_secs_f64()
                    ));
                }
            }
        }
    }
    report.connect_us = Percentiles::of(&mut connect_ns);
    report.hello_us = Percentiles::of(&mut hello_ns);
    report.first_read_us = Percentiles::of(&mut read_ns);
    Ok(report)
}

fn progress(args: &Args, line: &str) {
    if !args.quiet {
        eprintln!("flood: {line}");
    }
}

fn print_table(out: &mut impl Write, report: &Report) -> std::io::Result<()> {
    writeln!(
        out,
        "# reflex flood: {} namespace {}; set up in {:.1} s, held {:.1} s",
        report.server, report.namespace, report.setup_sec, report.hold_sec
    )?;
    writeln!(
        out,
        "idle:       {} asked, {} established, {} refused, {} closed by the server while held",
        report.idle_requested,
        report.idle_established,
        report.idle_refused,
        report.idle_closed_by_server
    )?;
    writeln!(
        out,
        "slowloris:  {} asked, {} connects, {} closed by the server, {} open at the end",
        report.slowloris_requested,
        report.slowloris_connects,
        report.slowloris_closed_by_server,
        report.slowloris_open_at_end
    )?;
    writeln!(
        out,
        "non-reader: {} connections, {} MiB of READs never taken",
        report.non_readers,
        report.non_reader_bytes_requested >> 20
    )?;
    writeln!(
        out,
        "tenants:    {} registered over {} connections",
        report.tenants_registered, report.tenant_connections
    )?;
    if let Some(fresh) = &report.fresh {
        writeln!(
            out,
            "fresh clients: {} attempts, {} failed{}",
            fresh.attempts,
            fresh.failures,
            fresh
                .first_failure
                .as_deref()
                .map(|f| format!(" (first: {f})"))
                .unwrap_or_default()
        )?;
        for (name, p) in [
            ("connect", fresh.connect_us),
            ("HELLO answered", fresh.hello_us),
            ("4 KiB READ answered", fresh.first_read_us),
        ] {
            writeln!(
                out,
                "  {name:<20} p50 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs  ({} samples)",
                p.p50, p.p99, p.max, p.count
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut samples: Vec<u64> = (1..=100).rev().map(|us| us * 1000).collect();
        let p = Percentiles::of(&mut samples);
        assert_eq!(p.count, 100);
        assert_eq!(p.p50, 50.0);
        assert_eq!(p.p99, 99.0);
        assert_eq!(p.max, 100.0);
        let empty = Percentiles::of(&mut []);
        assert_eq!(empty.count, 0);
        assert_eq!(empty.max, 0.0);
    }
}
