//! `limit-server`: the yardstick. Answers original-ReFlex-protocol reads from memory with one
//! io_uring thread doing as little as the protocol allows (see `reflex_limit::server`).
//! Writes are answered after their payload is discarded. Stops on SIGINT or SIGTERM (a second
//! thread waits for them; it never runs otherwise).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use anyhow::Context;
use clap::Parser;
use reflex_limit::server::{CONNECTIONS_MAX_DEFAULT, CONNECTIONS_MAX_LIMIT, Server, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    name = "limit-server",
    about = "Minimal one-thread io_uring server for the original ReFlex protocol: answers 4 KiB \
             (any size up to 1 MiB) reads from memory, the yardstick for reflexd"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    listen: IpAddr,
    /// Port (0 picks a free one, printed at start).
    #[arg(long, default_value_t = 1234)]
    port: u16,
    /// Spin on the completion queue instead of sleeping in io_uring_enter.
    #[arg(long)]
    poll: bool,
    /// Open connections at most; more are accepted and closed at once.
    #[arg(long, default_value_t = CONNECTIONS_MAX_DEFAULT as u64,
          value_parser = clap::value_parser!(u64).range(1..=CONNECTIONS_MAX_LIMIT as u64))]
    connections_max: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = ServerConfig {
        connections_max: args.connections_max as usize,
        poll: args.poll,
    };
    let address = SocketAddr::new(args.listen, args.port);
    let server = Server::bind(address, config).with_context(|| format!("binding {address}"))?;
    // A thread that waits for SIGINT/SIGTERM and stops the loop: the loop's own thread sleeps
    // in io_uring_enter, where valgrind would never deliver the signal to it.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ])
    .context("installing the SIGINT/SIGTERM handler")?;
    let stop = server.stop_handle();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if signals.forever().next().is_some() {
                stop.stop();
            }
        })
        .context("starting the signal thread")?;
    eprintln!(
        "limit-server: listening on {} ({}), at most {} connections",
        server.local_addr()?,
        if args.poll { "polling" } else { "blocking" },
        args.connections_max
    );
    let stats = server.run().context("serving")?;
    eprintln!(
        "limit-server: stopped after {} responses on {} connections ({} refused as over the \
         limit, {} closed for bad framing, {} failed), {} loop iterations",
        stats.responses_sent,
        stats.connections_accepted,
        stats.connections_refused,
        stats.connections_refused_framing,
        stats.connections_failed,
        stats.loop_iterations
    );
    Ok(())
}
