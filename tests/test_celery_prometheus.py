"""The fleet view in a real Prometheus: two Celery workers ("machines"), each with its own exporter
(`cgturn metrics --listen`), scraped by a Prometheus this test starts on a loopback port with the rules
of contrib/prometheus; after a mixed run its HTTP API must give the figures the audit logs hold.
Also `promtool test rules` on the shipped rules.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest

from celery_fleet import need_module  # noqa: E402

celery = need_module("celery")
need_module("redis")

from celery_fleet import (  # noqa: E402
    Redis, all_gone, fleet_env, free_port, listening, need_tool, reap_orphans, spawned,
    start_exporter, start_worker, stop_process, stop_worker, survivors, write_app)
from conftest import REPO, audit_records, need_cgroup2, wait_until  # noqa: E402

RULES_DIR = os.path.join(REPO, "contrib", "prometheus")
pytestmark = [pytest.mark.cgroup2, pytest.mark.root]


def test_the_shipped_rules_pass_promtool():
    need_tool("promtool", "prometheus")
    out = subprocess.run(["promtool", "test", "rules", "cgturn-rules.test.yml"], cwd=RULES_DIR,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


class Prometheus:
    """prometheus on a loopback port, scraping `targets` every second, with the shipped rules."""

    def __init__(self, workdir: str, targets: dict[str, int]):
        if shutil.which("prometheus") is None:
            raise FileNotFoundError("prometheus (Debian package prometheus) is not installed")
        self.port = free_port()
        config = os.path.join(workdir, "prometheus.yml")
        static = [{"targets": [f"127.0.0.1:{port}"], "labels": {"worker": name}} for name, port in targets.items()]
        with open(config, "w") as f:
            json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                       "rule_files": [os.path.join(RULES_DIR, "cgturn-rules.yml")],
                       "scrape_configs": [{"job_name": "cgturn", "static_configs": static}]}, f)  # JSON is YAML
        self.log = open(os.path.join(workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_until(lambda: self.proc.poll() is not None or listening(self.port), timeout=30):
            self.stop()
            raise RuntimeError("prometheus did not listen within 30 s")

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def figures(self, expr: str, label: str) -> dict[str, float]:
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in self.query(expr)}

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def kills_by_reason(*state_dirs: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in state_dirs:
        for r in audit_records(d):
            if r.get("action", "kill") == "kill":
                out[r["reason"]] = out.get(r["reason"], 0) + 1
    return out


def test_prometheus_sees_the_fleet_as_the_audit_logs_do(tmp_path):
    mount = need_cgroup2()
    if os.geteuid() != 0:
        pytest.skip("needs root")
    need_tool("redis-server", "redis-server")
    need_tool("prometheus", "prometheus")
    tmp = str(tmp_path)
    out = write_app(tmp)
    redis = Redis(tmp)
    workers, reports, prom = [], [], None
    try:
        env = fleet_env(redis.url, tmp, out)
        workers = [start_worker("pa", env, mount, tmp), start_worker("pb", env, mount, tmp)]
        for w in workers:
            start_exporter(w, env)
        prom = Prometheus(tmp, {w.name: w.exporter_port for w in workers})
        client = celery.Celery("client", broker=redis.url, backend=redis.url)
        # The mixed run: on pa a revoke, an error and an OOM, on pb a time limit and a running task.
        revoked = client.send_task("fleet.work", args=("hang",), queue="pa")
        reports.append(spawned(out, revoked.id))
        client.control.revoke(revoked.id, terminate=True)
        failed = client.send_task("fleet.work", args=("raise",), queue="pa")
        oom = client.send_task("fleet.limited", args=("oom-child",), queue="pa")
        timed = client.send_task("fleet.work", args=("hang",), queue="pb", time_limit=5.0)
        for res in (failed, oom, timed):
            with pytest.raises(Exception):
                res.get(timeout=60)
            reports.append(spawned(out, res.id))
        running = client.send_task("fleet.work", args=("hang",), queue="pb")
        reports.append(spawned(out, running.id))
        for what in reports[:-1]:
            assert all_gone(what), survivors(what)
        want = {"celery-revoked": 1, "error": 1, "oom": 1, "celery-time-limit": 1}
        # A killer appends its audit line just after its kill, and Celery may hand the result back
        # before the worker's abandon: the processes can be seen gone before the line is there.
        wait_until(lambda: kills_by_reason(*(w.state_dir for w in workers)) == want, timeout=30)
        expected = kills_by_reason(*(w.state_dir for w in workers))
        assert expected == want

        # Fleet-wide figures, once Prometheus has scraped the state above (bounded wait, then compared).
        def settled():
            return (prom.figures("sum by (reason) (cgturn_kills_total)", "reason") == expected
                    and prom.figures("instance:cgturn_turns_running:sum", "instance") != {})
        wait_until(settled, timeout=30, interval=0.5)
        assert prom.figures("sum by (reason) (cgturn_kills_total)", "reason") == expected
        running_per_worker = prom.figures('sum by (worker) (cgturn_turns{state="running"})', "worker")
        assert running_per_worker == {"pa": 0.0, "pb": 1.0}
        ooms = prom.figures('sum by (worker) (cgturn_limit_events_total{reason="oom"})', "worker")
        audited_ooms = {w.name: float(sum(1 for r in audit_records(w.state_dir) if r.get("action") == "limit"
                                          and r.get("reason") == "oom")) for w in workers}
        assert ooms == audited_ooms and audited_ooms["pa"] >= 1
        latency_count = prom.figures("sum(cgturn_abandon_duration_seconds_count)", "")
        assert latency_count == {"": float(sum(expected.values()))}
        latency_sum = prom.figures("sum(cgturn_abandon_duration_seconds_sum)", "")[""]
        audited_sum = sum(r["duration_ms"] for w in workers for r in audit_records(w.state_dir)
                          if r.get("action", "kill") == "kill") / 1000
        assert latency_sum == pytest.approx(audited_sum, rel=1e-6, abs=1e-6)
    finally:
        if prom is not None:
            prom.stop()
        for w in workers:
            stop_worker(w)
        redis.stop()
        for what in reports:
            reap_orphans(what)
