//! Runs the client's NVMe/TCP initiator against any NVMe/TCP target (reflexd, SPDK's
//! `nvmf_tgt`): attach, Identify, then verified writes and reads of 4 KiB (in the capsule),
//! 64 KiB and 1 MiB (R2T/H2CData), flush, with digests off and then on. Prints what it found
//! and exits non-zero on the first failure. `docs/NVME-TCP.md` records runs.
//!
//! Usage: `cargo run --release -p reflex-client --example nvme_tcp_check -- ADDRESS:PORT NQN [NSID]`
//!
//! TLS (TP 8011): `NVME_TLS_PSK_FILE=FILE` (a key in the interchange format,
//! `NVMeTLSkey-1:01:...:`) runs every queue over TLS 1.3 with that key; `NVME_HOST_NQN=NQN`
//! sets the host NQN (the one the target lists the key under); `NVME_TLS_IDENTITY=1` offers
//! TP 8018's identity form (`NVMe1R0x ... <PSK digest>`) instead of TP 8011's.

use std::net::SocketAddr;
use std::process::ExitCode;

use reflex_client::nvme_tcp::{NvmeTcpController, NvmeTcpError, NvmeTcpOptions};
use reflex_proto::nvme_tcp::Digests;
use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, IdentityForm};

const HOST_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:reflex-nvme-tcp-check";

fn run(
    address: SocketAddr,
    nqn: &str,
    nsid: u32,
    digests: Digests,
    tls: Option<&ConfiguredPsk>,
) -> Result<(), NvmeTcpError> {
    let host_nqn = std::env::var("NVME_HOST_NQN").unwrap_or_else(|_| HOST_NQN.to_string());
    let mut options = NvmeTcpOptions::new(&host_nqn, nqn).with_digests(digests);
    if let Some(psk) = tls {
        options = options.with_tls_psk(psk.clone());
        if std::env::var("NVME_TLS_IDENTITY").is_ok_and(|form| form == "1") {
            options = options.with_tls_identity_form(IdentityForm::Version1);
        }
    }
    let mut controller = NvmeTcpController::attach(address, options, 2)?;
    let identify = controller.identify().clone();
    println!(
        "digests {digests:?}: cntlid {} model {:?} serial {:?} mdts {} ioccsz {} B nn {} subnqn {}",
        controller.cntlid(),
        identify.model,
        identify.serial,
        identify.mdts,
        identify.ioccsz * 16,
        identify.nn,
        identify.subsystem_nqn
    );
    let namespaces = controller.active_namespaces()?;
    let info = controller.namespace(nsid)?;
    println!(
        "  active namespaces {namespaces:?}; namespace {nsid}: {} blocks of {} B",
        info.size_blocks, info.block_bytes
    );
    let mut queue = controller.connect_io_queue()?;
    println!(
        "  I/O queue {} connected, MAXH2CDATA {}, TLS {:?}",
        queue.qid(),
        queue.maxh2cdata(),
        queue.tls_session()
    );
    let block_bytes = info.block_bytes;
    let mut slba = 0u64;
    let mut lengths = vec![4096usize, 64 << 10];
    // 1 MiB when the target's MDTS allows it (0: no limit).
    if identify.mdts == 0 || (4096usize << identify.mdts) >= 1 << 20 {
        lengths.push(1 << 20);
    }
    for length in lengths {
        let data: Vec<u8> = (0..length)
            .map(|index| (index as u64 * 13 + slba) as u8)
            .collect();
        queue.write(nsid, slba, &data, block_bytes, false)?;
        let blocks = (length / block_bytes as usize) as u32;
        let read = queue.read(nsid, slba, blocks, block_bytes)?;
        if read != data {
            return Err(NvmeTcpError::Unexpected(
                "read back differs from what was written",
            ));
        }
        println!("  {length} B written and read back, equal");
        slba += u64::from(blocks);
    }
    queue.flush(nsid)?;
    println!("  flush ok");
    controller.keep_alive()?;
    controller.shutdown()?;
    println!("  shutdown handshake ok");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(address), Some(nqn)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: nvme_tcp_check ADDRESS:PORT NQN [NSID]");
        return ExitCode::from(2);
    };
    let Ok(address) = address.parse::<SocketAddr>() else {
        eprintln!("not an address: {address}");
        return ExitCode::from(2);
    };
    let nsid = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(1);
    let tls = match std::env::var("NVME_TLS_PSK_FILE") {
        Err(_) => None,
        Ok(path) => match std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| ConfiguredPsk::parse_interchange(&text).map_err(|e| e.to_string()))
        {
            Ok(psk) => Some(psk),
            Err(error) => {
                eprintln!("{path}: {error}");
                return ExitCode::from(2);
            }
        },
    };
    if tls.is_some() {
        println!("TLS 1.3 with a pre-shared key on every queue");
    }
    for digests in [Digests::NONE, Digests::BOTH] {
        if let Err(error) = run(address, nqn, nsid, digests, tls.as_ref()) {
            eprintln!("FAILED with digests {digests:?}: {error}");
            return ExitCode::FAILURE;
        }
    }
    println!("all checks passed");
    ExitCode::SUCCESS
}
