"""Run a function on ``world_size`` CPU ranks with the gloo backend.

``run_ranks(fn, world_size, *args)`` spawns the ranks, calls ``fn(rank, world_size,
*args)`` in each (``fn`` must be a module-level function), and returns the list of
their return values (anything ``torch.save`` can store). An exception in any rank
fails the calling test with that rank's traceback.

Ranks are forked from a fork server that imported torch, DeepSpeed and ds_pfc once per
test process (a 3-rank call costs ~0.3 s instead of ~2.4 s of fresh interpreters); each
rank takes the caller's environment as it is at the call. ``DS_PFC_TEST_START_METHOD=spawn``
starts fresh interpreters instead.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What every rank imports anyway, loaded once into the fork server (below).
# (torch._dynamo: torch's optimizers import it when they take their first parameters, ~1.5 s.)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "deepspeed", "ds_pfc", "ds_pfc.core.head",
            "ds_pfc.deepspeed_plugin", "ds_pfc.cli.train", "_dist"]


def _entry(rank, world_size, init_file, out_dir, fn, args, env=None):
    if env is not None:       # the caller's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    # A native abort (SIGABRT, SIGSEGV) prints every thread's Python stack, so a failure
    # in C++ code under a rank says where it happened.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    # A collective that some rank never joins fails after 2 minutes instead of hanging.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every rank's result is on disk and all passed the barrier: leave without the
    # interpreter's finalization. A rank once aborted in native code with no Python error
    # ("terminate called without an active exception", gloo and DeepSpeed threads being
    # the native ones alive); at exit such an abort says nothing about the code under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args):
    # A fresh port for workers that set up DeepSpeed's env:// rendezvous themselves.
    os.environ["DS_PFC_TEST_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        method = os.environ.get("DS_PFC_TEST_START_METHOD", "forkserver")
        if method == "forkserver":
            # Ranks fork from a server that imported torch, DeepSpeed and ds_pfc once
            # (~50 ms a rank instead of ~1.5 s of imports in a fresh interpreter).
            import multiprocessing
            multiprocessing.set_forkserver_preload(_PRELOAD)
        mp.start_processes(_entry, args=(world_size, init_file, tmp, fn, args, dict(os.environ)), nprocs=world_size,
                           join=True, start_method=method)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def exit_status(code, stderr) -> int:
    """The exit status the interpreter makes of ``sys.exit(code)``: 0 for None, an int as
    it is, anything else printed to ``stderr`` and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=stderr)
    return 1


def _script_entry(code, argv, env, cwd, out_dir):
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "out"), (2, "err")):     # as a subprocess's pipes: files of its own
        f = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    status = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        faulthandler.enable(all_threads=True)
        torch.set_num_threads(1)
        sys.argv = ["-c", *argv]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        status = exit_status(stop.code, sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def command_code(module: str) -> str:
    """``python -c`` code that runs command ``module``'s ``main`` on the arguments, as the
    launch scripts and console scripts do (for run_script_ranks)."""
    return f"import sys\nfrom {module} import main\nsys.exit(main(sys.argv[1:]))\n"


TRAIN = command_code("ds_pfc.cli.train")      # launch/train.py

# multiprocessing reads a fork-server child's exit status off a pipe once, and
# Process.start() polls every other child first: two threads starting and waiting at once
# (the accuracy guard's two runs) could both read one status, and one would see 255.
_EXIT_LOCK = threading.Lock()


class ForkedProcess:
    """What the tests use of ``subprocess.Popen`` (``pid``, ``poll``, ``send_signal``,
    ``kill``, ``communicate``, ``returncode``), for a process forked from the fork server;
    its stdout and stderr go to files of its own until ``communicate`` reads them.

    It runs ``code`` as ``python -c`` would, with its own environment, working directory,
    signals and exit status, but it is not a fresh interpreter: modules come from the fork
    server (``PYTHONPATH`` and import-time settings of ``env`` do not apply), it computes
    on one thread, and it leaves with ``os._exit`` after flushing its output, without the
    interpreter's shutdown (the launcher tests and ``launch/train.py``'s own tests run
    real interpreters)."""

    def __init__(self, code: str, argv, env: dict, cwd: str):
        import multiprocessing
        import shutil
        import weakref
        multiprocessing.set_forkserver_preload(_PRELOAD)
        self._dir = tempfile.mkdtemp(prefix="ds_pfc-forked-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_script_entry, args=(code, list(argv), dict(env), cwd, self._dir))
        with _EXIT_LOCK:
            self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        with _EXIT_LOCK:
            return self._process.exitcode

    def send_signal(self, sig):
        os.kill(self.pid, sig)

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, 9)
        self.wait()

    def wait(self, timeout=None):
        from multiprocessing.connection import wait
        wait([self._process.sentinel], timeout)
        return self.poll()

    def communicate(self, timeout=None):
        import subprocess
        if self.wait(timeout) is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)

        def read(name):
            path = os.path.join(self._dir, name)
            if not os.path.exists(path):
                return ""
            with open(path, errors="replace") as f:
                return f.read()
        return read("out"), read("err")


def start_script_ranks(code: str, argv, envs, cwd: str) -> list:
    """``python -c code *argv`` as one process per environment of ``envs`` (a rank's
    ``RANK``, ``WORLD_SIZE``, ... are the caller's to set), started and not waited for:
    :class:`ForkedProcess` objects forked from the fork server, so a rank of the train
    command costs no imports (``DS_PFC_TEST_START_METHOD`` set to anything but
    ``forkserver``: ``subprocess.Popen`` of fresh interpreters)."""
    if os.environ.get("DS_PFC_TEST_START_METHOD", "forkserver") != "forkserver":
        import subprocess
        return [subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for env in envs]
    return [ForkedProcess(code, argv, env, cwd) for env in envs]


def run_script_ranks(code: str, argv, envs, cwd: str, timeout: float = 600):
    """:func:`start_script_ranks` and wait: ``(exit codes, [(stdout, stderr)])``. A rank
    still running after ``timeout`` seconds (or any error while waiting) kills them all;
    a timeout fails with their stderr."""
    import subprocess
    import time
    procs = start_script_ranks(code, argv, envs, cwd)
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=max(0.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        kill_all(procs)
        tails = [p.communicate()[1][-3000:] for p in procs[len(results):]]
        raise TimeoutError(f"ranks ran past {timeout} s:\n" + "\n".join(tails)) from None
    except BaseException:
        kill_all(procs)
        raise
    return [p.returncode for p in procs], results


def run_train_forked(argv, env: dict, cwd: str) -> tuple[int, str, str]:
    """The train command with ``argv`` in one process forked from the fork server:
    ``(exit code, stdout, stderr)`` (the ``launch`` hook of the benchmark runners)."""
    [code], [(stdout, stderr)] = run_script_ranks(TRAIN, argv, [env], cwd)
    return code, stdout, stderr


def kill_all(procs) -> None:
    """Kill those of ``procs`` still running (a test that stops early leaves none behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT: DeepSpeed names its shared
    memory after the port, so a fixed one can meet a stale buffer of an earlier run)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forget_deepspeed_groups() -> None:
    """Drop what DeepSpeed cached from a process group: its world group, its data- and
    model-parallel groups and its comm backend live in module globals, and a later
    in-process run would otherwise meet groups of a destroyed process group ("Group
    ... is not registered")."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            if isinstance(getattr(groups, name, None), dict):
                getattr(groups, name).clear()
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                     "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "mesh_device"):
            if hasattr(groups, name):
                setattr(groups, name, None)
    sequence_parallel = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if sequence_parallel is not None and hasattr(sequence_parallel, "_release_sequence_parallel_groups"):
        sequence_parallel._release_sequence_parallel_groups()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None


@contextlib.contextmanager
def one_process_world():
    """The ``env://`` variables of a one-process world on a free port, for running the
    app in-process; afterwards the process group is destroyed, DeepSpeed's CPU
    shared-memory buffers of that port are removed and the variables restored. DeepSpeed's
    cached groups are dropped on entry and on exit: a world starts with none of another's."""
    import glob
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    port = free_port()
    forget_deepspeed_groups()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        yield port
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_deepspeed_groups()
        for name in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
            os.remove(name)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
