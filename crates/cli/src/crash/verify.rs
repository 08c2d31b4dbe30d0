//! Reading the whole namespace back through a restarted reflexd and checking every block
//! against the model; then a FLUSH, so that what was found is the durable baseline of the
//! next cycle.
//!
//! Why the whole namespace and not only the blocks written: a write that lands on the wrong
//! block is only seen where it landed, possibly a block nobody wrote this cycle.

use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use reflex_client::{ClientOptions, PipelinedClient};

use super::block::BLOCK_SIZE_BYTES;
use super::model::{Model, Verification};
use super::writer::{IO_TIMEOUT, NAMESPACE_ID};

/// Blocks per READ.
const READ_BLOCKS: u64 = 16;
/// READs in flight.
const READ_QUEUE_DEPTH: u64 = 8;

/// Checks every block of `model` through the native protocol at `address`, settles the model
/// with what it found, and FLUSHes.
pub fn verify_and_settle(address: SocketAddr, model: &mut Model) -> Result<Verification> {
    let options = ClientOptions {
        timeout: Some(IO_TIMEOUT),
        io_priority: None,
        reconnect: None,
        tls: None,
    };
    let mut client = PipelinedClient::connect_with(address, &options)
        .with_context(|| format!("verifier connecting to {address}"))?;
    let namespace = client
        .capabilities()
        .namespace(NAMESPACE_ID)
        .context("the server has no namespace 1")?;
    let block_count = model.block_count();
    if namespace.size_bytes < block_count * BLOCK_SIZE_BYTES as u64 {
        bail!(
            "namespace 1 has {} bytes, the model {} blocks",
            namespace.size_bytes,
            block_count
        );
    }
    let queue_depth = READ_QUEUE_DEPTH.min(u64::from(client.window()));
    let mut verification = Verification::default();
    let mut next_block = 0u64;
    let mut in_flight = 0u64;
    while next_block < block_count || in_flight > 0 {
        while in_flight < queue_depth && next_block < block_count {
            let blocks = READ_BLOCKS.min(block_count - next_block);
            // The request id is the first block plus one (0 is HELLO's).
            client.submit_read(
                next_block + 1,
                NAMESPACE_ID,
                next_block * BLOCK_SIZE_BYTES as u64,
                (blocks * BLOCK_SIZE_BYTES as u64) as u32,
            )?;
            next_block += blocks;
            in_flight += 1;
        }
        if !client.wait(None).context("verifier waiting for READs")? {
            bail!("verifier: no READ answered within {IO_TIMEOUT:?}");
        }
        while let Some(completion) = client.reap()? {
            let first_block = completion.request_id - 1;
            let data = completion
                .result()
                .with_context(|| format!("READ at block {first_block}"))?;
            in_flight -= 1;
            for (index, bytes) in data.chunks_exact(BLOCK_SIZE_BYTES).enumerate() {
                let block = first_block + index as u64;
                let found = model.check(block, bytes, &mut verification);
                model.settle(block, found);
            }
        }
    }
    client.submit_flush(1, NAMESPACE_ID)?;
    if !client.wait(None).context("verifier waiting for FLUSH")? {
        bail!("verifier: FLUSH not answered within {IO_TIMEOUT:?}");
    }
    let completion = client.reap()?.context("FLUSH answer")?;
    completion.result().context("verifier FLUSH")?;
    Ok(verification)
}
