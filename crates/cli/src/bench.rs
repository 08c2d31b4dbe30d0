//! `reflex bench` (not yet implemented).

use anyhow::{Result, bail};

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> Result<()> {
    bail!("reflex bench is not implemented yet")
}
