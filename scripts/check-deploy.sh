#!/usr/bin/env bash
# Checks what deploy/ ships: the systemd unit (systemd-analyze verify, with ExecStart pointed at
# the built reflexd), the Prometheus scrape configuration (promtool check config), the Grafana
# dashboard (valid JSON with panels; admin_prometheus checks its queries), and that the unit's
# reflexd accepts the example configuration (reflexd --check-config).
# Usage: scripts/check-deploy.sh   (after `cargo build --release`)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

reflexd=$PWD/target/release/reflexd
sed "s#/usr/local/bin/reflexd#$reflexd#; s#/etc/reflex/reflexd.toml#$PWD/reflexd.example.toml#" \
    deploy/systemd/reflexd.service > "$work/reflexd.service"
systemd-analyze verify "$work/reflexd.service"
echo "deploy/systemd/reflexd.service: systemd-analyze verify passed"
# The command line the unit runs, against the example configuration.
"$reflexd" --config reflexd.example.toml --log-format json --check-config > /dev/null
promtool check config deploy/prometheus.yml
python3 - <<'PY'
import json
dashboard = json.load(open("deploy/grafana/reflex-dashboard.json"))
assert dashboard["panels"], "no panels"
assert any("reflex_tenant_slo_latency_seconds" in t["expr"] for p in dashboard["panels"] for t in p["targets"])
print("deploy/grafana/reflex-dashboard.json: %d panels" % len(dashboard["panels"]))
PY
# Every configuration under configs/ is valid from any working directory (its paths resolve
# against its own folder). Backends that need a prepared disk file are skipped by --check-config
# only if it does not open them; it checks profiles and tenants.
for config in configs/*.toml; do
    (cd / && "$reflexd" --config "$OLDPWD/$config" --check-config > /dev/null) \
        || { echo "$config: --check-config failed from /"; exit 1; }
    echo "$config: valid from /"
done
