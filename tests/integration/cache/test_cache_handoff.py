"""The cache outlives its daemon: hand-off to a successor under attach load, recovery from the
descriptor holder after SIGKILL, interrupted hand-offs, forged requests and records that do not
verify. Real daemons and holders, real sockets; the test plays a peer only to forge or abandon."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache import client, holder, protocol
from keepwarm_runtime.cache.client import attach, connect
from keepwarm_runtime.cache.handoff import HandoffRefused, recv_stream, send_stream
from keepwarm_runtime.cache.launcher import HolderProcess
from tests.integration.cache.probes import metric as _metric
from tests.integration.cache.probes import scrape as _scrape
from tests.integration.cache.probes import wait_for as _wait_for

NOBODY = 65534


def _disk(model: Path) -> dict[str, torch.Tensor]:
    return attach(model, None, dtype=torch.bfloat16).tensors


def _serving_pid(socket_dir: Path) -> int:
    with connect(socket_dir / "host.sock", 30.0) as sock:
        return client.request(sock, {"cmd": "stats"})[0]["pid"]


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dropped(port: str) -> dict[tuple[str, str], float]:
    """keepwarm_cache_dropped_arenas_total by (source, reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.labels["source"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(_scrape(port))
        for s in f.samples
        if s.name == "keepwarm_cache_dropped_arenas_total"
    }


def _start_arenas(port: str) -> dict[str, float | None]:
    """keepwarm_cache_start_arenas by source: where the arenas the daemon began serving came from."""
    sources = ("predecessor", "holder", "disk")
    return {s: _metric(port, "keepwarm_cache_start_arenas", source=s) for s in sources}


def _settled_fd_count(pid: int, quiet_s: float = 1.0) -> int:
    """The daemon's open descriptors once the count has not changed for ``quiet_s``."""
    count, since = _fd_count(pid), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = _fd_count(pid)
        if now != count:
            count, since = now, time.monotonic()
    return count


class AttachLoad:
    """A steady stream of attaches from a thread: counts fallbacks and checks every tensor's bits."""

    def __init__(self, socket_dir: Path, models: list[Path]) -> None:
        self.socket_dir, self.models = socket_dir, models
        self.reference = {m: _disk(m) for m in models}
        self.sources: list[str] = []
        self.reasons: list[str] = []
        self.mismatches: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            model = self.models[i % len(self.models)]
            i += 1
            res = attach(model, self.socket_dir, dtype=torch.bfloat16, timeout_s=30.0)
            self.sources.append(res.source)
            if res.reason:
                self.reasons.append(res.reason)
            for name, t in self.reference[model].items():
                if not torch.equal(res.tensors[name], t):
                    self.mismatches.append(f"{model.name}:{name}")
            del res

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def test_upgrade_hands_off_under_attach_load(daemon_factory, checkpoint_writer, tmp_path):
    models = [checkpoint_writer(tmp_path / "models" / f"m{i}", seed=i, rows=256) for i in range(2)]
    socket_dir = tmp_path / "wc"
    port = ("--metrics-port", str(_free_port()))  # one host: the successor gets it once the first left
    first = daemon_factory(socket_dir, models, *port).wait_ready()
    load = AttachLoad(socket_dir, models)
    _wait_for(lambda: len(load.sources) >= 5)
    second = daemon_factory(socket_dir, models, *port).wait_ready()
    assert first.wait_exit() == 0
    _wait_for(lambda: 'keepwarm_cache_resident_bytes{model="m0",tier="host"}' in _scrape(port[1]))
    during = len(load.sources)
    _wait_for(lambda: len(load.sources) >= during + 5)  # and after: the successor serves
    load.stop()
    assert load.sources.count("disk") == 0, load.reasons
    assert not load.mismatches
    assert _serving_pid(socket_dir) == second.proc.pid
    assert "took 2 arenas from the predecessor" in second.stderr
    assert "loaded" not in second.stderr  # not one byte of weights read again
    assert "committed the hand-off" in first.stderr and "Traceback" not in first.stderr + second.stderr
    handoffs = "keepwarm_cache_handoffs_total"
    assert _metric(port[1], handoffs, role="successor", outcome="committed") == 1
    assert _metric(port[1], "keepwarm_cache_adopted_arenas_total", source="predecessor") == 2
    assert _dropped(port[1]) == {}
    assert _start_arenas(port[1]) == {"predecessor": 2, "holder": 0, "disk": 0}
    assert _metric(port[1], "keepwarm_cache_adopt_seconds", source="predecessor") is not None
    assert second.terminate() == 0


def _store_raw(socket_dir: Path, head: dict, items: list[tuple[dict, int]]) -> dict:
    """Deposit into the holder as a daemon would, with any head (to forge a format)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(holder.holder_path(socket_dir)))
        protocol.send_frame(sock, {"cmd": "store", "socket": "host.sock"})
        send_stream(sock, head, items)
        return protocol.recv_frame(sock)[0]


def _holder_records(socket_dir: Path) -> list[dict]:
    stream = holder.reclaim(socket_dir, "host.sock")
    assert stream is not None
    try:
        return [record for record, _ in stream.items]
    finally:
        stream.close()


def test_sigkill_recovers_from_the_holder_and_drops_what_does_not_verify(
    daemon_factory, checkpoint_writer, tmp_path
):
    a, b, c = (checkpoint_writer(tmp_path / "models" / n, seed=i, rows=128) for i, n in enumerate("abc"))
    socket_dir = tmp_path / "wc"
    hold = HolderProcess(socket_dir).wait_ready()
    try:
        first = daemon_factory(socket_dir, [a, b, c]).wait_ready()
        _wait_for(lambda: len(_holder_records(socket_dir)) == 3)
        mapped = attach(a, socket_dir, dtype=torch.bfloat16, fallback=False)  # a runtime attached before
        first.kill()
        assert torch.equal(mapped.tensors["a.weight"], _disk(a)["a.weight"])  # its mapping survives

        b_new = _disk(checkpoint_writer(tmp_path / "models" / "b2", seed=7, rows=128))
        for shard in (tmp_path / "models" / "b2").iterdir():  # b changes on disk while no daemon runs
            os.replace(shard, b / shard.name)
        records = _holder_records(socket_dir)
        forged = next(r for r in records if r["name"] == "c")
        unsealed = os.memfd_create("keepwarm:c", os.MFD_ALLOW_SEALING)  # same size, never sealed
        os.ftruncate(unsealed, forged["size"])
        others = [r for r in records if r["name"] != "c"]
        stream = holder.reclaim(socket_dir, "host.sock")
        keep = [(r, fd) for r, fd in stream.items if r["name"] != "c"]
        assert _store_raw(socket_dir, {"format": 1}, [*keep, (forged, unsealed)])["stored"] == 3
        stream.close()
        os.close(unsealed)
        assert {r["name"] for r in others} == {"a", "b"}

        port = str(_free_port())
        second = daemon_factory(socket_dir, [a, b, c], "--metrics-port", port).wait_ready()
        assert "took 1 arenas from the holder" in second.stderr, second.stderr
        assert "not taking b from the holder: changed on disk" in second.stderr
        assert "not taking c from the holder: seals" in second.stderr
        assert (
            "loaded a " not in second.stderr and "loaded b " in second.stderr and "loaded c " in second.stderr
        )
        for model, want in ((a, _disk(a)), (b, b_new), (c, _disk(c))):
            res = attach(model, socket_dir, dtype=torch.bfloat16, fallback=False)
            assert all(torch.equal(res.tensors[n], t) for n, t in want.items()), model.name
        assert _metric(port, "keepwarm_cache_adopted_arenas_total", source="holder") == 1
        assert _dropped(port) == {("holder", "changed_on_disk"): 1, ("holder", "seals"): 1}
        assert _start_arenas(port) == {"predecessor": 0, "holder": 1, "disk": 2}
        assert _metric(port, "keepwarm_cache_handoffs_total", role="successor", outcome="committed") is None
        _wait_for(lambda: sorted(r["name"] for r in _holder_records(socket_dir)) == ["a", "b", "c"])
        assert second.terminate() == 0
    finally:
        hold.terminate()


def test_holder_records_of_another_format_are_refused_by_name(daemon_factory, checkpoint_writer, tmp_path):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    hold = HolderProcess(socket_dir).wait_ready()
    try:
        first = daemon_factory(socket_dir, [model]).wait_ready()
        _wait_for(lambda: len(_holder_records(socket_dir)) == 1)
        first.kill()
        stream = holder.reclaim(socket_dir, "host.sock")
        assert _store_raw(socket_dir, {"format": 99}, stream.items)["stored"] == 1
        stream.close()
        port = str(_free_port())
        second = daemon_factory(socket_dir, [model], "--metrics-port", port).wait_ready()
        assert "arena record format 99 is not one this daemon reads (1)" in second.stderr
        assert "loaded m " in second.stderr
        assert _dropped(port) == {("holder", "format"): 1}
        assert _start_arenas(port) == {"predecessor": 0, "holder": 0, "disk": 1}
        assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    finally:
        hold.terminate()


def _ask_handoff(socket_path: Path, formats: list[int]):
    """Ask as a successor does: a daemon still winding up an abandoned hand-off answers ``busy`` until
    it has seen that successor's connection close (on a loaded box that can take a moment), and a
    successor asks again (cache/succession.py retries the same way)."""
    deadline = time.monotonic() + 60
    while True:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(30)
        sock.connect(str(socket_path))
        protocol.send_frame(sock, {"cmd": "handoff", "formats": formats})
        try:
            return sock, recv_stream(sock)
        except HandoffRefused as exc:
            sock.close()
            if not str(exc).startswith("busy:") or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait_for_abandoned(daemon, port: str, count: int) -> None:
    """Until the daemon has counted and logged ``count`` abandoned hand-offs; else fail with its log."""

    def counted() -> bool:
        outcome = _metric(port, "keepwarm_cache_handoffs_total", role="predecessor", outcome="abandoned")
        return outcome == count and daemon.stderr.count(" abandoned (") == count

    try:
        _wait_for(counted, timeout_s=60)
    except AssertionError:
        tasks = Path(f"/proc/{daemon.proc.pid}/task").iterdir()
        threads = [f"{(t / 'comm').read_text().strip()}: {(t / 'wchan').read_text()}" for t in tasks]
        raise AssertionError(
            f"not {count} abandoned hand-offs; daemon threads waiting in {threads}; its log:\n{daemon.stderr}"
        ) from None


def test_an_abandoned_handoff_leaves_the_daemon_serving_and_nothing_leaked(
    daemon_factory, checkpoint_writer, tmp_path
):
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    port = str(_free_port())
    first = daemon_factory(socket_dir, [model], "--metrics-port", port).wait_ready()
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    baseline = _settled_fd_count(first.proc.pid)  # once the attach's connection is closed

    sock, stream = _ask_handoff(first.socket, [99])  # a successor of another format: refused by name
    assert stream.head["refused"] == "this daemon writes arena record format 1; the successor reads [99]"
    assert stream.items == [] and len(stream.final_fds) == 2
    stream.close()
    sock.close()  # and it goes away without committing: the daemon carries on

    sock, stream = _ask_handoff(first.socket, [1])  # a successor killed after the stream
    assert [r["name"] for r, _ in stream.items] == ["m"]
    stream.close()
    sock.close()
    _wait_for_abandoned(first, port, 2)

    # A successor killed before it read anything: the stream meets a closed socket.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(first.socket))
        protocol.send_frame(sock, {"cmd": "handoff", "formats": [1]})
    _wait_for_abandoned(first, port, 3)
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    _wait_for(lambda: _fd_count(first.proc.pid) <= baseline)
    assert _serving_pid(socket_dir) == first.proc.pid
    assert _metric(port, "keepwarm_cache_handoffs_total", role="predecessor", outcome="committed") is None

    second = daemon_factory(socket_dir, [model]).wait_ready()  # a real successor still takes over
    assert first.wait_exit() == 0
    assert "took 1 arenas from the predecessor" in second.stderr


def test_predecessor_killed_before_the_commit(daemon_factory, checkpoint_writer, tmp_path):
    kept = checkpoint_writer(tmp_path / "models" / "kept", seed=1)
    extra = checkpoint_writer(tmp_path / "models" / "extra", seed=2, rows=4096)  # loaded before commit
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, [kept]).wait_ready()
    port = str(_free_port())
    second = daemon_factory(socket_dir, [kept, extra], "--metrics-port", port)
    _wait_for(lambda: "took 1 arenas from the predecessor" in second.stderr or second.proc.poll() is not None)
    first.kill()  # between the stream and the commit: the successor's extra load is under way
    second.wait_ready()
    assert "did not confirm the hand-off" in second.stderr and "has exited; serving" in second.stderr
    assert _metric(port, "keepwarm_cache_handoffs_total", role="successor", outcome="unconfirmed") == 1
    assert _start_arenas(port) == {"predecessor": 1, "holder": 0, "disk": 1}
    for model in (kept, extra):
        res = attach(model, socket_dir, dtype=torch.bfloat16, fallback=False)
        assert all(torch.equal(res.tensors[n], t) for n, t in _disk(model).items())
    assert _serving_pid(socket_dir) == second.proc.pid
    assert second.terminate() == 0
    assert not (socket_dir / "host.sock").exists()


def test_a_successor_of_another_configuration_takes_what_fits(daemon_factory, checkpoint_writer, tmp_path):
    from keepwarm_runtime.weights.arena import plan_layout
    from keepwarm_runtime.weights.checkpoint import read_checkpoint

    a = checkpoint_writer(tmp_path / "models" / "a", seed=1, rows=512)
    b = checkpoint_writer(tmp_path / "models" / "b", seed=2, rows=512)
    socket_dir = tmp_path / "wc"
    first = daemon_factory(socket_dir, [a, b]).wait_ready()
    attach(b, socket_dir, dtype=torch.bfloat16, fallback=False)  # b is the most recently used
    one = plan_layout(read_checkpoint(a), torch.bfloat16).size
    port = str(_free_port())
    second = daemon_factory(socket_dir, [], "--budget", str(one + (1 << 20)), "--metrics-port", port)
    second.wait_ready()
    assert first.wait_exit() == 0
    assert "took 1 arenas from the predecessor" in second.stderr
    assert "not taking a from the predecessor" in second.stderr and "budget" in second.stderr
    assert "configuration changes at hand-off: budget None -> " in second.stderr
    assert _dropped(port) == {("predecessor", "budget"): 1}
    assert _start_arenas(port) == {"predecessor": 1, "holder": 0, "disk": 0}
    assert attach(b, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"

    port = str(_free_port())
    third = daemon_factory(socket_dir, [b], "--dtype", "float32", "--metrics-port", port).wait_ready()
    assert second.wait_exit() == 0
    assert "not taking b from the predecessor" in third.stderr and "key: dtype bfloat16" in third.stderr
    assert _dropped(port) == {("predecessor", "key"): 1}
    assert _start_arenas(port) == {"predecessor": 0, "holder": 0, "disk": 1}
    res = attach(b, socket_dir, dtype=torch.float32, fallback=False)  # reloaded in the new dtype
    assert res.tensors["a.weight"].dtype == torch.float32


def _handoff_as(uid: int, gid: int, socket_path: Path) -> dict:
    """Fork, drop to uid/gid, ask for a hand-off and return the daemon's first reply."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only sockets and json from here on
        try:
            os.close(r)
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(socket_path))
                with contextlib.suppress(BrokenPipeError):
                    protocol.send_frame(s, {"cmd": "handoff", "formats": [1]})
                reply, fds = protocol.recv_frame(s)
            os.write(w, json.dumps({**reply, "got_fds": len(fds)}).encode())
            os._exit(0)
        except BaseException as exc:
            os.write(w, json.dumps({"child_error": repr(exc)}).encode())
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as nobody")
def test_a_forged_handoff_request_from_an_allowed_client_is_refused(
    daemon_factory, checkpoint_writer, request
):
    root = Path(tempfile.mkdtemp(prefix="keepwarm-it-"))  # pytest's tmp_path is 0700 root: nobody stops there
    os.chmod(root, 0o755)  # nobody must reach the socket dir (0770 nogroup)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    model = checkpoint_writer(root / "models" / "m", seed=1)
    socket_dir = root / "wc"
    port = str(_free_port())
    args = ("--group", "nogroup", "--allow-uid", str(NOBODY), "--metrics-port", port)
    first = daemon_factory(socket_dir, [model], *args).wait_ready()
    reply = _handoff_as(NOBODY, NOBODY, first.socket)
    assert reply.get("ok") is False, reply
    assert reply["error"]["code"] == "forbidden" and reply["got_fds"] == 0
    assert f"uid {NOBODY} is a client" in reply["error"]["message"]
    assert first.proc.poll() is None
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
    assert _serving_pid(socket_dir) == first.proc.pid
    assert _metric(port, "keepwarm_cache_handoffs_total", role="predecessor", outcome="refused") == 1


def test_after_handoff_wait_idles_until_sigterm_and_a_new_holder_takes_the_deposits(
    daemon_factory, checkpoint_writer, tmp_path
):
    """What the agent pods run: the old pod's daemon and holder hand over, then idle (an exited
    container would be restarted and take everything back) until SIGTERM, which leaves the
    successor's socket alone."""
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    old_holder = HolderProcess(socket_dir, "--after-handoff", "wait").wait_ready()
    new_holder = None
    try:
        first = daemon_factory(socket_dir, [model], "--after-handoff", "wait").wait_ready()
        _wait_for(lambda: len(_holder_records(socket_dir)) == 1)
        new_holder = HolderProcess(socket_dir).wait_ready()
        assert "took 1 descriptors over from the running holder" in new_holder.stderr
        second = daemon_factory(socket_dir, [model]).wait_ready()
        _wait_for(lambda: "waiting idle for SIGTERM" in first.stderr and "waiting idle" in old_holder.stderr)
        assert first.proc.poll() is None and old_holder.proc.poll() is None
        assert _serving_pid(socket_dir) == second.proc.pid
        assert first.terminate() == 0 and old_holder.terminate() == 0
        assert (socket_dir / "host.sock").exists() and holder.holder_path(socket_dir).exists()
        assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
        assert [r["name"] for r in _holder_records(socket_dir)] == ["m"]  # the new holder has it
        second.kill()
        third = daemon_factory(socket_dir, [model]).wait_ready()
        assert "took 1 arenas from the holder" in third.stderr
    finally:
        old_holder.kill()
        if new_holder is not None:
            new_holder.terminate()


def test_one_daemon_per_gpu_hands_off_each_socket(daemon_factory, checkpoint_writer, tmp_path):
    """`--fake-gpu` x2 (the gpu tier's per-GPU daemons, as host-memory twins): each socket is handed
    over on its own, and the old process leaves once both are."""
    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    gpus = ["--fake-gpu", "GPU-fake-0", "--fake-gpu", "GPU-fake-1"]
    first = daemon_factory(socket_dir, [model], *gpus, tier="auto").wait_ready()
    second = daemon_factory(socket_dir, [model], *gpus, tier="auto").wait_ready()
    assert first.wait_exit() == 0
    assert second.stderr.count("took 1 arenas from the predecessor") == 2, second.stderr
    assert "loaded" not in second.stderr
    for uuid in ("GPU-fake-0", "GPU-fake-1"):
        with connect(socket_dir / f"gpu-{uuid}.sock", 30.0) as sock:
            stats = client.request(sock, {"cmd": "stats"})[0]
        assert stats["pid"] == second.proc.pid and list(stats["models"]) == ["m"]


def test_a_daemon_from_before_handoffs_is_waited_for(daemon_factory, checkpoint_writer, tmp_path):
    """The first upgrade to a version with hand-offs: the running daemon answers `handoff` with
    unknown_command, keeps serving, and the successor loads once it has stopped (the old way)."""
    from keepwarm_runtime.cache import security

    model = checkpoint_writer(tmp_path / "models" / "m", seed=1)
    socket_dir = tmp_path / "wc"
    security.prepare_socket_dir(socket_dir)
    lock = security.DaemonLock(socket_dir / "host.sock")
    lock.acquire()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_dir / "host.sock"))
    listener.listen(8)

    def old_daemon() -> None:  # answers every request as a keepwarm without hand-offs would
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError, protocol.ProtocolError):
                cmd = protocol.recv_frame(conn)[0].get("cmd")
                protocol.send_frame(conn, protocol.error_reply("unknown_command", f"unknown command {cmd!r}"))

    threading.Thread(target=old_daemon, daemon=True).start()
    second = daemon_factory(socket_dir, [model])
    _wait_for(lambda: "a version without hand-off; waiting for it to stop" in second.stderr)
    assert second.proc.poll() is None and second.ready_s is None
    listener.close()  # the old daemon stops (SIGTERM: it unlinks its socket and releases the lock)
    os.unlink(socket_dir / "host.sock")
    lock.release()
    second.wait_ready()
    assert "loaded m " in second.stderr
    assert attach(model, socket_dir, dtype=torch.bfloat16, fallback=False).source == "cache"
