//! Configuration knobs of the scheduler and admission control, with the defaults documented in
//! `docs/QOS.md`. Every bound the scheduler enforces is a named `_max` field here.

use serde::{Deserialize, Serialize};

use crate::calibrator::{CalibratorConfig, CalibratorConfigError};
use crate::fair_queue::FairQueueConfig;
use crate::time::Nanos;
use crate::tokens::{TokenRate, Tokens};

/// Most dataplane threads that can share one device's global bucket (one bit each in a `u64`).
pub const THREADS_MAX: usize = 64;

/// Most tenants one registry or scheduler can hold (the original's `MAX_NVME_FLOW_GROUPS`).
pub const TENANTS_LIMIT: u32 = 1 << 16;

/// Most burst room an LC tenant may have, as time of its own reservation (10 s).
pub const DEFICIT_LIMIT_US_MAX: u64 = 10_000_000;

/// Knobs shared by [`crate::TenantRegistry`] and [`crate::Scheduler`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QosConfig {
    /// How far below zero an LC tenant's balance may fall before it is rate-limited and the
    /// control plane is told (`NEG_LIMIT`), in tokens, for the whole tenant (split between
    /// threads like its rate). Paper: 50 tokens; the original code used 100 × write cost.
    /// The limit in force is the larger of this and `deficit_limit_us` of the tenant's own
    /// reservation.
    pub deficit_limit_tokens: f64,
    /// Burst room: an LC tenant may also run this long of its own reservation ahead of its
    /// tokens before it is rate-limited. A tenant that sends at its reservation as a Poisson
    /// stream has a token balance that walks without drift; a floor of a fixed 50 tokens is
    /// reached within milliseconds and the tenant then waits for its own tokens, while a floor
    /// of 100 ms of its rate is reached rarely (`docs/QOS.md` §2). The price: in any window a
    /// tenant may use this much more than its reservation, which the device's other tenants
    /// feel. 0 (default): the fixed limit alone, as in the paper.
    pub deficit_limit_us: u64,
    /// Share of an LC tenant's balance donated to the global bucket once the balance exceeds
    /// `surplus_rounds` rounds' worth of its rate (paper: 90 %).
    pub donate_percent: u8,
    /// How many of its thread's most recent rounds' worth of tokens an LC tenant may keep
    /// (`POS_LIMIT`; paper: 3).
    pub surplus_rounds: u8,
    /// How far the global bucket may go below zero to lend tokens to LC tenants that are at
    /// their deficit limit; best-effort tenants repay it from their next tokens. 0 turns
    /// lending off (the paper's algorithm exactly). See `docs/QOS.md` for why it exists.
    pub loan_max_tokens: f64,
    /// How much an LC tenant may borrow, as a share of its own rate: it earns a loan allowance
    /// at this percentage of its tokens, capped at its deficit limit, so a tenant that keeps
    /// sending beyond its reservation is held to at most this much more.
    pub loan_percent: u8,
    /// Cap on the global bucket: tokens the device generates in this window. Donations beyond
    /// it are discarded, so a thread that stalls cannot let the bucket grow without bound.
    pub bucket_window_us: u64,
    /// The device is in read-only mode when no write was submitted for this long.
    pub read_only_window_us: u64,
    /// Requests one tenant may have queued on one thread; beyond it enqueue reports
    /// "queue full" and the dataplane stops reading that tenant's connections.
    pub tenant_queue_depth_max: u32,
    /// Requests one thread may have queued over all its tenants (the node pool's size).
    pub thread_queued_requests_max: u32,
    /// Tenants one registry (and each scheduler) can hold.
    pub tenants_max: u32,
    /// The part of a client's p95 that the device never sees (network, client and server
    /// time), in µs: the device rate is taken from the profile at the strictest LC SLO minus
    /// this. A profile calibrated on the device itself needs it for SLOs measured at the
    /// client; 0 (the paper's rule) when the profile was calibrated through the server.
    pub slo_headroom_us: u64,
    /// Online self-calibration of the device rate (`docs/QOS.md` §11).
    pub calibration: CalibratorConfig,
    /// The intra-core fairness stage in front of the device (`docs/FAIRNESS.md`); off by
    /// default.
    pub fairness: FairQueueConfig,
}

impl Default for QosConfig {
    fn default() -> QosConfig {
        QosConfig {
            deficit_limit_tokens: 50.0,
            deficit_limit_us: 0,
            donate_percent: 90,
            surplus_rounds: 3,
            loan_max_tokens: 50.0,
            loan_percent: 25,
            bucket_window_us: 500,
            read_only_window_us: 5_000,
            tenant_queue_depth_max: 1024,
            thread_queued_requests_max: 16_384,
            tenants_max: 16_384,
            slo_headroom_us: 0,
            calibration: CalibratorConfig::default(),
            fairness: FairQueueConfig::default(),
        }
    }
}

impl QosConfig {
    /// The fixed part of every LC tenant's deficit limit (see [`Self::deficit_limit_for`]).
    pub fn deficit_limit(&self) -> Tokens {
        Tokens::from_tokens_f64(self.deficit_limit_tokens)
    }

    /// The deficit limit of an LC tenant whose reservation is `reserved` (millitokens per
    /// second): `deficit_limit_tokens`, or `deficit_limit_us` of the reservation if more.
    pub fn deficit_limit_for(&self, reserved: TokenRate) -> Tokens {
        let burst = u128::from(reserved.millitokens_per_sec()) * u128::from(self.deficit_limit_us)
            / 1_000_000;
        let burst = Tokens(i64::try_from(burst).unwrap_or(i64::MAX));
        self.deficit_limit().max(burst)
    }

    pub fn loan_max(&self) -> Tokens {
        Tokens::from_tokens_f64(self.loan_max_tokens)
    }

    /// The device latency that serves an LC SLO of `latency_us_p95` at the client (at least
    /// 1 µs, so a headroom larger than the SLO reads the profile's strictest row, clamped).
    pub fn device_latency_us(&self, latency_us_p95: u64) -> u64 {
        latency_us_p95.saturating_sub(self.slo_headroom_us).max(1)
    }

    pub fn bucket_window(&self) -> Nanos {
        Nanos::from_micros(self.bucket_window_us)
    }

    pub fn read_only_window(&self) -> Nanos {
        Nanos::from_micros(self.read_only_window_us)
    }

    /// Checks the relations between knobs; the registry and schedulers refuse invalid configs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let finite_non_negative = |field: &'static str, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(ConfigError::Invalid {
                    field,
                    reason: "must be finite and non-negative",
                })
            }
        };
        finite_non_negative("deficit_limit_tokens", self.deficit_limit_tokens)?;
        finite_non_negative("loan_max_tokens", self.loan_max_tokens)?;
        if self.deficit_limit_us > DEFICIT_LIMIT_US_MAX {
            return Err(ConfigError::Invalid {
                field: "deficit_limit_us",
                reason: "must be at most 10 s (10000000)",
            });
        }
        if self.loan_percent > 100 {
            return Err(ConfigError::Invalid {
                field: "loan_percent",
                reason: "must be at most 100",
            });
        }
        if self.donate_percent > 100 {
            return Err(ConfigError::Invalid {
                field: "donate_percent",
                reason: "must be at most 100",
            });
        }
        if self.surplus_rounds == 0 || usize::from(self.surplus_rounds) > ROUND_HISTORY_MAX {
            return Err(ConfigError::Invalid {
                field: "surplus_rounds",
                reason: "must be between 1 and 8",
            });
        }
        if self.tenant_queue_depth_max == 0 || self.thread_queued_requests_max == 0 {
            return Err(ConfigError::Invalid {
                field: "tenant_queue_depth_max",
                reason: "queues must hold at least one request",
            });
        }
        if self.thread_queued_requests_max >= u32::MAX / 2 {
            return Err(ConfigError::Invalid {
                field: "thread_queued_requests_max",
                reason: "too large",
            });
        }
        if self.tenants_max == 0 || self.tenants_max > TENANTS_LIMIT {
            return Err(ConfigError::Invalid {
                field: "tenants_max",
                reason: "must be between 1 and 65536",
            });
        }
        self.calibration.validate().map_err(
            |CalibratorConfigError::Invalid { field, reason }| ConfigError::Invalid {
                field,
                reason,
            },
        )?;
        self.fairness
            .validate()
            .map_err(|error| ConfigError::Invalid {
                field: error.field,
                reason: error.reason,
            })?;
        Ok(())
    }
}

/// Rounds of history a scheduler keeps for `POS_LIMIT` (bounds `surplus_rounds`).
pub(crate) const ROUND_HISTORY_MAX: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("QoS configuration field {field} {reason}")]
    Invalid {
        field: &'static str,
        reason: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_follow_the_paper() {
        let config = QosConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.deficit_limit(), Tokens::from_tokens(50));
        assert_eq!(config.donate_percent, 90);
        assert_eq!(config.surplus_rounds, 3);
        // Burst room (off by default): 100 ms of the reservation when that is more than the
        // fixed limit.
        let rate = TokenRate::from_tokens_per_sec(20_000);
        assert_eq!(config.deficit_limit_for(rate), Tokens::from_tokens(50));
        let room = QosConfig {
            deficit_limit_us: 100_000,
            ..QosConfig::default()
        };
        assert_eq!(room.deficit_limit_for(rate), Tokens::from_tokens(2_000));
        let slow = TokenRate::from_tokens_per_sec(400);
        assert_eq!(room.deficit_limit_for(slow), Tokens::from_tokens(50));
        let too_long = QosConfig {
            deficit_limit_us: DEFICIT_LIMIT_US_MAX + 1,
            ..QosConfig::default()
        };
        assert!(too_long.validate().is_err());
    }

    #[test]
    fn parses_partial_toml_and_rejects_nonsense() {
        let config: QosConfig = toml::from_str("loan_max_tokens = 0.0").unwrap();
        assert_eq!(config.loan_max(), Tokens::ZERO);
        assert_eq!(config.surplus_rounds, 3);
        let bad = QosConfig {
            donate_percent: 150,
            ..QosConfig::default()
        };
        assert!(bad.validate().is_err());
        assert!(toml::from_str::<QosConfig>("no_such_knob = 1").is_err());
    }
}
