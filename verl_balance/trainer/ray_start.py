"""Starting the embedded Ray cluster, and starting it early: at process start, beside the driver's imports.

This module imports Ray and the standard library only (no torch, no config package), so a recipe's entry
point can call ``start_embedded_early`` before it imports anything heavy. Invariants:

- ``embedded_defaults()`` are ``ray.init``'s arguments for the embedded cluster when the user gives no
  ``ray_kwargs.ray_init`` and no address; ``cluster.ray_init_arguments`` merges the user's over them.
- An early start runs ``start_embedded(embedded_defaults())`` in one thread that then parks for the process's
  lifetime (Ray ties the cluster's processes to the thread that started them).
  ``take_early_start(wanted)`` waits for it; the cluster is the run's only when ``wanted`` equals the
  arguments it started with, else it is shut down (and a start that failed is forgotten) before the
  caller starts what the config asks. A start that failed with the wanted arguments raises its error there.
- At the driver's exit (a config error or Ctrl-C before the start was taken included) the start finishes and
  the cluster stops, before Ray's own exit hook: no Ray process outlives the driver. Then ``gc.freeze()``
  spares the interpreter's final collection (``_EarlyStart.at_exit``).
- The cluster's processes block SIGINT / SIGTERM (they inherit the starting thread's mask), so a signal
  to the driver's process group reaches the driver's handlers alone, early start or not.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import inspect
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence

import ray

from verl_balance.single_controller import forked_workers, setup_worker
from verl_balance.trainer.signals import STOP_SIGNALS, RunInterrupted, interrupt_handlers, stop_signals_blocked

logger = logging.getLogger(__name__)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"

CPU_WORKERS_PER_CORE = 4
"""CPU slots an embedded cluster offers per core (CPU workers mostly wait on collectives)."""


def embedded_cluster_cpus() -> int:
    """CPU slots of an embedded cluster: sized to this machine (cores usable by this process), never to a request."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPU_WORKERS_PER_CORE * max(1, cores)


EMBEDDED_WORKER_NICENESS = 0
"""Niceness of the embedded cluster's workers (Ray's default 15 lets other processes pre-empt the ranks)."""


INLINE_ARGUMENT_BYTES = 1 << 20
"""The embedded cluster's ``max_direct_call_object_size``: arguments up to it travel inline, not via the store."""

WORKER_WARNINGS = "ignore::FutureWarning"
"""The workers' ``PYTHONWARNINGS`` unless the user set one (libraries' FutureWarnings, once per worker, are noise)."""


def worker_warning_env() -> dict[str, str]:
    """{"PYTHONWARNINGS": WORKER_WARNINGS}, or {} when the user set PYTHONWARNINGS."""
    return {} if os.environ.get("PYTHONWARNINGS") else {"PYTHONWARNINGS": WORKER_WARNINGS}


def plain_worker_prefixes(stream) -> None:
    """On a ``stream`` that is not a terminal, drop Ray's colour codes from worker prefixes unless the user chose."""
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


EMBEDDED_START_CONFIG = {"prestart_worker_first_driver": False, "enable_metrics_collection": False}
"""Start-up work the embedded cluster skips (prestarted idle workers, metrics export); ``_system_config`` overrides."""


def environment_address() -> str | None:
    """``RAY_ADDRESS``, the cluster Ray's own ``ray.init()`` would join; ``None`` when unset or ``local``
    (a new embedded cluster, which is what no address gives)."""
    address = os.environ.get("RAY_ADDRESS")
    return None if address == "local" else address or None


def worker_runtime_env() -> dict:
    """The job's ``runtime_env``: no progress bars in the workers (Ray would print them late, after the driver's
    lines)."""
    quiet = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return {"env_vars": {**quiet, **worker_warning_env()}}


def embedded_defaults() -> dict:
    """``ray.init``'s arguments for the embedded cluster, before the user's ``ray_kwargs.ray_init``."""
    return dict(
        # Without an address Ray would join the last `ray start` cluster on this machine (its
        # /tmp/ray/ray_current_cluster file, even a dead one) and then refuse num_cpus.
        address="local",
        num_cpus=embedded_cluster_cpus(),
        include_dashboard=False,
        runtime_env=worker_runtime_env(),
        log_to_driver=True,
        _system_config={
            "worker_niceness": EMBEDDED_WORKER_NICENESS,
            "max_direct_call_object_size": INLINE_ARGUMENT_BYTES,
            **EMBEDDED_START_CONFIG,
        },
    )


EMBEDDED_START_ATTEMPTS = 3
"""Tries of the embedded cluster's start when Ray's fixed 30 s node-registration wait times out."""

_START_TIMEOUT_TEXTS = ("timed out during startup", "waiting for node to startup", "Timed out")


class RayStartError(RuntimeError):
    """The embedded Ray cluster did not start (names what timed out and the ways around it)."""


EMBEDDED_NODE_PARAMETERS = {
    "dashboard_agent_listen_port": 0,
    "no_monitor": True,
    "setup_worker_path": setup_worker.__file__,
}
"""Ray node parameters ``ray.init`` does not take, for the embedded node: the dashboard agent binds a free port
(Ray's fixed 52365, held by any other Ray instance on the machine, costs 5 retries and 3.3 s), no autoscaler
monitor runs (a fixed local cluster has nothing to scale; a worker group that cannot be placed raises
``UnplaceableResourcePoolError`` itself), and workers are set up by ``single_controller/setup_worker.py`` (Ray's
set-up step without importing Ray). A parameter this Ray lacks is left out; one the caller gives wins."""


@contextlib.contextmanager
def _replaced(owner, name: str, replacement) -> Iterator[None]:
    """While in it, ``owner.name`` is ``replacement(original)``; unchanged when there is no ``owner`` (another Ray
    version) or it has no ``name``."""
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        yield
        return
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _with_embedded_defaults(init):
    known = set(inspect.signature(init).parameters)
    defaults = {name: value for name, value in EMBEDDED_NODE_PARAMETERS.items() if name in known}

    def init_with_embedded_defaults(self, *args, **kwargs):
        init(self, *args, **{**defaults, **kwargs})

    return init_with_embedded_defaults


def _api_server_only_with_dashboard(start_api_server):
    def start_api_server_for_dashboard(self, *, include_dashboard, **kwargs):
        if include_dashboard is False:
            return None  # without a dashboard, Ray's API server would serve only its usage-stats reporter
        return start_api_server(self, include_dashboard=include_dashboard, **kwargs)

    return start_api_server_for_dashboard


@contextlib.contextmanager
def embedded_node_parameters() -> Iterator[None]:
    """While in it, a Ray node started takes ``EMBEDDED_NODE_PARAMETERS`` as its defaults, and a head node
    started with ``include_dashboard=False`` starts no API server (Ray's ``dashboard.py`` process: with the
    dashboard off it loads only the usage-stats module, ~1 CPU s at start, and ``ray.init`` waits for it)."""
    private = getattr(ray, "_private", None)
    params = getattr(getattr(private, "parameter", None), "RayParams", None)
    node = getattr(getattr(private, "node", None), "Node", None)
    with (
        _replaced(params, "__init__", _with_embedded_defaults),
        _replaced(node, "start_api_server", _api_server_only_with_dashboard),
    ):
        yield


def start_embedded(kwargs: Mapping) -> None:
    """Start the embedded cluster with ``ray.init(**kwargs)``: its processes ignore a group SIGTERM / SIGINT, its
    node takes ``EMBEDDED_NODE_PARAMETERS``, its workers are forks of a preloaded interpreter
    (``with_preloaded_workers``), and its shutdown kills at once."""
    # Ray warns on every start that it enabled token authentication (its default): a notice for the
    # embedded cluster's log, not a warning on every run's console.
    logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
    with stop_signals_blocked(), embedded_node_parameters():  # the preload server inherits the blocked signals too
        init_embedded(**with_preloaded_workers(kwargs))
    stop_without_sigterm_at_shutdown()


PRELOADED_WORKERS_ENV = "VERL_BALANCE_PRELOADED_WORKERS"
"""``0``: the embedded cluster's workers start as fresh interpreters (Ray's way); ``1``: as forks of a preloaded one
even on a machine with accelerators; unset: forks where the machine has none (``accelerator_device_nodes``)."""

ACCELERATOR_DEVICE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/davinci[0-9]*", "/dev/accel/accel[0-9]*")
"""Device nodes of GPUs and NPUs (NVIDIA, AMD ROCm, Ascend, the kernel's accel class): forked workers are not
yet proven with a CUDA/ROCm runtime in them, so such a machine keeps Ray's fresh workers unless asked."""

_OWN_PYTHON_FIELDS = ("py_executable", "pip", "uv", "conda", "container", "image_uri")
"""``runtime_env`` fields that give the workers another interpreter or environment than the driver's."""


_MODEL_PATH_KEYS = ("model.path", "model.partial_pretrain")
"""Override keys (their last dotted parts) that name a Hugging Face model directory: its workers import transformers."""


def worker_preload(argv: Sequence[str]) -> tuple[str, ...]:
    """The modules the workers of a command line ``argv`` import before our code: transformers only when an
    override names a model directory (the built-in model's workers never import it: ~2 CPU s saved at start)."""
    overrides = (arg.split("=", 1) for arg in argv if "=" in arg)
    if any(key.lstrip("+").endswith(_MODEL_PATH_KEYS) and value not in ("", "null") for key, value in overrides):
        return forked_workers.WORKER_PRELOAD
    return tuple(module for module in forked_workers.WORKER_PRELOAD if not module.startswith("transformers"))


_preload: tuple[str, ...] = forked_workers.WORKER_PRELOAD


def with_preloaded_workers(kwargs: Mapping) -> dict:
    """``kwargs`` with the job's ``runtime_env.py_executable`` the client of a preloaded-worker server: each worker
    a fork of an interpreter that has imported torch and tensordict (and transformers) once, instead of importing
    them itself (``single_controller/forked_workers.py``). The server is the one ``SOCKET_ENV`` names, else one
    started now, beside the cluster, without waiting for its imports (a worker waits for them). ``kwargs``
    unchanged when ``PRELOADED_WORKERS_ENV`` says so (unset: on a machine with accelerators), without pidfd_open
    (off Linux, kernels before 5.3), or when the ``runtime_env`` brings its own interpreter or packages."""
    runtime_env = dict(kwargs.get("runtime_env") or {})
    if not _preloaded_workers_wanted() or any(runtime_env.get(field) for field in _OWN_PYTHON_FIELDS):
        return dict(kwargs)
    socket_path = os.environ.get(forked_workers.SOCKET_ENV)
    if not socket_path:
        socket_path = _server_socket_path()
        env = {**os.environ, **{k: str(v) for k, v in (runtime_env.get("env_vars") or {}).items()}}
        forked_workers.start_server(socket_path, env=env, preload=_preload, wait_s=None)  # exits with this process
        os.environ[forked_workers.SOCKET_ENV] = socket_path
    return {**kwargs, "runtime_env": {**runtime_env, "py_executable": forked_workers.client_command(socket_path)}}


def _preloaded_workers_wanted() -> bool:
    switch = os.environ.get(PRELOADED_WORKERS_ENV, "")
    if switch == "0" or not _pidfd_supported():
        return False
    return switch == "1" or not accelerator_device_nodes()


def accelerator_device_nodes() -> list[str]:
    """This machine's accelerator device nodes (``ACCELERATOR_DEVICE_GLOBS``)."""
    import glob

    return [path for pattern in ACCELERATOR_DEVICE_GLOBS for path in glob.glob(pattern)]


def _pidfd_supported() -> bool:
    """Whether this kernel has pidfd_open (Linux 5.3+), which the server's waiters use; False elsewhere."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def _server_socket_path() -> str:
    """A socket path in a new private folder (a socket path has at most 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="vb_workers_")
    if len(folder) > 80:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="vb_workers_", dir="/tmp")
    return os.path.join(folder, "socket")


def init_embedded(**kwargs) -> None:
    """``ray.init(**kwargs)``, retried on a start-up timeout; then ``RayStartError`` naming what timed out."""
    for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as err:
            if not any(text in str(err) for text in _START_TIMEOUT_TEXTS):
                raise
            ray.shutdown()  # stop what the failed attempt started before trying again
            if attempt == EMBEDDED_START_ATTEMPTS:
                raise RayStartError(
                    f"the embedded Ray cluster did not start in {attempt} attempts: its node (raylet) did not "
                    f"register with Ray's GCS within Ray's fixed 30 s start-up limit ({err}); the machine is "
                    "probably overloaded. Retry when it is less busy, or start Ray yourself (ray start --head) "
                    "and set trainer.ray_address=auto"
                ) from err
            logger.warning(
                "embedded Ray start-up timed out (%s); retrying (attempt %d of %d)",
                err,
                attempt + 1,
                EMBEDDED_START_ATTEMPTS,
            )


def stop_without_sigterm_at_shutdown() -> None:
    """Stop the embedded cluster's processes with SIGKILL at once (they block SIGTERM)."""
    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    if kill_all is None:
        return  # another Ray version: the shutdown keeps its graceful wait

    def kill_all_at_once(*args, **kwargs):
        kwargs["allow_graceful"] = False
        return kill_all(*args, **kwargs)

    node.kill_all_processes = kill_all_at_once


# ----------------------------------------------------------------------------- the early start

_EARLY_START_NOTICES = ("SIGTERM handler is not set", "Started a local Ray instance")
"""Ray's lines an early start drops: its SIGTERM handler is the main thread's business (the driver keeps its own),
and the start's announcement would land in the middle of the driver's lines, even after a config error."""


class _EarlyStart:
    """One embedded start in a background thread that then lives as long as the process: Ray starts the
    cluster's processes with ``PR_SET_PDEATHSIG`` (killed when the *thread* that started them ends), so
    the thread parks instead of returning. ``started`` is set when the start returned or raised (``error``)."""

    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.taken = False
        self.thread = threading.Thread(target=self._run, name="verl_balance-early-ray-start", daemon=True)

    def at_exit(self) -> None:
        """The driver's exit, before Ray's own hook (registered at Ray's import; atexit runs last-in first-out):
        the start finishes, the cluster stops as Ray's hook would stop it (after Ray's short wait for the
        workers' last log lines, when the start was taken and workers ran), then ``gc.freeze()``: the
        interpreter's final collection skips the objects left (torch's, Ray's: seconds of CPU at every exit;
        Python does not promise finalizers of objects alive at exit)."""
        self.started.wait()
        if ray.is_initialized():
            ray.shutdown(_exiting_interpreter=self.taken)
        gc.freeze()

    def _run(self) -> None:
        # Blocked here, a stop signal goes to the main thread's handlers; the cluster's processes inherit the mask.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        ray_worker_logger = logging.getLogger("ray._private.worker")
        quiet = _DropMessages(_EARLY_START_NOTICES)
        ray_worker_logger.addFilter(quiet)
        try:
            start_embedded(copy.deepcopy(self.kwargs))  # ray.init adds to the _system_config it is given
        except BaseException as err:  # handed to take_early_start, in the main thread
            self.error = err
        finally:
            ray_worker_logger.removeFilter(quiet)
            self.started.set()
        threading.Event().wait()  # the cluster's processes live while this thread does: until the process ends


class _DropMessages(logging.Filter):
    def __init__(self, texts: Sequence[str]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.texts)


_early: _EarlyStart | None = None


def start_embedded_early(argv: Sequence[str]) -> bool:
    """Start the embedded cluster with ``embedded_defaults()`` in a background thread, for a recipe command line
    ``argv`` that will train; False (nothing started) when Ray is up already, ``RAY_ADDRESS`` names a cluster,
    or ``argv`` has a flag (``--help``, ``--cfg``, ``-m``: Hydra prints or composes, no run)."""
    global _early, _preload
    if _early is not None or ray.is_initialized() or environment_address() or any(a.startswith("-") for a in argv):
        return False
    plain_worker_prefixes(sys.stdout)
    _preload = worker_preload(argv)
    _early = _EarlyStart(embedded_defaults())
    atexit.register(_early.at_exit)
    _early.thread.start()
    return True


def take_early_start(wanted: Mapping | None) -> bool:
    """Wait for the early start, if any. True: it started the cluster with exactly ``wanted`` (the run's now).
    False: there was none, or it was not what the config asks (``wanted`` another cluster, ``None`` for one
    to join): a cluster it started is shut down. Raises the start's error when the arguments were wanted."""
    global _early
    early, _early = _early, None
    if early is None:
        return False
    early.started.wait()
    early.taken = True
    if early.kwargs == wanted:
        if early.error is not None:
            raise early.error
        return True
    if ray.is_initialized():
        ray.shutdown()
    return False


@contextlib.contextmanager
def stops_at_once_before_the_run() -> Iterator[None]:
    """A recipe's command line around everything it does: SIGINT / SIGTERM outside the training steps print one
    line and exit with 128 + signal (``RunInterrupted``; the run's own handling inside it wins). Before the early
    start was taken (imports, the override check, Hydra's compose) nothing of the run exists and the process ends
    at once (``os._exit``): a cluster still starting dies with it (Ray ties its daemons to the starting thread's
    life, the preload server watches its driver)."""
    try:
        with interrupt_handlers():
            yield
    except RunInterrupted as stop:
        print(f"error: {stop}", file=sys.stderr, flush=True)
        if _early is not None:
            sys.stdout.flush()
            os._exit(stop.exit_code)
        raise SystemExit(stop.exit_code) from None
