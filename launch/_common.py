"""Shared bits of the launch scripts (not part of the library): puts the checkout on
``sys.path``, so ``python launch/x.py`` and ``deepspeed launch/x.py`` work from a checkout
without installing ds_pfc."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:    # run from a checkout without installing
    sys.path.insert(0, ROOT)

from ds_pfc.cli._launch import launch_env, leave_process_groups  # noqa: E402,F401

single_process_env = launch_env     # the former name
