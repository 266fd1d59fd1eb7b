"""A real Prometheus (Debian's `prometheus`, installed by `make prometheus`) on loopback for the
dashboard tests: scrapes the given targets every second, answers PromQL over its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

SCRAPE_INTERVAL_S = 1
# What Grafana's $__rate_interval becomes here: four scrape intervals plus one.
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S + 1}s"


class PrometheusMissing(RuntimeError):
    """No prometheus binary: `make prometheus` installs Debian's package."""


@dataclass
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix time, value)


class Prometheus:
    def __init__(self, workdir: Path, port: int, jobs: dict[str, list[str]]) -> None:
        """jobs: job name -> ["127.0.0.1:PORT", ...] scraped at /metrics."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusMissing(
                "prometheus not found: run `make prometheus` (Debian package `prometheus`)"
            )
        self.url = f"http://127.0.0.1:{port}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
            ],
        }
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        command = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def wait_ready(self, timeout_s: float = 60) -> Prometheus:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.http.get("/-/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s:\n{self.log_tail()}")

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health ('up', 'down', 'unknown')."""
        active = self.http.get("/api/v1/targets").json()["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] for t in active}

    def query_range(
        self, expr: str, start: float, end: float, step_s: float = SCRAPE_INTERVAL_S
    ) -> list[Series]:
        """Evaluate expr over [start, end]; raises PromQLError with Prometheus' message on any error."""
        resp = self.http.get(
            "/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step_s}
        )
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise PromQLError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return [
            Series(r["metric"], [(float(t), float(v)) for t, v in r["values"]])
            for r in body["data"]["result"]
        ]

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class PromQLError(RuntimeError):
    """Prometheus refused a query (bad syntax, unknown function, ...)."""


def grafana_to_promql(expr: str) -> str:
    """Replace the Grafana variables a panel may use with what they mean against this Prometheus."""
    return expr.replace("$__rate_interval", RATE_INTERVAL)
