//! `dataplane_cpus`: each dataplane thread runs on the CPU the operator gave it, the rest of
//! the process does not, and a CPU the kernel refuses stops the start with a reason.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::sync::Mutex;

use common::{config, namespace};
use reflex_server::Server;

/// One server at a time: threads are found by name, and another test's refused thread may
/// briefly carry the same one.
static ONE_SERVER: Mutex<()> = Mutex::new(());

/// The CPUs this test process may run on, lowest first.
fn allowed_cpus() -> Vec<usize> {
    let status = fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    cpu_list(field(&status, "Cpus_allowed_list:"))
        .into_iter()
        .collect()
}

fn field<'a>(status: &'a str, name: &str) -> &'a str {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .unwrap_or_else(|| panic!("{name} missing from a status file"))
        .trim()
}

/// Parses a kernel CPU list such as `0-2,5`.
fn cpu_list(list: &str) -> BTreeSet<usize> {
    let mut cpus = BTreeSet::new();
    for part in list.split(',').filter(|part| !part.is_empty()) {
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last): (usize, usize) = (first.parse().unwrap(), last.parse().unwrap());
                cpus.extend(first..=last);
            }
            None => {
                cpus.insert(part.parse().unwrap());
            }
        }
    }
    cpus
}

/// The CPUs each thread of this process named `name` may run on.
fn threads_named(name: &str) -> Vec<BTreeSet<usize>> {
    let mut found = Vec::new();
    for task in fs::read_dir("/proc/self/task").expect("list /proc/self/task") {
        let path = task.expect("task entry").path();
        let Ok(comm) = fs::read_to_string(path.join("comm")) else {
            continue; // the thread exited
        };
        if comm.trim() != name {
            continue;
        }
        let Ok(status) = fs::read_to_string(path.join("status")) else {
            continue;
        };
        found.push(cpu_list(field(&status, "Cpus_allowed_list:")));
    }
    found
}

#[test]
fn each_dataplane_thread_runs_on_its_own_cpu_and_nothing_else_does() {
    let _one = ONE_SERVER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let allowed = allowed_cpus();
    // Two threads on the last two CPUs, in reverse order, where the machine has two.
    let cpus: Vec<usize> = allowed.iter().rev().take(2).copied().collect();
    let mut server_config = config(vec![namespace(1, "mem:16M", None)]);
    server_config.threads = cpus.len();
    server_config.dataplane_cpus = cpus.clone();
    let server = Server::start(server_config).unwrap_or_else(|e| panic!("server start: {e}"));
    for (index, cpu) in cpus.iter().enumerate() {
        let threads = threads_named(&format!("reflex-dp-{index}"));
        assert_eq!(threads.len(), 1, "one dataplane thread {index}");
        assert_eq!(threads[0], BTreeSet::from([*cpu]), "thread {index} pinned");
    }
    // The thread that started the server keeps every CPU it had.
    assert_eq!(allowed_cpus(), allowed);
    // And the server serves.
    let mut client = reflex_client::Client::connect(server.native_addr()).expect("connect");
    let data = common::pattern(7, 4096);
    client.write(1, 4096, &data).expect("write");
    let mut back = vec![0u8; 4096];
    client.read(1, 4096, &mut back).expect("read");
    assert!(back == data);
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn a_cpu_the_kernel_refuses_stops_the_start_with_a_reason() {
    let _one = ONE_SERVER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for cpu in [1023, 1 << 20] {
        let mut server_config = config(vec![namespace(1, "mem:16M", None)]);
        server_config.threads = 1;
        server_config.dataplane_cpus = vec![cpu];
        let error = match Server::start(server_config) {
            Ok(server) => {
                let _ = server.shutdown();
                panic!("a server pinned to CPU {cpu} started");
            }
            Err(error) => error.to_string(),
        };
        assert!(
            error.contains(&format!("CPU {cpu}")) && error.contains("dataplane_cpus"),
            "{error}"
        );
        // The refused thread ends by itself (bounded wait: the next test finds threads by name).
        let started = std::time::Instant::now();
        while !threads_named("reflex-dp-0").is_empty() {
            assert!(
                started.elapsed().as_secs() < 10,
                "the refused thread still runs"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
