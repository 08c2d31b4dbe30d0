//! The epoll driver: the loop that runs a [`reflex_dataplane::Dataplane`] over non-blocking
//! sockets and one epoll instance per thread (`driver`), for kernels and sandboxes without
//! io_uring, and the raw system calls it needs (`sys`, the only part with `unsafe` besides
//! the one call that opens the devices' ring-less queues, whose buffer contract is the
//! driver's).

mod driver;
mod sys;

pub use driver::EpollDriver;
