"""GitHub workflows: scheduled and publishing jobs run only upstream (the slug written once, in
upstream.yml), image jobs get 180 minutes, and actionlint is clean."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
WORKFLOWS = ROOT / ".github" / "workflows"
GUARD_WORKFLOW = "./.github/workflows/upstream.yml"
GUARD_IF = "needs.upstream.outputs.upstream == 'true'"
IMAGE_TIMEOUT_MINUTES = 180
PUBLISH_PERMISSIONS = {"packages", "contents", "id-token", "pages", "deployments"}


def load_workflows() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}


def triggers(workflow: dict) -> dict:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    return {on: None} if isinstance(on, str) else dict.fromkeys(on) if isinstance(on, list) else on


def steps_text(job: dict) -> str:
    return yaml.safe_dump(job.get("steps", []))


def publishes(job: dict) -> bool:
    perms = job.get("permissions") or {}
    if isinstance(perms, dict) and any(perms.get(p) == "write" for p in PUBLISH_PERMISSIONS):
        return True
    text = steps_text(job)
    return bool(re.search(r"push: true|helm push|docker push|buildah push|twine upload|gh release", text))


def builds_images(job: dict) -> bool:
    return bool(re.search(r"docker/build-push-action|docker build|buildah (bud|build)", steps_text(job)))


def needs(job: dict) -> list[str]:
    value = job.get("needs", [])
    return [value] if isinstance(value, str) else list(value)


def problems(workflows: dict[str, dict]) -> list[str]:
    """Every scheduled or publishing job lacking the upstream guard; every image job without 180 min."""
    found = []
    for name, wf in workflows.items():
        scheduled = "schedule" in (triggers(wf) or {})
        for job_id, job in (wf.get("jobs") or {}).items():
            if job.get("uses") == GUARD_WORKFLOW:
                continue
            where = f"{name}:{job_id}"
            if scheduled or publishes(job):
                guard = (wf["jobs"].get("upstream") or {}).get("uses") == GUARD_WORKFLOW
                if not (guard and "upstream" in needs(job) and GUARD_IF in str(job.get("if", ""))):
                    found.append(f"{where} is scheduled or publishes but lacks the upstream guard")
            if builds_images(job) and job.get("timeout-minutes") != IMAGE_TIMEOUT_MINUTES:
                found.append(f"{where} builds images without timeout-minutes: {IMAGE_TIMEOUT_MINUTES}")
    return found


def test_every_scheduled_or_publishing_job_is_guarded_and_image_jobs_have_180_minutes():
    workflows = load_workflows()
    assert {"ci.yml", "images.yml", "chart.yml", "upstream.yml"} <= set(workflows)
    assert problems(workflows) == []


def test_the_checker_catches_a_missing_guard_and_a_missing_timeout():
    workflows = load_workflows()
    unguarded = copy.deepcopy(workflows)
    del unguarded["chart.yml"]["jobs"]["publish"]["if"]
    assert problems(unguarded) == ["chart.yml:publish is scheduled or publishes but lacks the upstream guard"]
    untimed = copy.deepcopy(workflows)
    untimed["images.yml"]["jobs"]["image"]["timeout-minutes"] = 60
    assert problems(untimed) == ["images.yml:image builds images without timeout-minutes: 180"]
    scheduled = copy.deepcopy(workflows)
    scheduled["ci.yml"]["on"] = {"schedule": [{"cron": "0 0 * * *"}]}
    assert any(p.startswith("ci.yml:") for p in problems(scheduled))


def test_the_upstream_slug_is_written_in_one_place_and_matches_the_project():
    texts = {p.name: p.read_text() for p in WORKFLOWS.glob("*.yml")}
    comparisons = [
        (n, m) for n, t in texts.items() for m in re.findall(r"github\.repository == '([^']+)'", t)
    ]
    assert len(comparisons) == 1 and comparisons[0][0] == "upstream.yml", comparisons
    home = yaml.safe_load((ROOT / "charts" / "keepwarm" / "Chart.yaml").read_text())["home"]
    assert home.endswith("/" + comparisons[0][1])
    assert f'org.opencontainers.image.source="{home}"' in (ROOT / "Dockerfile").read_text()


def test_ci_runs_make_test_on_pull_requests_and_pushes():
    ci = load_workflows()["ci.yml"]
    assert {"pull_request", "push"} <= set(triggers(ci))
    assert any("make test" in str(s.get("run", "")) for j in ci["jobs"].values() for s in j["steps"])


def actionlint() -> str:
    found = sorted((Path.home() / ".cache" / "keepwarm" / "bin").glob("actionlint-*")) or [
        shutil.which("actionlint")
    ]
    if not found or found[-1] is None:
        pytest.fail("actionlint is missing: `make lint-delivery` builds it from its Go module")
    return str(found[-1])


def test_actionlint_is_clean():
    result = subprocess.run([actionlint(), "-no-color"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
