//! Emulated-device profiles: the TOML description of a simulated Flash device's geometry and
//! timings, and the lookup of shipped profiles by name (`emu:device-a`) or path
//! (`emu:/path/x.toml`).
//!
//! The timings are chosen so that the device's *cost* is explicit: a 4 KiB write consumes
//! `(program_ns + gc_ns_per_page) / read_ns` reads' worth of die time ([`EmuProfile::write_cost`]),
//! which is what calibration must recover.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::arbiter::{Arbiter, ArbitrationConfig, COMMAND_BYTES_MAX};

/// The shipped profiles, embedded so `emu:NAME` works from any directory.
pub const SHIPPED_PROFILES: [(&str, &str); 2] = [
    (
        "device-a",
        include_str!("../../../../profiles/emu-device-a.toml"),
    ),
    (
        "device-a-small",
        include_str!("../../../../profiles/emu-device-a-small.toml"),
    ),
];

/// Upper bounds that keep a profile's state small and its loops short.
pub const DIES_MAX: u32 = 4096;
pub const QUEUE_DEPTH_MAX: u32 = 65536;
pub const WRITE_BUFFER_PAGES_MAX: u32 = 1 << 22;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmuProfile {
    pub name: String,
    pub channels: u32,
    pub dies_per_channel: u32,
    /// Flash page: the unit a die reads or programs. Commands are split into pages.
    pub page_bytes: u32,
    /// Die time to read one page while the load is mixed.
    pub read_ns: u64,
    /// Die time to read one page while the recent load is read-only.
    pub read_only_read_ns: u64,
    /// The load is read-only once no write was fetched for this long and the buffer is empty.
    pub read_only_window_ns: u64,
    /// Die time to program one page.
    pub program_ns: u64,
    /// Garbage-collection die time per page written, at steady state.
    pub gc_ns_per_page: u64,
    /// Program and GC work run in slices of at most this long (suspend granularity).
    pub background_slice_ns: u64,
    /// A written page's slices reach the dies at random moments within this long after the
    /// write is buffered.
    pub flush_spread_ns: u64,
    /// Controller overhead added to every command.
    pub controller_ns: u64,
    /// Time from fetch to acknowledgement of a write that finds room in the buffer.
    pub write_ack_ns: u64,
    /// Pages of write buffer: writes wait for room when it is full of unprogrammed pages.
    pub write_buffer_pages: u32,
    /// Command slots (device queue depth): commands in flight inside the controller.
    pub queue_depth_max: u32,
    /// Submission queues.
    pub queue_count: u16,
    /// Entries per submission queue; a submit to a full queue is refused.
    pub queue_entries_max: u32,
    #[serde(default)]
    pub arbitration: ArbitrationConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EmuProfileError {
    #[error("emulated-device profile is not valid TOML: {0}")]
    Parse(String),
    #[error("emulated-device profile field {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("no shipped emulated-device profile named {name:?} (shipped: {shipped})")]
    UnknownName { name: String, shipped: String },
    #[error("cannot read emulated-device profile {path}: {reason}")]
    Read { path: String, reason: String },
    #[error(
        "{spec:?} has a drift schedule, which a profile alone cannot carry: open the device (EmuFlash::open) or split it with emu::split_spec"
    )]
    HasSchedule { spec: String },
}

impl EmuProfile {
    pub fn from_toml(text: &str) -> Result<EmuProfile, EmuProfileError> {
        let profile: EmuProfile =
            toml::from_str(text).map_err(|e| EmuProfileError::Parse(e.to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// A shipped profile by name (`device-a`, `device-a-small`, with or without `emu-`), or a
    /// TOML file by path (anything containing `/` or ending in `.toml`). An `emu:` prefix is
    /// accepted and ignored.
    pub fn lookup(spec: &str) -> Result<EmuProfile, EmuProfileError> {
        let spec = spec.trim();
        if spec.starts_with("emu(") {
            return Err(EmuProfileError::HasSchedule {
                spec: spec.to_string(),
            });
        }
        let name = spec.strip_prefix("emu:").unwrap_or(spec);
        if name.contains('/') || name.ends_with(".toml") {
            let text = std::fs::read_to_string(name).map_err(|e| EmuProfileError::Read {
                path: name.to_string(),
                reason: e.to_string(),
            })?;
            return EmuProfile::from_toml(&text);
        }
        let bare = name.strip_prefix("emu-").unwrap_or(name);
        match SHIPPED_PROFILES
            .iter()
            .find(|(shipped, _)| *shipped == bare)
        {
            Some((_, text)) => EmuProfile::from_toml(text),
            None => Err(EmuProfileError::UnknownName {
                name: name.to_string(),
                shipped: SHIPPED_PROFILES
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    pub fn die_count(&self) -> u32 {
        self.channels * self.dies_per_channel
    }

    /// Die time of the background work one written page causes.
    pub fn write_work_ns(&self) -> u64 {
        self.program_ns + self.gc_ns_per_page
    }

    /// Tokens per 4 KiB write the profile is built to have: die time per written page over die
    /// time per page read under mixed load. Calibration should recover this.
    pub fn write_cost(&self) -> f64 {
        self.write_work_ns() as f64 / self.read_ns as f64
    }

    /// Die time per page read under read-only load over that under mixed load.
    pub fn read_only_read_cost(&self) -> f64 {
        self.read_only_read_ns as f64 / self.read_ns as f64
    }

    /// Saturation rate of 4 KiB reads under mixed load (every die busy), in pages per second.
    pub fn mixed_pages_per_sec_max(&self) -> f64 {
        f64::from(self.die_count()) * 1e9 / self.read_ns as f64
    }

    /// Saturation rate of 4 KiB reads under read-only load, in pages per second.
    pub fn read_only_pages_per_sec_max(&self) -> f64 {
        f64::from(self.die_count()) * 1e9 / self.read_only_read_ns as f64
    }

    pub fn validate(&self) -> Result<(), EmuProfileError> {
        let invalid =
            |field: &'static str, reason: String| Err(EmuProfileError::Invalid { field, reason });
        if self.channels == 0 || self.dies_per_channel == 0 {
            return invalid(
                "channels",
                "channels and dies_per_channel must be at least 1".into(),
            );
        }
        if u64::from(self.channels) * u64::from(self.dies_per_channel) > u64::from(DIES_MAX) {
            return invalid("dies_per_channel", format!("at most {DIES_MAX} dies"));
        }
        if self.page_bytes < 512 || !self.page_bytes.is_power_of_two() {
            return invalid(
                "page_bytes",
                "must be a power of two of at least 512".into(),
            );
        }
        for (field, value) in [
            ("read_ns", self.read_ns),
            ("read_only_read_ns", self.read_only_read_ns),
            ("background_slice_ns", self.background_slice_ns),
        ] {
            if value == 0 {
                return invalid(field, "must be positive".into());
            }
        }
        if self.queue_depth_max == 0 || self.queue_depth_max > QUEUE_DEPTH_MAX {
            return invalid("queue_depth_max", format!("must be 1..={QUEUE_DEPTH_MAX}"));
        }
        let pages_per_command_max = COMMAND_BYTES_MAX / self.page_bytes;
        if self.write_buffer_pages < pages_per_command_max
            || self.write_buffer_pages > WRITE_BUFFER_PAGES_MAX
        {
            return invalid(
                "write_buffer_pages",
                format!(
                    "must hold the largest command ({pages_per_command_max} pages) and be at most {WRITE_BUFFER_PAGES_MAX}"
                ),
            );
        }
        Arbiter::<()>::new(&self.arbitration, self.queue_count, self.queue_entries_max).map_err(
            |e| EmuProfileError::Invalid {
                field: "arbitration",
                reason: e.to_string(),
            },
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_parse_and_cost_ten_reads_per_write() {
        for (name, _) in SHIPPED_PROFILES {
            let profile = EmuProfile::lookup(&format!("emu:{name}")).unwrap();
            assert_eq!(profile.write_cost(), 10.0, "{name}");
            assert_eq!(profile.read_only_read_cost(), 0.5, "{name}");
            assert_eq!(EmuProfile::from_toml(&profile.to_toml()).unwrap(), profile);
        }
        let big = EmuProfile::lookup("device-a").unwrap();
        let small = EmuProfile::lookup("emu-device-a-small").unwrap();
        assert_eq!(big.read_only_pages_per_sec_max(), 1e6);
        assert_eq!(small.read_only_pages_per_sec_max(), 1e5);
        assert!(matches!(
            EmuProfile::lookup("emu:nope"),
            Err(EmuProfileError::UnknownName { .. })
        ));
        assert!(matches!(
            EmuProfile::lookup("emu:/nonexistent/x.toml"),
            Err(EmuProfileError::Read { .. })
        ));
    }
}
