//! Which I/O driver runs the dataplane threads, and starting one on a thread: io_uring
//! (`crate::uring`) where the kernel offers it, epoll (`crate::epoll`) where it does not
//! (container seccomp profiles, kernels with io_uring disabled, qemu-user). Both drive the
//! same [`Dataplane`] under the same contract, from the same [`DriverSetup`], and return the
//! same [`CoreStats`]; that the second one exists is what keeps the dataplane I/O-agnostic.

use reflex_qos::Nanos;
use std::fs::File;
use std::io::Write;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;
use std::time::Instant;

use reflex_dataplane::control::Wake;
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::{CoreStats, Dataplane, DataplaneSetup};
use reflex_flash::Notify;

use crate::config::DriverChoice;
use crate::epoll::EpollDriver;
use crate::uring::{MissingFeature, Ring, UringDriver};

/// A test switch: when this environment variable is set (and not `0`), the io_uring probe
/// reports io_uring unavailable, so tests can exercise the fallback and the refusal on a
/// machine that has io_uring. Not meant for operators (`driver = "epoll"` is).
pub const NO_IO_URING_ENV: &str = "REFLEX_TEST_NO_IO_URING";

/// The driver the threads run, once the configured choice has been resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Uring,
    Epoll,
}

impl Driver {
    pub fn name(self) -> &'static str {
        match self {
            Driver::Uring => "io_uring",
            Driver::Epoll => "epoll",
        }
    }

    /// Resolves `choice`: `auto` probes io_uring and falls back to epoll with one warning
    /// naming the reason; `uring` fails with the reason when the probe does.
    pub fn select(choice: DriverChoice) -> Result<Driver, MissingFeature> {
        match choice {
            DriverChoice::Epoll => Ok(Driver::Epoll),
            DriverChoice::Uring => probe_uring().map(|()| Driver::Uring),
            DriverChoice::Auto => match probe_uring() {
                Ok(()) => Ok(Driver::Uring),
                Err(reason) => {
                    tracing::warn!(
                        %reason,
                        "using the epoll driver instead of io_uring (driver = \"auto\")"
                    );
                    Ok(Driver::Epoll)
                }
            },
        }
    }
}

/// [`Ring::probe`], unless the test switch [`NO_IO_URING_ENV`] is set.
fn probe_uring() -> Result<(), MissingFeature> {
    if std::env::var_os(NO_IO_URING_ENV).is_some_and(|value| !value.is_empty() && value != "0") {
        return Err(MissingFeature::Setup(format!(
            "switched off by the test switch {NO_IO_URING_ENV}"
        )));
    }
    Ring::probe()
}

/// What the driver of one thread needs besides the dataplane.
pub struct DriverSetup {
    pub listeners: Vec<TcpListener>,
    /// The namespaces whose devices the thread opens its queues on.
    pub namespaces: Arc<NamespaceSet>,
    pub poll: bool,
    /// io_uring only: register the arena as a fixed buffer.
    pub register_buffers: bool,
    pub shutdown: Arc<AtomicBool>,
    pub waker: Arc<File>,
    pub clock_origin: Instant,
    /// io_uring only: the completion queue's size.
    pub cq_entries: u32,
    /// The longest a blocking thread spins before a deadline (0: never spins).
    pub spin_before_deadline_max: Nanos,
    /// The queues to and from the other threads, when inter-core migration is on.
    pub migration: Option<crate::migration::MigrationLinks>,
    /// Thread scaling's requests and connection queues, when the server has several threads.
    pub scaling: Option<crate::scaling::ThreadScaling>,
    /// The CPU this thread is pinned to (`dataplane_cpus`), before it allocates its arena so
    /// that the arena's pages come from that CPU's memory node.
    pub cpu: Option<usize>,
}

/// Wakes a sleeping dataplane thread through its eventfd: for the control plane's messages
/// and shutdown ([`Wake`]) and for device completions from another thread ([`Notify`]).
pub struct EventfdWaker(pub Arc<File>);

impl EventfdWaker {
    pub fn wake_eventfd(&self) {
        // An eventfd write only fails when the counter would overflow, i.e. when the thread
        // has been woken already.
        let _ = (&*self.0).write(&1u64.to_ne_bytes());
    }
}

impl Wake for EventfdWaker {
    fn wake(&self) {
        self.wake_eventfd();
    }
}

impl Notify for EventfdWaker {
    fn notify(&self) {
        self.wake_eventfd();
    }
}

/// Tells `Server::start` whether a thread is running: `Ok(registered buffers)` or why not.
pub type Ready = Sender<(usize, Result<bool, String>)>;

/// Starts dataplane thread `thread_index` on `driver`: it builds the dataplane and the driver,
/// reports through `ready`, and runs until shutdown.
pub fn spawn_driver(
    driver: Driver,
    dataplane_setup: DataplaneSetup,
    driver_setup: DriverSetup,
    ready: Ready,
) -> std::io::Result<JoinHandle<Result<CoreStats, String>>> {
    let thread_index = dataplane_setup.thread_index;
    std::thread::Builder::new()
        .name(format!("reflex-dp-{thread_index}"))
        .spawn(move || {
            if let Some(cpu) = driver_setup.cpu
                && let Err(errno) = crate::sys::pin_current_thread(cpu)
            {
                let error = std::io::Error::from_raw_os_error(errno);
                return refuse(
                    &ready,
                    thread_index,
                    format!("cannot pin it to CPU {cpu} (dataplane_cpus): {error}"),
                );
            }
            let dataplane = match Dataplane::new(dataplane_setup) {
                Ok(dataplane) => dataplane,
                Err(e) => return refuse(&ready, thread_index, e.to_string()),
            };
            match driver {
                Driver::Uring => match UringDriver::new(dataplane, driver_setup) {
                    Ok(uring) => {
                        let _ = ready.send((thread_index, Ok(uring.registered_buffers())));
                        drop(ready);
                        uring
                            .run()
                            .map_err(|e| format!("io_uring_enter failed: {e}"))
                    }
                    Err(e) => refuse(&ready, thread_index, format!("io_uring setup failed: {e}")),
                },
                Driver::Epoll => match EpollDriver::new(dataplane, driver_setup) {
                    Ok(epoll) => {
                        let _ = ready.send((thread_index, Ok(false)));
                        drop(ready);
                        epoll.run().map_err(|e| format!("epoll_wait failed: {e}"))
                    }
                    Err(e) => refuse(&ready, thread_index, format!("epoll setup failed: {e}")),
                },
            }
        })
}

fn refuse(ready: &Ready, thread_index: usize, message: String) -> Result<CoreStats, String> {
    let _ = ready.send((thread_index, Err(message.clone())));
    Err(message)
}
