"""Commands run in the test process: their ``main`` called directly, as ``launch/*.py``
calls it, instead of a fresh interpreter that would spend seconds importing torch,
DeepSpeed and torch._dynamo again. Process behaviour itself (exit codes of the scripts,
stderr, signals, several ranks) is tested with real processes elsewhere."""
from __future__ import annotations

import contextlib
import io
import sys

import torch


@contextlib.contextmanager
def one_thread():
    """One intra-op thread, as a launched rank with OMP_NUM_THREADS=1 computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def call_main(main, args) -> tuple[int, str, str]:
    """``main(args)`` on one thread: ``(exit status, stdout, stderr)``. A returned status or
    ``SystemExit`` reads as the interpreter reads it (``_dist.exit_status``: a string is
    status 1 with the message on stderr); any other exception escapes, failing the test as
    a traceback would."""
    from _dist import exit_status
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), one_thread():
        try:
            status = main(list(args))
        except SystemExit as exit_:
            status = exit_.code
    return exit_status(status, err), out.getvalue(), err.getvalue()


def train_here(args) -> str:
    """``launch/train.py *args`` as one rank in a one-process world on one thread; its
    console output (printed, last part, if the run fails)."""
    from _dist import one_process_world
    from ds_pfc.cli.train import run
    out = io.StringIO()
    try:
        with one_process_world(), one_thread(), contextlib.redirect_stdout(out):
            run(list(args))
    except BaseException:
        sys.stdout.write(out.getvalue()[-4000:])
        raise
    return out.getvalue()
