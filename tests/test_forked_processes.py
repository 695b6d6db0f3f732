"""The tests' forked processes (``tests/_dist.start_script_ranks``) behave as ``python -c``
does for what the tests read of them: exit status, stdout, stderr, argv, environment,
working directory and signals. Reference: the same code run by a fresh interpreter."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from _dist import ForkedProcess, run_script_ranks

CASES = {
    "exit code": ("import sys\nprint('a')\nsys.exit(3)", []),
    "exception": ("raise ValueError('boom')", []),
    "exit message": ("import sys\nsys.exit('a message')", []),
    "argv, env, cwd": ("import os, sys\nprint(sys.argv[1:], os.environ['DS_PFC_X'], os.getcwd())\n"
                       "print('to stderr', file=sys.stderr)", ["--a_b", "1"]),
    "returns": ("print('done')", []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_forked_process_reports_what_a_fresh_interpreter_reports(name, tmp_path):
    code, argv = CASES[name]
    env = dict(os.environ, DS_PFC_X="x")
    ref = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=60)
    [status], [(stdout, stderr)] = run_script_ranks(code, argv, [env], str(tmp_path), timeout=60)
    assert (status, stdout) == (ref.returncode, ref.stdout)
    if "Traceback" in ref.stderr:     # the same error; the frames above the code differ
        assert "Traceback" in stderr and stderr.strip().splitlines()[-1] == ref.stderr.strip().splitlines()[-1]
    else:
        assert stderr == ref.stderr


def test_a_signal_ends_a_forked_process_as_it_ends_a_fresh_one(tmp_path):
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    ref = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    forked = ForkedProcess(code, [], dict(os.environ), str(tmp_path))
    try:
        assert ref.stdout.readline() == "started\n"
        for p in (ref, forked):
            p.send_signal(signal.SIGTERM)
        ref.wait(60)
        forked.communicate(timeout=60)
    finally:
        for p in (ref, forked):
            if p.poll() is None:
                p.kill()
    assert forked.returncode == ref.returncode == -signal.SIGTERM


def test_a_forked_process_past_its_time_is_killed_with_its_output(tmp_path):
    code = "import sys, time\nprint('still here', file=sys.stderr, flush=True)\ntime.sleep(60)"
    with pytest.raises(TimeoutError, match="still here"):
        run_script_ranks(code, [], [dict(os.environ)], str(tmp_path), timeout=2)
