"""Worker processes forked from a preloaded interpreter: torch, tensordict and transformers imported once.

A *preload server* imports ``WORKER_PRELOAD`` (the modules of them that are installed) once; each worker is a
fork of it instead of a fresh interpreter. A Ray job whose ``runtime_env`` has ``py_executable =
client_command(socket)`` starts every worker through the stdlib-only client: the server forks the worker, which
takes over the client's argv, environment, directory, streams and process group; the client exits with the
worker's status. The embedded cluster's jobs use it (``trainer/ray_start.py``); the test suite also forks its
subprocess drivers (``--driver``, ``verl_balance/testing/forked_workers.py``).

Invariants (asserted by the server; tests/test_forked_workers.py and tests/trainer/test_preloaded_workers.py check
the rest):
- only third-party modules are preloaded: Ray, verl and verl_balance are imported in the worker;
- the server has one thread (it runs with ``OMP_NUM_THREADS=1``) and has run no torch op when it forks;
  a worker then sizes torch's thread pool as a fresh interpreter would from its own ``OMP_NUM_THREADS``;
- the server exits when the process that started it does;
- a client whose server is gone, or in another session, runs its worker as a fresh interpreter.
Forks share the server's ``PYTHONHASHSEED``; random generators are reseeded per worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

__all__ = [
    "SOCKET_ENV",
    "WORKER_PRELOAD",
    "client_argv",
    "client_command",
    "reseed_like_a_fresh_process",
    "start_server",
]

# Third-party modules every worker imports before our code. Not pyarrow (nor pandas or datasets, which
# import it): it starts a thread when imported, and a fork of a process with a second thread may inherit a
# lock that thread held.
WORKER_PRELOAD = ("torch", "torch.distributed.tensor", "tensordict", "transformers", "transformers.modeling_utils")
# Path of the running server's socket, for the processes of a driver that started or was given one.
SOCKET_ENV = "VERL_BALANCE_FORKED_WORKERS_SOCKET"
_NOT_PRELOADED = ("ray", "verl", "verl_balance")
_HEADER = struct.Struct("!i")
# The server's answer to a client in another session (Linux lets a process join a process group of its
# own session only): that client starts the worker as a fresh interpreter.
_NOT_FORKED = -1
_DRIVER = "--driver"
# The stdlib-only client (this file without site): a Ray worker's py_executable, a driver's command.
_CLIENT = (sys.executable, "-S", os.path.abspath(__file__))
# How long a client waits for a server that is still importing (it started beside the cluster).
SERVER_WAIT_S = 300.0


def client_argv(socket_path: str, *, driver: bool = False) -> list[str]:
    """The client's command line, before the worker's own arguments (``driver``: a driver in its own group)."""
    return [*_CLIENT, *((_DRIVER,) if driver else ()), socket_path]


def client_command(socket_path: str) -> str:
    """The ``py_executable`` that starts a Ray job's workers as forks of the server at ``socket_path``."""
    return " ".join(client_argv(socket_path))


def start_server(
    socket_path: str, *, env: dict[str, str], preload: tuple[str, ...] = WORKER_PRELOAD, wait_s: float | None = 120.0
):
    """Start the server (a ``subprocess.Popen``) with the workers' base environment, preloading ``preload``;
    wait until it listens (``wait_s=None``: return at once, clients wait for it). Its pid goes to
    ``socket_path + ".pid"`` so a waiting client can tell a server still importing from a dead one."""
    import selectors
    import subprocess

    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # each worker's own PYTHONPATH applies
    env["OMP_NUM_THREADS"] = "1"  # no OpenMP pool in the server; a worker sizes its own (become_worker)
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # a CUDA availability check in an import stays fork-safe
    command = [sys.executable, os.path.abspath(__file__), "--serve", socket_path, ",".join(preload)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE)
    with open(socket_path + ".pid", "w") as f:
        f.write(str(server.pid))
    if wait_s is None:
        return server
    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        if not selector.select(wait_s) or server.stdout.readline() != b"ready\n":
            server.kill()
            raise RuntimeError(f"the forked-worker server did not start within {wait_s:.0f} s")
    return server


def _send_with_fds(sock: socket.socket, payload: bytes, fds: tuple[int, ...]) -> None:
    socket.send_fds(sock, [_HEADER.pack(len(payload)) + payload], list(fds))


def _receive(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise ConnectionError("the forked-worker server closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive_int(sock: socket.socket) -> int:
    return _HEADER.unpack(_receive(sock, _HEADER.size))[0]


def client_main(socket_path: str, argv: list[str], *, driver: bool = False) -> int:
    """The process Ray (or a test, for a ``driver``) starts: have the server fork the worker, then stand
    in for it until it exits, with its exit status. A Ray worker joins this process's group (the raylet
    signals groups); a driver gets its own group, and this process forwards signals to it."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if driver:  # held until the driver's pid is known, then passed on
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    else:
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)
    sock = _connect(socket_path)
    if sock is None:  # no server to fork from: run the worker here
        for signum in signals:
            signal.signal(signum, signal.SIG_DFL)
        if driver:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        os.execv(sys.executable, [sys.executable, *argv])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "driver": driver}
    request.update(process_group=os.getpgid(0), session=os.getsid(0), oom_score_adj=_oom_score_adj())
    _send_with_fds(sock, json.dumps(request).encode(), (0, 1, 2))
    pid = _receive_int(sock)
    if pid == _NOT_FORKED:  # a worker in another session: run it here
        sock.close()
        for signum in signals:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, *argv])
    if driver:
        for signum in signals:
            signal.signal(signum, lambda signum, _frame: _pass_on(signum, pid))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    return _receive_int(sock)


def _connect(socket_path: str) -> socket.socket | None:
    """A connection to the server; waits while it is still importing. None (with a line on stderr) when it
    is gone or did not listen within ``SERVER_WAIT_S``."""
    deadline = time.monotonic() + SERVER_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if not _server_alive(socket_path) or time.monotonic() > deadline:
            print(f"verl_balance: no preloaded-worker server at {socket_path}: a fresh interpreter", file=sys.stderr)
            return None
        time.sleep(0.02)


def _server_alive(socket_path: str) -> bool:
    """Whether the server that ``start_server`` recorded for ``socket_path`` still runs (True while unknown)."""
    try:
        with open(socket_path + ".pid") as f:
            pid = int(f.read())
    except (OSError, ValueError):  # written right after the server's start: not there yet, unless no folder
        return os.path.isdir(os.path.dirname(socket_path))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _oom_score_adj() -> str | None:
    """This process's ``oom_score_adj``; None where there is none."""
    try:
        with open("/proc/self/oom_score_adj") as adj:
            return adj.read().strip()
    except OSError:
        return None


def _pass_on(signum: int, pid: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # the driver has just exited: its status is on its way


def reseed_like_a_fresh_process() -> None:
    """In a fork: reseed torch and numpy as a fresh interpreter would, so forked ranks do not share a
    seed (which would hide a missing seed broadcast)."""
    sys.modules["torch"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def threads_like_a_fresh_process() -> None:
    """In a fork: torch's intra-op threads as a fresh interpreter sets them (the server imported torch with 1):
    this process's ``OMP_NUM_THREADS`` up to the machine's CPUs, else one per usable core."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        threads = min(int(value), os.cpu_count() or 1)
    else:
        threads = len(os.sched_getaffinity(0))
    sys.modules["torch"].set_num_threads(threads)


def become_worker(request: dict, fds: list[int]) -> None:
    """In the worker: the client's streams, directory, environment and PYTHONPATH; run its script or
    (``-m``) module as ``python`` would."""
    import runpy

    os.setpgid(0, 0 if request["driver"] else request["process_group"])
    if request.get("oom_score_adj") is not None:  # the OOM killer's choice as for the client, not the server
        try:
            with open("/proc/self/oom_score_adj", "w") as adj:
                adj.write(request["oom_score_adj"])
        except OSError:
            pass  # lowering it takes a privilege: the server's stays
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    reseed_like_a_fresh_process()
    threads_like_a_fresh_process()
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # As the interpreter builds it: the script's folder (the working directory for -m), then
    # PYTHONPATH, then the standard entries.
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *python_path, *sys.path[1:]]
    if module:
        sys.argv = argv[1:]  # run_module puts the module's file name first, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _kill_when_client_leaves(conn: socket.socket, pid: int) -> None:
    """In the waiter: return when the worker exits; SIGKILL it first if the client goes."""
    import select

    worker = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([conn, worker], [], [])
            if worker in ready:
                return
            if not conn.recv(1):  # the client never writes: readable means it closed
                os.kill(pid, signal.SIGKILL)
                return
    finally:
        os.close(worker)


def _wait_for_worker(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """In the waiter: read a request and fork its worker; returns it in the worker, exits in the waiter."""
    header, fds, _flags, _address = socket.recv_fds(conn, _HEADER.size, 3)
    request = json.loads(_receive(conn, _HEADER.unpack(header)[0]))
    if not request["driver"] and request["session"] != os.getsid(0):
        conn.sendall(_HEADER.pack(_NOT_FORKED))  # it could not join the client's process group
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        return request, fds
    for fd in fds:
        os.close(fd)
    conn.sendall(_HEADER.pack(pid))
    _kill_when_client_leaves(conn, pid)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.sendall(_HEADER.pack(code if code >= 0 else 128 - code))  # a signal: the shell's 128+N
    except OSError:
        pass
    os._exit(0)


def _hide_unloadable_torch_extensions() -> None:
    """``utils/torch_extensions.py``'s torchvision hiding, without importing the package."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "utils", "torch_extensions.py")
    spec = importlib.util.spec_from_file_location("_forked_workers_torch_extensions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.hide_unloadable_extensions()


def _preload(modules: list[str]) -> bool:
    """Import the installed ones of ``modules``; False (with one line on stderr) when an import fails."""
    import importlib
    import importlib.util

    _hide_unloadable_torch_extensions()
    for name in modules:
        if importlib.util.find_spec(name.split(".", 1)[0]) is None:
            continue  # not installed (peft without LoRA): a worker that needs it fails there as usual
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any failure: the workers start as fresh interpreters
            print(f"verl_balance: preloading {name} failed ({err!r}): fresh worker interpreters", file=sys.stderr)
            return False
    loaded = [name for name in _NOT_PRELOADED if name in sys.modules]
    assert not loaded, f"the forked-worker server imported {loaded}: a worker must import them itself"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a fork would inherit a CUDA context it cannot use
        print("verl_balance: preloading initialized CUDA: fresh worker interpreters", file=sys.stderr)
        return False
    threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
    assert threads == 1, f"the forked-worker server has {threads} threads (OMP_NUM_THREADS unset?)"
    return True


def serve(socket_path: str, modules: list[str]) -> tuple[dict, list[int]]:
    """Preload ``modules`` and fork a waiter per connection; returns only in a worker (its request)."""
    parent = os.getppid()
    if not _preload(modules) or os.getppid() != parent:  # a failed import, or the driver gone meanwhile
        _remove_server_files(socket_path)
        sys.exit(0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(128)
    server.settimeout(1.0)
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            work = _wait_for_worker(conn)
            if work is not None:
                return work
        conn.close()
    _remove_server_files(socket_path)
    sys.exit(0)


def _remove_server_files(socket_path: str) -> None:
    """The socket, its pid file and the folder made for them (when nothing else is in it)."""
    for path in (socket_path, socket_path + ".pid"):
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(socket_path))


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        # only a worker gets past serve; it exits as a fresh interpreter would
        become_worker(*serve(sys.argv[2], [m for m in sys.argv[3].split(",") if m]))
    elif sys.argv[1] == _DRIVER:
        sys.exit(client_main(sys.argv[2], sys.argv[3:], driver=True))
    else:
        sys.exit(client_main(sys.argv[1], sys.argv[2:]))
