//! `reflex pingpong`: the latency floor of remote access on this machine — a raw TCP round
//! trip on loopback, with no storage and no protocol.
//!
//! A built-in echo thread sends back every byte it receives; the client sends a message of N
//! bytes and waits for all N to return, one at a time (queue depth 1), for each size of the
//! list (32 B to 4 KiB by default). Both sockets use TCP_NODELAY; with `--spin` the client
//! busy-polls a non-blocking socket instead of sleeping in `read`, matching `reflex bench
//! --spin`. The remote QD1 latency of `reflex bench` minus the local one is judged against
//! this floor.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::stats::{Latency, LatencySummary};
use super::units::{parse_duration, parse_size};
use super::uring::pin_current_thread;

/// Largest message: the echo buffer size.
const MESSAGE_BYTES_MAX: u64 = 1 << 20;
/// Most round trips per size.
const COUNT_MAX: u64 = 10_000_000;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Message sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,512,1k,2k,4k", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Measured round trips per size.
    #[arg(long, default_value_t = 20_000)]
    count: u64,
    /// Unmeasured round trips before each size.
    #[arg(long, default_value_t = 1_000)]
    warmup_count: u64,
    /// Time limit per size (the row ends early, with fewer round trips).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration_max: Duration,
    /// Pin the echo thread to this CPU.
    #[arg(long)]
    server_cpu: Option<usize>,
    /// Pin the client to this CPU.
    #[arg(long)]
    client_cpu: Option<usize>,
    /// Busy-poll the client socket instead of sleeping in read.
    #[arg(long)]
    spin: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    size_bytes: u64,
    round_trips: u64,
    round_trip: LatencySummary,
}

pub fn run(args: Args) -> Result<()> {
    if args.sizes.is_empty() || args.sizes.iter().any(|s| *s == 0 || *s > MESSAGE_BYTES_MAX) {
        bail!("--sizes must be between 1 byte and {MESSAGE_BYTES_MAX}");
    }
    if args.count == 0 || args.count > COUNT_MAX || args.warmup_count > COUNT_MAX {
        bail!("--count must be between 1 and {COUNT_MAX}");
    }
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the echo server")?;
    let address = listener.local_addr()?;
    let server_cpu = args.server_cpu;
    let echo = std::thread::Builder::new()
        .name("echo".into())
        .spawn(move || echo_server(&listener, server_cpu))?;
    if let Some(cpu) = args.client_cpu {
        pin_current_thread(cpu).with_context(|| format!("pinning the client to CPU {cpu}"))?;
    }
    let mut stream = TcpStream::connect(address).context("connecting to the echo server")?;
    stream.set_nodelay(true)?;
    stream.set_nonblocking(args.spin)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let max_size = args.sizes.iter().copied().max().unwrap_or(1) as usize;
    let message = vec![0x5Au8; max_size];
    let mut reply = vec![0u8; max_size];
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let size = size as usize;
        for _ in 0..args.warmup_count {
            round_trip(&mut stream, &message[..size], &mut reply[..size], args.spin)?;
        }
        let mut latency = Latency::new();
        let started = Instant::now();
        let mut round_trips = 0;
        while round_trips < args.count && started.elapsed() < args.duration_max {
            let sent = Instant::now();
            round_trip(&mut stream, &message[..size], &mut reply[..size], args.spin)?;
            latency.record(sent.elapsed().as_nanos() as u64);
            round_trips += 1;
        }
        rows.push(Row {
            size_bytes: size as u64,
            round_trips,
            round_trip: latency.summary(),
        });
    }
    drop(stream);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;

    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "# reflex pingpong: TCP round trips on loopback, queue depth 1{}",
            if args.spin { ", spinning client" } else { "" }
        )?;
        writeln!(
            out,
            "{:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "bytes", "count", "avg", "p50", "p90", "p95", "p99", "p99.9", "max"
        )?;
        for row in &rows {
            let s = &row.round_trip;
            writeln!(
                out,
                "{:>8} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                row.size_bytes,
                row.round_trips,
                s.avg_us,
                s.p50_us,
                s.p90_us,
                s.p95_us,
                s.p99_us,
                s.p999_us,
                s.max_us
            )?;
        }
        writeln!(out, "(round-trip latencies in µs)")?;
    }
    Ok(())
}

/// Sends `message` and waits until as many bytes came back.
fn round_trip(stream: &mut TcpStream, message: &[u8], reply: &mut [u8], spin: bool) -> Result<()> {
    let mut written = 0;
    while written < message.len() {
        match stream.write(&message[written..]) {
            Ok(0) => bail!("the echo server closed"),
            Ok(count) => written += count,
            Err(error)
                if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) =>
            {
                std::hint::spin_loop();
            }
            Err(error) => return Err(error.into()),
        }
    }
    let mut received = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while received < reply.len() {
        match stream.read(&mut reply[received..]) {
            Ok(0) => bail!("the echo server closed"),
            Ok(count) => received += count,
            Err(error)
                if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) =>
            {
                if !spin || Instant::now() > deadline {
                    bail!("no echo within 10 s");
                }
                std::hint::spin_loop();
            }
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Echoes one connection until the client closes it.
fn echo_server(listener: &TcpListener, cpu: Option<usize>) -> Result<()> {
    if let Some(cpu) = cpu {
        pin_current_thread(cpu).with_context(|| format!("pinning the echo server to CPU {cpu}"))?;
    }
    let (mut stream, _) = listener.accept()?;
    stream.set_nodelay(true)?;
    let mut buffer = vec![0u8; MESSAGE_BYTES_MAX as usize];
    loop {
        let count = match stream.read(&mut buffer) {
            Ok(0) => return Ok(()),
            Ok(count) => count,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) if error.kind() == ErrorKind::ConnectionReset => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        stream.write_all(&buffer[..count])?;
    }
}
