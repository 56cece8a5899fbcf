//! A tiny run of every bench scenario, so the bench cannot rot. Not a benchmark: no figures are
//! asserted, only that each scenario runs to the end and reports a number.

use system_tests::bin_path;

#[test]
fn every_bench_scenario_runs_at_tiny_scale() {
    let out = std::process::Command::new(bin_path("bench"))
        .args(["--json", "--scale", "0.001"])
        .env("BENCH_DATABASE_URL", system_tests::admin_url())
        .env("AMQP_URL", system_tests::amqp_url())
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for scenario in [
        "ceiling-amqp",
        "ceiling-pg",
        "relay-drain",
        "relay-latency",
        "relay-skew",
        "producer-insert",
        "consumer",
        "consumer timeline ordered",
        "consumer timeline ordered, 4 instances (3-node cluster)",
        "webhook ingest",
        "processes waiting",
        "dependency-outage",
        "dependency happy path",
        "fair-share",
        "old-snapshot",
        "reconciliation run",
        "end-to-end",
        "api",
        "soak-memory",
        "table-growth",
        "processes",
    ] {
        let mine: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|l| {
                l["scenario"]
                    .as_str()
                    .is_some_and(|s| s.starts_with(scenario))
            })
            .collect();
        assert!(!mine.is_empty(), "no line for {scenario}: {stdout}");
        for l in mine {
            assert_ne!(l["unit"], "error", "{scenario} failed: {l}");
            assert!(
                l["value"]
                    .as_f64()
                    .is_some_and(|v| v.is_finite() && v >= 0.0),
                "{l}"
            );
        }
    }
}
