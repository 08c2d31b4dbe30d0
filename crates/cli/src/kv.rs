//! `reflex kv`: one key-value request to reflexd's KV port from the shell (`docs/KV.md`), for
//! operators and scripts: `put KEY VALUE`, `get KEY` (the value on stdout, exit status 2 when
//! absent), `delete KEY` (exit status 2 when absent), `flush`. Keys and values are taken as
//! given (UTF-8 from the command line); `put --value-file PATH` stores a file's bytes.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use reflex_client::kv::KvClient;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The KV port's address.
    #[arg(long, short = 's', default_value = "127.0.0.1:7077")]
    server: String,
    #[command(subcommand)]
    request: KvRequest,
}

#[derive(clap::Subcommand, Debug)]
enum KvRequest {
    /// Store VALUE (or the bytes of --value-file) under KEY.
    Put {
        key: String,
        #[arg(required_unless_present = "value_file")]
        value: Option<String>,
        #[arg(long, conflicts_with = "value")]
        value_file: Option<PathBuf>,
    },
    /// Print KEY's value (exit status 2 when absent).
    Get { key: String },
    /// Remove KEY (exit status 2 when absent).
    Delete { key: String },
    /// Make every earlier PUT and DELETE durable.
    Flush,
}

/// Exit status of a GET or DELETE of an absent key.
const EXIT_NOT_FOUND: i32 = 2;

pub fn run(args: Args) -> Result<()> {
    let address = crate::bench::resolve_server(&args.server)?;
    let mut client =
        KvClient::connect(address).with_context(|| format!("connecting to {address}"))?;
    match args.request {
        KvRequest::Put {
            key,
            value,
            value_file,
        } => {
            let value = match (value, value_file) {
                (Some(value), _) => value.into_bytes(),
                (None, Some(path)) => {
                    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?
                }
                (None, None) => Vec::new(),
            };
            client.put(key.as_bytes(), &value)?;
        }
        KvRequest::Get { key } => match client.get(key.as_bytes())? {
            Some(value) => std::io::stdout().write_all(&value)?,
            None => std::process::exit(EXIT_NOT_FOUND),
        },
        KvRequest::Delete { key } => {
            if !client.delete(key.as_bytes())? {
                std::process::exit(EXIT_NOT_FOUND);
            }
        }
        KvRequest::Flush => client.flush()?,
    }
    Ok(())
}
