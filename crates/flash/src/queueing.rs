//! Queueing model of NVMe weighted arbitration (Gugnani, Lu, Panda: eqs. 1–3), for SLA
//! provisioning: what throughput and worst-case latency a priority class gets, from the class
//! weights, how busy the other classes are, and three device numbers (throughput γ,
//! parallelism p, mean service time a).
//!
//! - Eq. 1, minimum throughput: γ_c ≥ w_c / (h + m + l) · γ.
//! - Eq. 2, expected throughput: γ_c = min(λ_c, w_c / (w_c + Σ_{k≠c} ρ_k w_k) · γ).
//! - Eq. 3, worst-case latency: t_max = q / w_c · (w_c + Σ_{k≠c} ρ_k w_k) / p · a.
//!
//! ρ_k is the share of its per-round quota class k fills (1 = always backlogged, 0 = idle).
//! The paper writes the equations for the high class; they hold for any class by symmetry.
//! Weights are commands per round for WRR (all classes with the same mean request size) or
//! bytes per round for DRR (then γ is bandwidth, or commands/s when all sizes are equal).
//! Eq. 3 is Little's law for a class that keeps q commands outstanding: with γ = p / a it
//! equals q / γ_c, which is what the emulated device is tested against.

use serde::{Deserialize, Serialize};

use crate::emu::PriorityClass;

/// Weights and utilisations of the high, medium and low classes, in that order.
pub const CLASSES: [PriorityClass; 3] = [
    PriorityClass::High,
    PriorityClass::Medium,
    PriorityClass::Low,
];

/// Inputs of the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelInput {
    /// High, medium, low weights (> 0).
    pub weights: [f64; 3],
    /// High, medium, low utilisations ρ in 0..=1.
    pub utilisations: [f64; 3],
    /// γ: device throughput when saturated (commands/s, or bytes/s for DRR with mixed sizes).
    pub device_throughput: f64,
    /// q: commands a class keeps outstanding.
    pub queue_depth: f64,
    /// p: commands the device serves in parallel.
    pub parallelism: f64,
    /// a: mean service time of one command, in µs.
    pub service_us: f64,
}

/// The model's answer for one class.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClassPrediction {
    pub class: PriorityClass,
    pub weight: f64,
    pub utilisation: f64,
    /// Eq. 1.
    pub throughput_min: f64,
    /// Eq. 2 for a backlogged class (ρ = 1); for a class filling ρ < 1 of its quota, the
    /// share that fill gives it: ρ_c w_c / Σ_k ρ_k w_k · γ.
    pub throughput_expected: f64,
    /// Eq. 3, in µs.
    pub latency_us_max: f64,
}

fn class_index(class: PriorityClass) -> Option<usize> {
    CLASSES.iter().position(|&c| c == class)
}

/// Σ over the other classes of ρ_k · w_k, plus the class's own weight.
fn round_size(weights: &[f64; 3], utilisations: &[f64; 3], index: usize) -> f64 {
    (0..3)
        .map(|k| {
            if k == index {
                weights[k]
            } else {
                utilisations[k].clamp(0.0, 1.0) * weights[k]
            }
        })
        .sum()
}

/// Eq. 1: the throughput class `class` gets at least, whatever the others do.
/// `None` for the urgent class, which the model does not cover (it is served strictly first).
pub fn minimum_throughput(
    weights: &[f64; 3],
    class: PriorityClass,
    device_throughput: f64,
) -> Option<f64> {
    let index = class_index(class)?;
    Some(weights[index] / weights.iter().sum::<f64>() * device_throughput)
}

/// Eq. 2: the throughput class `class` gets when it offers `arrival_rate` (λ; infinite for a
/// backlogged class) and the other classes fill `utilisations` of their quota.
pub fn expected_throughput(
    weights: &[f64; 3],
    utilisations: &[f64; 3],
    class: PriorityClass,
    arrival_rate: f64,
    device_throughput: f64,
) -> Option<f64> {
    let index = class_index(class)?;
    let share = weights[index] / round_size(weights, utilisations, index);
    Some(arrival_rate.min(share * device_throughput))
}

/// Eq. 3: the worst-case latency of class `class` in µs, when it keeps `queue_depth` commands
/// outstanding on a device with `parallelism` and mean service time `service_us`.
pub fn worst_latency_us(
    weights: &[f64; 3],
    utilisations: &[f64; 3],
    class: PriorityClass,
    queue_depth: f64,
    parallelism: f64,
    service_us: f64,
) -> Option<f64> {
    let index = class_index(class)?;
    Some(
        queue_depth / weights[index] * round_size(weights, utilisations, index) / parallelism
            * service_us,
    )
}

/// The utilisations that offered rates imply (rates `None` = backlogged, ρ = 1): a class
/// offering λ_k fills ρ_k = λ_k · D / (γ · w_k) of its quota, where D = Σ ρ_j w_j is the work of
/// one round; solved by fixed-point iteration, a class whose ρ would exceed 1 is backlogged.
pub fn utilisations_from_rates(
    weights: &[f64; 3],
    rates: &[Option<f64>; 3],
    device_throughput: f64,
) -> [f64; 3] {
    let mut saturated = rates.map(|r| r.is_none());
    let mut utilisations = [1.0; 3];
    // At most one class becomes saturated per pass.
    for _ in 0..4 {
        let backlogged_weight: f64 = (0..3).filter(|&k| saturated[k]).map(|k| weights[k]).sum();
        let offered_share: f64 = (0..3)
            .filter(|&k| !saturated[k])
            .map(|k| rates[k].unwrap_or(0.0) / device_throughput)
            .sum();
        let round = if offered_share < 1.0 && backlogged_weight > 0.0 {
            backlogged_weight / (1.0 - offered_share)
        } else {
            // Nobody backlogged: the device is not saturated; ρ relative to the full round.
            weights.iter().sum()
        };
        let mut changed = false;
        for k in 0..3 {
            if saturated[k] {
                utilisations[k] = 1.0;
                continue;
            }
            let rho = rates[k].unwrap_or(0.0) / device_throughput * round / weights[k];
            if rho >= 1.0 {
                saturated[k] = true;
                changed = true;
            }
            utilisations[k] = rho.min(1.0);
        }
        if !changed {
            break;
        }
    }
    utilisations
}

/// All three classes at once (what `reflex model` prints).
pub fn predict(input: &ModelInput) -> Vec<ClassPrediction> {
    CLASSES
        .iter()
        .enumerate()
        .map(|(index, &class)| {
            let w = &input.weights;
            let u = &input.utilisations;
            ClassPrediction {
                class,
                weight: w[index],
                utilisation: u[index],
                throughput_min: minimum_throughput(w, class, input.device_throughput)
                    .unwrap_or(0.0),
                throughput_expected: if u[index] >= 1.0 {
                    expected_throughput(w, u, class, f64::INFINITY, input.device_throughput)
                        .unwrap_or(0.0)
                } else {
                    let round: f64 = (0..3).map(|k| u[k].clamp(0.0, 1.0) * w[k]).sum();
                    u[index].max(0.0) * w[index] / round * input.device_throughput
                },
                latency_us_max: worst_latency_us(
                    w,
                    u,
                    class,
                    input.queue_depth,
                    input.parallelism,
                    input.service_us,
                )
                .unwrap_or(0.0),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEIGHTS: [f64; 3] = [32.0, 16.0, 8.0];

    #[test]
    fn equations_match_the_paper() {
        let gamma = 240_000.0;
        assert_eq!(
            minimum_throughput(&WEIGHTS, PriorityClass::High, gamma),
            Some(32.0 / 56.0 * gamma)
        );
        // ρ_m = ρ_l = 0: the high class gets the whole device.
        let idle = [1.0, 0.0, 0.0];
        assert_eq!(
            expected_throughput(&WEIGHTS, &idle, PriorityClass::High, f64::INFINITY, gamma),
            Some(gamma)
        );
        assert_eq!(
            expected_throughput(&WEIGHTS, &idle, PriorityClass::High, 1000.0, gamma),
            Some(1000.0)
        );
        // Eq. 3 with a/p = 1/γ is Little's law: q / γ_h.
        let busy = [1.0, 1.0, 0.5];
        let gamma_h =
            expected_throughput(&WEIGHTS, &busy, PriorityClass::High, f64::INFINITY, gamma)
                .unwrap();
        let latency =
            worst_latency_us(&WEIGHTS, &busy, PriorityClass::High, 64.0, 1.0, 1e6 / gamma).unwrap();
        assert!((latency - 64.0 / gamma_h * 1e6).abs() < 1e-6);
        assert_eq!(
            minimum_throughput(&WEIGHTS, PriorityClass::Urgent, gamma),
            None
        );
    }

    #[test]
    fn utilisations_are_consistent_with_throughput() {
        let gamma = 100_000.0;
        // High and medium backlogged, low offers 5000/s.
        let rho = utilisations_from_rates(&WEIGHTS, &[None, None, Some(5000.0)], gamma);
        assert_eq!(&rho[..2], &[1.0, 1.0]);
        let utilisations = [1.0, 1.0, rho[2]];
        let high = expected_throughput(
            &WEIGHTS,
            &utilisations,
            PriorityClass::High,
            f64::INFINITY,
            gamma,
        )
        .unwrap();
        let medium = expected_throughput(
            &WEIGHTS,
            &utilisations,
            PriorityClass::Medium,
            f64::INFINITY,
            gamma,
        )
        .unwrap();
        assert!(
            (high + medium + 5000.0 - gamma).abs() < 1e-6,
            "{high} + {medium}"
        );
        assert!((high / medium - 2.0).abs() < 1e-9);
        // A low class offering more than its quota allows is backlogged.
        let rho = utilisations_from_rates(&WEIGHTS, &[None, None, Some(90_000.0)], gamma);
        assert_eq!(rho, [1.0, 1.0, 1.0]);
    }
}
