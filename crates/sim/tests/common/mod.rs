//! Loading and running the shipped scenarios from the integration tests.

use std::path::PathBuf;

use reflex_sim::{LoadedScenario, PointReport, RunOptions, run_scenario, scenario};

pub fn scenario_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scenarios")
        .join(format!("{name}.toml"))
}

pub fn load(name: &str) -> LoadedScenario {
    let path = scenario_path(name);
    scenario::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The one point of scenario `name` (not a sweep), run with `seed`.
pub fn run(name: &str, seed: u64) -> PointReport {
    let options = RunOptions {
        seed: Some(seed),
        ..RunOptions::default()
    };
    let report = run_scenario(&load(name), &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(report.points.len(), 1, "{name} is not a sweep");
    report.points[0].1.clone()
}
