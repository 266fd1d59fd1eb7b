"""The conformance sweep: every type in transformers' causal-LM mapping, each judged in its own process.

    python -m tests.sweep.run --report sweep-report.json [--types llama gemma2] [--timeout 600]

One forked child process per type, with an address-space cap and a wall-clock limit, so a type that
hangs, crashes or eats memory cannot sink the run. The report is rewritten after every type;
`--resume` keeps the types already in it (after an interruption; with `--types`, those few are judged
again). A child killed while transformers was still building or generating leaves the type not
judged; killed while keepwarm ran, it is an error. Exit status 1 when any type is different or an
error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

VERDICTS = ("identical", "refused", "not_judged", "different", "error")
FAILING = ("different", "error")
MEMORY_CAP_GIB = 8.0  # address space per child: torch maps a few GiB of virtual memory on import
TIMEOUT_S = 600


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_one(model_type: str, work: Path, tokenizer_dir: Path, out: Path) -> None:
    """Child side: judge one type, writing the phase to `out`.phase and the verdict to `out`."""
    from tests.sweep.judge import judge

    phase_file = out.with_suffix(".phase")
    verdict = judge(model_type, work, tokenizer_dir, progress=phase_file.write_text)
    out.write_text(json.dumps(dataclasses.asdict(verdict)))


def _die_with_parent() -> None:
    """Linux prctl(PR_SET_PDEATHSIG, SIGKILL): a child never outlives an interrupted sweep."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _limit_memory(gib: float) -> None:
    cap = int(gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def judge_in_child(
    model_type: str, work: Path, tokenizer_dir: Path, timeout: float, memory_gib: float
) -> dict:
    """Fork a child that judges `model_type` (torch and transformers are imported once, in the parent:
    a fresh interpreter per type would spend most of its time importing them)."""
    out = work / f"{model_type}.verdict.json"
    phase = out.with_suffix(".phase")
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: cap, judge, exit without running the parent's cleanup
        status = 1
        try:
            _die_with_parent()
            _limit_memory(memory_gib)
            run_one(model_type, work, tokenizer_dir, out)
            status = 0
        finally:
            os._exit(status)
    failure = _wait(pid, timeout)
    if failure is None and out.exists():
        return json.loads(out.read_text())
    last = phase.read_text() if phase.exists() else "transformers"
    kind = "not_judged" if last == "transformers" else "error"
    reason = f"{'transformers' if kind == 'not_judged' else last}: {failure or 'no verdict written'}"
    return {
        "model_type": model_type,
        "verdict": kind,
        "reason": reason.replace("\n", " "),
        "conditions": {},
        "features": [],
        "seconds": time.monotonic() - start,
    }


def _wait(pid: int, timeout: float) -> str | None:
    """None when the child exited cleanly in time, else what happened to it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f"killed by signal {os.WTERMSIG(status)} (memory cap {MEMORY_CAP_GIB} GiB?)"
            code = os.WEXITSTATUS(status)
            return None if code == 0 else f"exit status {code}"
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return f"no verdict within {timeout:.0f} s"


def summary(results: dict[str, dict]) -> dict[str, int]:
    return {v: sum(1 for r in results.values() if r["verdict"] == v) for v in VERDICTS}


def write_report(path: Path, results: dict[str, dict], started: float) -> None:
    import torch
    import transformers

    report = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seconds": round(time.time() - started, 1),
        "summary": summary(results),
        "types": dict(sorted(results.items())),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def sweep(
    report: Path, types: list[str], timeout: float, memory_gib: float, resume: bool, rejudge: bool
) -> dict:
    """Judge `types` into `report`; with `resume`, types already there are kept (and skipped unless
    `rejudge`: types named on the command line are judged again)."""
    from keepwarm_runtime.modelgen import make_model
    from tests.sweep import judge  # noqa: F401  (imported once here, inherited by every child)

    results: dict[str, dict] = {}
    if report.exists() and resume:
        results = json.loads(report.read_text()).get("types", {})
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="keepwarm-sweep-") as tmp:
        tokenizer_dir = make_model(Path(tmp) / "tokenizer", arch="llama", params="400K", vocab_size=2048)
        for model_type in types:
            if model_type in results and not rejudge:
                continue
            work = Path(tmp) / "types"
            work.mkdir(exist_ok=True)
            result = judge_in_child(model_type, work, tokenizer_dir, timeout, memory_gib)
            results[model_type] = result
            write_report(report, results, started)
            print(f"{model_type}: {result['verdict']} {result['reason'][:160]}", flush=True)
    write_report(report, results, started)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=Path("sweep-report.json"))
    parser.add_argument("--types", nargs="*", help="model types (default: the whole causal-LM mapping)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per type")
    parser.add_argument("--memory-gib", type=float, default=MEMORY_CAP_GIB, help="address space per type")
    parser.add_argument("--resume", action="store_true", help="keep the types already in the report")
    args = parser.parse_args(argv)
    types = args.types or causal_lm_types()
    results = sweep(args.report, types, args.timeout, args.memory_gib, args.resume, bool(args.types))
    counts = summary(results)
    print(json.dumps(counts))
    return 1 if any(counts[v] for v in FAILING) else 0


if __name__ == "__main__":
    sys.exit(main())
