"""The forked-worker server (``verl_balance/single_controller/forked_workers.py``) starts a script as a fresh
interpreter would, and a worker dies with the process Ray started: the suite's Ray workers are its forks.

Each test runs a small script through the real client (the command Ray runs, or ``python_command`` for
a test's driver) and checks what a fresh ``python SCRIPT`` or ``python -m MODULE`` gives: arguments,
directory, environment, ``sys.path``, streams, exit status, atexit handlers, a signal to a driver's pid;
and that the preloaded modules are the third-party ones only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from verl_balance.single_controller import forked_workers
from verl_balance.testing import forked_workers as suite_forked_workers

pytestmark = pytest.mark.slow  # a server process that imports torch and transformers

PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys
    report = {
        "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path[:3],
        "preloaded": sorted(m for m in ("torch", "transformers", "ray", "verl", "verl_balance") if m in sys.modules),
        "pgid": os.getpgid(0), "pid": os.getpid(), "oom_score_adj": open("/proc/self/oom_score_adj").read().strip(),
    }
    report["hash"] = hash("a string")
    if sys.argv[1] == "seeds":  # torch and numpy: seconds to import in a fresh interpreter, only here
        import numpy, random, torch
        report["seeds"] = [torch.initial_seed(), numpy.random.random(), random.random()]
        report["threads"] = torch.get_num_threads()
    atexit.register(lambda: open(os.environ["ATEXIT_FILE"], "w").write("ran"))
    print(json.dumps(report))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise RuntimeError("probe failed")
    if sys.argv[1] in ("sleep", "trap"):
        if sys.argv[1] == "trap":  # a driver's SIGTERM handler (the recipes save and exit on it)
            import signal
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        sys.stdout.flush()
        import time
        time.sleep(600)
    sys.exit(0 if sys.argv[1] == "seeds" else int(sys.argv[1]))
    """
)


@pytest.fixture(scope="module")
def server():
    folder = tempfile.mkdtemp(prefix="vbfwt", dir="/tmp")
    socket_path = os.path.join(folder, "socket")
    proc = forked_workers.start_server(socket_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield socket_path
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def _raise_oom_score_adj():
    with open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("1000")


def _start(command, folder, mode: str, *, new_session: bool = False, env: dict | None = None):
    """``command probe.py mode`` in ``folder`` with an extra PYTHONPATH entry; streams to files there.
    Its own process group, as the raylet starts each worker (or its own session), and the
    ``oom_score_adj`` of 1000 the raylet gives it."""
    folder.mkdir(exist_ok=True)
    script = folder / "probe.py"
    script.write_text(PROBE)
    env = dict(env or os.environ, ATEXIT_FILE=str(folder / "atexit"), PYTHONPATH=str(folder / "extra"), PROBE_VAR="x")
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        group = {"start_new_session": True} if new_session else {"process_group": 0}
        return subprocess.Popen(
            [*command, str(script), mode],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=err,
            preexec_fn=_raise_oom_score_adj,
            **group,
        )


def _start_driver(folder, args: list[str], *, forked: bool):
    """A test's subprocess driver ``python ARGS``: ``python_command`` (forked: a server is named in the
    environment, as in the suite) or a fresh interpreter; ``folder`` holds the probe as a script and
    as module ``probe``."""
    folder.mkdir(exist_ok=True)
    (folder / "probe.py").write_text(PROBE)
    command = suite_forked_workers.python_command(args) if forked else [sys.executable, *args]
    env = dict(os.environ, ATEXIT_FILE=str(folder / "atexit"), PYTHONPATH=str(folder / "extra"))
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        return subprocess.Popen(command, cwd=folder, env=env, stdout=out, stderr=err)


def _client(socket_path):
    return forked_workers.client_argv(socket_path)


def _report(folder):
    return json.loads((folder / "out").read_text().splitlines()[0])


def _finish(proc, folder):
    status = proc.wait(timeout=120)
    atexit_ran = (folder / "atexit").exists()
    return status, _report(folder), atexit_ran, (folder / "err").read_text()


@pytest.mark.parametrize("mode", ["0", "3", "raise"])
def test_a_forked_script_sees_and_returns_what_a_fresh_interpreter_does(server, tmp_path, mode):
    fresh = _finish(_start([sys.executable], tmp_path / "fresh", mode), tmp_path / "fresh")
    forked = _finish(_start(_client(server), tmp_path / "forked", mode), tmp_path / "forked")
    assert forked[0] == fresh[0] == {"0": 0, "3": 3, "raise": 1}[mode]
    assert forked[2] and fresh[2]  # atexit handlers ran
    assert "to stderr" in forked[3] and ("RuntimeError: probe failed" in forked[3]) == (mode == "raise")
    ours, theirs = forked[1], fresh[1]
    assert [os.path.basename(a) for a in ours["argv"]] == [os.path.basename(a) for a in theirs["argv"]]
    assert ours["cwd"] == str(tmp_path / "forked") and theirs["cwd"] == str(tmp_path / "fresh")
    assert ours["path"][:2] == [str(tmp_path / "forked"), str(tmp_path / "forked" / "extra")]
    assert theirs["path"][:2] == [str(tmp_path / "fresh"), str(tmp_path / "fresh" / "extra")]
    assert ours["path"][2] == theirs["path"][2]  # then the interpreter's own entries
    assert ours["env"]["PROBE_VAR"] == "x" and ours["env"]["ATEXIT_FILE"].endswith("forked/atexit")
    assert set(ours["env"]) == set(theirs["env"])  # the client's environment, nothing of the server's
    assert ours["oom_score_adj"] == theirs["oom_score_adj"] == "1000"  # the server's is 0
    # preloaded: the third-party modules only (negative control: a fresh interpreter has none)
    assert ours["preloaded"] == ["torch", "transformers"] and theirs["preloaded"] == []


def test_each_forked_worker_draws_its_own_random_seeds_as_a_fresh_interpreter_does(server, tmp_path):
    forked = [_finish(_start(_client(server), tmp_path / f"f{i}", "seeds"), tmp_path / f"f{i}")[1] for i in range(2)]
    fresh = [_finish(_start([sys.executable], tmp_path / f"s{i}", "seeds"), tmp_path / f"s{i}")[1] for i in range(2)]
    for pair in (forked, fresh):
        assert all(a != b for a, b in zip(pair[0]["seeds"], pair[1]["seeds"], strict=True))  # torch, numpy, random
    assert fresh[0]["hash"] != fresh[1]["hash"]
    # The documented difference, and the control that this test sees inherited state: nothing redraws
    # the string-hash seed, so the forks share their server's.
    assert forked[0]["hash"] == forked[1]["hash"]


def test_a_client_in_another_session_starts_a_fresh_interpreter(server, tmp_path):
    """The worker cannot join a process group of another session: the client runs the script itself."""
    client = _start(_client(server), tmp_path, "3", new_session=True)
    status, report, atexit_ran, _ = _finish(client, tmp_path)
    assert (status, atexit_ran, report["preloaded"]) == (3, True, [])
    assert report["pid"] == client.pid and report["path"][:2] == [str(tmp_path), str(tmp_path / "extra")]


@pytest.mark.parametrize("omp_num_threads", ["3", None])
def test_a_forked_worker_sizes_torch_threads_as_a_fresh_interpreter_does(server, tmp_path, omp_num_threads):
    """The server imported torch with OMP_NUM_THREADS=1; a worker takes its own value, or one thread per
    usable core without one (negative control: the server's 1, which a fork would otherwise keep)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp_num_threads:
        env["OMP_NUM_THREADS"] = omp_num_threads
    threads = {}
    for name, command in (("forked", _client(server)), ("fresh", [sys.executable])):
        _finish(_start(command, tmp_path / name, "seeds", env=env), tmp_path / name)
        threads[name] = _report(tmp_path / name)["threads"]
    assert threads["forked"] == threads["fresh"]
    assert threads["fresh"] != 1 or os.cpu_count() == 1  # the server's own count would fail this test


def test_a_client_started_before_its_server_listens_waits_for_it(tmp_path):
    """The embedded cluster starts the server beside Ray: a worker may ask before the imports are done."""
    folder = tempfile.mkdtemp(prefix="vbfwl", dir="/tmp")
    socket_path = os.path.join(folder, "socket")
    proc = forked_workers.start_server(socket_path, env=dict(os.environ), wait_s=None)
    try:
        assert not os.path.exists(socket_path)  # still importing
        status, report, _, _ = _finish(_start(_client(socket_path), tmp_path, "3"), tmp_path)
        assert (status, report["preloaded"]) == (3, ["torch", "transformers"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("server_state", ["dead", "no_folder"])
def test_a_client_whose_server_is_gone_starts_a_fresh_interpreter_and_says_so(tmp_path, server_state):
    folder = tmp_path / "server"
    socket_path = str(folder / "socket")
    if server_state == "dead":
        folder.mkdir()
        dead = subprocess.Popen(["true"])
        dead.wait()
        (folder / "socket.pid").write_text(str(dead.pid))
    started = time.monotonic()
    client = _start(_client(socket_path), tmp_path / "run", "3")
    status, report, atexit_ran, err = _finish(client, tmp_path / "run")
    assert (status, atexit_ran, report["preloaded"], report["pid"]) == (3, True, [], client.pid)
    assert f"no preloaded-worker server at {socket_path}" in err
    assert time.monotonic() - started < 60  # not forked_workers.SERVER_WAIT_S


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_worker_dies_with_its_client_and_with_its_clients_process_group(server, tmp_path, stopped):
    for how in ("kill_client", "kill_group"):
        folder = tmp_path / how
        client = _start(_client(server), folder, "sleep")
        deadline = time.monotonic() + 60
        while not (folder / "out").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        report = _report(folder)
        worker_pid = report["pid"]
        assert worker_pid != client.pid
        assert report["pgid"] == client.pid  # the worker is in the client's process group
        if stopped:
            os.kill(worker_pid, signal.SIGSTOP)
        if how == "kill_client":
            os.kill(client.pid, signal.SIGKILL)
        else:
            os.killpg(client.pid, signal.SIGKILL)
        client.wait(timeout=30)
        assert _wait_gone(worker_pid), f"{how}: worker {worker_pid} outlived its client"


def test_the_hook_adds_the_client_only_while_a_server_is_named(monkeypatch):
    monkeypatch.delenv(forked_workers.SOCKET_ENV, raising=False)
    assert suite_forked_workers.runtime_env_hook({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    assert suite_forked_workers.runtime_env_hook(None) is None
    monkeypatch.setenv(forked_workers.SOCKET_ENV, "/tmp/s")
    hooked = suite_forked_workers.runtime_env_hook({"env_vars": {"A": "1"}})
    assert hooked == {"env_vars": {"A": "1"}, "py_executable": f"{sys.executable} -S {forked_workers.__file__} /tmp/s"}
    assert hooked["py_executable"] == forked_workers.client_command("/tmp/s")
    own = {"py_executable": "uv run"}
    assert suite_forked_workers.runtime_env_hook(own) == own  # a job's own executable wins


@pytest.mark.parametrize("mode", ["0", "3", "raise"])
def test_a_forked_driver_module_sees_and_returns_what_python_dash_m_does(server, tmp_path, monkeypatch, mode):
    """``python -m probe``: argv, ``sys.path`` (the working directory first), exit status, atexit."""
    monkeypatch.delenv(forked_workers.SOCKET_ENV, raising=False)
    assert suite_forked_workers.python_command(["-m", "probe"]) == [sys.executable, "-m", "probe"]  # no server named
    monkeypatch.setenv(forked_workers.SOCKET_ENV, server)
    runs = {}
    for name in ("fresh", "forked"):
        folder = tmp_path / name
        runs[name] = _finish(_start_driver(folder, ["-m", "probe", mode], forked=name == "forked"), folder)
        status, report, atexit_ran, err = runs[name]
        assert status == {"0": 0, "3": 3, "raise": 1}[mode] and atexit_ran
        assert report["argv"] == [str(folder / "probe.py"), mode] and report["cwd"] == str(folder)
        assert report["path"][:2] == [str(folder), str(folder / "extra")]
        assert ("RuntimeError: probe failed" in err) == (mode == "raise")
    assert runs["forked"][1]["path"][2] == runs["fresh"][1]["path"][2]
    assert set(runs["forked"][1]["env"]) == set(runs["fresh"][1]["env"])
    # negative control: only the forked driver has the preloaded modules
    assert (runs["forked"][1]["preloaded"], runs["fresh"][1]["preloaded"]) == (["torch", "transformers"], [])


def test_a_signal_to_a_forked_drivers_pid_reaches_the_driver(server, tmp_path, monkeypatch):
    """A test signals the pid it started: the client passes SIGTERM on to the driver (its own process
    group), whose handler decides the exit status, as for a fresh ``python SCRIPT``."""
    monkeypatch.setenv(forked_workers.SOCKET_ENV, server)
    for name in ("fresh", "forked"):
        folder = tmp_path / name
        driver = _start_driver(folder, [str(folder / "probe.py"), "trap"], forked=name == "forked")
        deadline = time.monotonic() + 60
        while not (folder / "out").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        report = _report(folder)
        assert (report["pid"] == driver.pid) == (name == "fresh")
        if name == "forked":
            assert report["pgid"] == report["pid"]  # its own group: a signal to the client's group is not doubled
        driver.send_signal(signal.SIGTERM)
        try:
            status, _, atexit_ran, _ = _finish(driver, folder)
        finally:
            driver.kill()  # only a driver the signal did not reach is still running
        assert (status, atexit_ran) == (7, True), name
