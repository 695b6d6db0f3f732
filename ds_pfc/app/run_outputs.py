"""What a training run leaves in its output directory besides checkpoints and the
export: ``training.log``, strict JSON (``summary.json``), and the defaults that put
DeepSpeed's TensorBoard and W&B monitors under the output directory.

- :class:`TrainingLog`: rank 0's console lines, appended to
  ``<output_dir>/training.log`` across resumes, each run opened by a header line
  (ds_pfc, torch and DeepSpeed versions, the config path, the world size).
- :func:`strict_json`: JSON that any parser reads: NaN and infinities (a TAR that
  cannot be measured, a diverged loss) become ``null``; anything else that is not
  JSON raises.
- :func:`monitor_config` / :func:`check_monitor_packages`: DeepSpeed's
  ``tensorboard`` block writes to ``<output_dir>/tensorboard/<job_name>`` unless it
  names an ``output_path``; the ``wandb`` block's run directory is
  ``<output_dir>/wandb`` unless ``WANDB_DIR`` is set; a monitor whose package is
  missing is refused before anything is built.
- :func:`continue_csv_monitor`: a resumed run continues DeepSpeed's csv files (one
  header line each; rows past the resumed checkpoint, from a run that went on after
  it, removed).
- :func:`loss_scale_text`: the loss scale for the progress line under fp16.
- :class:`Heartbeat`: a "still running after N s" line (with progress when known) for
  every long phase of rank 0: the data index, the engine build (DeepSpeed's first JIT op
  build), a resume's load, checkpoints and the export.

Part of the training app (it names config keys and reads the engine); imports
ds_pfc.app.config and ds_pfc.deepspeed_plugin inside the functions that need them.
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import sys

__all__ = ["TrainingLog", "LOG_NAME", "strict_json", "finite_or_none", "monitor_config", "check_monitor_packages",
           "continue_csv_monitor", "loss_scale_text", "versions_line"]

LOG_NAME = "training.log"

# DeepSpeed's monitor blocks that need a package of their own: block -> (module, pip command).
_MONITOR_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard (or pip install 'ds_pfc[tensorboard]')"),
                     "wandb": ("wandb", "pip install wandb")}


# ---------------------------------------------------------------------------- JSON
def finite_or_none(value):
    """``value`` with every non-finite float (NaN, +-inf) replaced by ``None``, through
    dicts, lists and tuples (tuples become lists, as JSON has them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def strict_json(value, *, indent: int | None = 1) -> str:
    """``value`` as standard JSON (RFC 8259): non-finite floats become ``null``
    (:func:`finite_or_none`). The encoder runs with ``allow_nan=False``, so a
    non-finite number that ever reaches it by another way raises instead of being
    written as a bare ``NaN``."""
    return json.dumps(finite_or_none(value), indent=indent, allow_nan=False)


# ---------------------------------------------------------------------------- training.log
def versions_line() -> str:
    """``ds_pfc X, torch Y, deepspeed Z``."""
    import torch
    from .._versions import __version__
    try:
        import deepspeed
        ds = getattr(deepspeed, "__version__", "unknown")
    except ImportError:       # pragma: no cover - the app needs DeepSpeed
        ds = "not installed"
    return f"ds_pfc {__version__}, torch {torch.__version__}, deepspeed {ds}"


class TrainingLog:
    """Append-only ``training.log`` of rank 0: :meth:`write` appends one line (the file
    is opened and closed for each, so nothing written is lost to a crash and nothing
    stays open). Creating it appends a header line naming the start time, the
    versions, the config path and the world size, so a resumed run's lines follow
    the earlier ones under their own header."""

    def __init__(self, output_dir: str, *, config_path: str | None, world_size: int):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, LOG_NAME)
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.write(f"=== {started} {versions_line()}, config {config_path or '(in-process dict)'}, "
                   f"world size {world_size}")

    def write(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")


# ---------------------------------------------------------------------------- monitors
def check_monitor_packages(ds_config: dict) -> None:
    """Refuse an enabled ``tensorboard`` / ``wandb`` block whose package is not
    installed, naming the key and the pip command (DeepSpeed would only fail inside
    ``deepspeed.initialize``). Every rank checks, so every rank stops alike."""
    from .config import ConfigError
    for block, (module, pip) in _MONITOR_PACKAGES.items():
        sub = ds_config.get(block)
        if not (isinstance(sub, dict) and sub.get("enabled")):
            continue
        if not _importable(module):
            raise ConfigError(f"{block}.enabled is true but the {module} package is not installed: {pip}; "
                              f"or set {block}.enabled to false")


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def monitor_config(ds_config: dict, output_dir: str, *, rank: int) -> dict:
    """``ds_config`` with DeepSpeed's monitors writing under ``output_dir`` (a copy;
    the blocks a user filled in keep their values):

    - ``csv_monitor``: ``output_path`` ``<output_dir>/monitor``;
    - ``tensorboard``: ``output_path`` ``<output_dir>/tensorboard`` and ``job_name``
      ``train`` (the events go to ``<output_dir>/tensorboard/train``);
    - ``wandb``: DeepSpeed's block has no directory key, so on rank 0 (the only rank
      that starts W&B) ``WANDB_DIR`` is set to ``output_dir`` unless already set: W&B
      keeps its run files in ``<output_dir>/wandb``. ``WANDB_MODE=offline`` runs
      without a W&B server (``wandb sync`` uploads later)."""
    out = dict(ds_config)
    csv = out.get("csv_monitor")
    if isinstance(csv, dict) and csv.get("enabled") and "output_path" not in csv:
        out["csv_monitor"] = dict(csv, output_path=os.path.join(output_dir, "monitor"))
    tb = out.get("tensorboard")
    if isinstance(tb, dict) and tb.get("enabled"):
        tb = dict(tb)
        tb.setdefault("output_path", os.path.join(output_dir, "tensorboard"))
        tb.setdefault("job_name", "train")
        out["tensorboard"] = tb
    wb = out.get("wandb")
    if isinstance(wb, dict) and wb.get("enabled") and rank == 0 and not os.environ.get("WANDB_DIR"):
        os.makedirs(output_dir, exist_ok=True)
        os.environ["WANDB_DIR"] = os.path.abspath(output_dir)
    return out


def continue_csv_monitor(ds_engine, samples: int) -> tuple[list[str], int]:
    """Let DeepSpeed's csv monitor of ``ds_engine`` (rank 0's; a no-op elsewhere or when
    it is off) continue the files an earlier run of the output directory wrote, at the
    run's sample count ``samples`` (the csv files' ``step`` column): DeepSpeed writes a
    ``step,<name>`` header the first time a process writes a file, also to a file that
    has one, so the files already there are marked as started; rows whose step is past
    ``samples`` (written after the checkpoint this run resumed, by a run that went on and
    stopped before its next checkpoint) and header lines repeated inside a file are
    removed (the file is rewritten atomically). Returns ``(files continued, rows
    removed)``."""
    import csv
    import io
    master = getattr(ds_engine, "monitor", None)
    monitor = getattr(master, "csv_monitor", None)
    directory = getattr(monitor, "log_dir", None)
    if monitor is None or not monitor.enabled or not directory or not os.path.isdir(directory):
        return [], 0
    from ..checkpoint.files import atomic_write
    continued, removed = [], 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".csv") or not os.path.isfile(path):
            continue
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            continue
        header, kept = rows[0], [rows[0]]
        for row in rows[1:]:
            if row == header:
                continue
            try:
                past = float(row[0]) > samples
            except (IndexError, ValueError):
                past = False
            if not past:
                kept.append(row)
        if len(kept) != len(rows):
            removed += len(rows) - len(kept)
            text = io.StringIO()
            csv.writer(text).writerows(kept)        # DeepSpeed's dialect (excel, \r\n)
            atomic_write(path, text.getvalue().encode())
        stem = name[:-len(".csv")]
        if stem not in monitor.filenames:
            monitor.filenames.append(stem)
        continued.append(name)
    return continued, removed


# ---------------------------------------------------------------------------- progress line
def loss_scale_text(ds_engine) -> str:
    """`` loss_scale 65536`` for the progress line when DeepSpeed's fp16 (dynamic or
    static loss scaling) is on; empty under bf16 and fp32."""
    if not ds_engine.fp16_enabled():
        return ""
    from ..deepspeed_plugin import loss_scale
    return f" loss_scale {loss_scale(ds_engine):g}"


class Heartbeat:
    """Within it, a long phase is never silent: a daemon thread calls ``log`` with
    ``"<what>: still running after N s"`` (plus ``progress()``'s text when given, e.g.
    ``"12,000,000 of 42,474,557 records"``) once ``first`` seconds have passed, then every
    ``every`` seconds, until the block ends. ``log=None``: nothing (ranks other than 0).
    A phase shorter than ``first`` logs nothing."""

    first_s = 10.0
    every_s = 30.0

    def __init__(self, log, what: str, *, progress=None, first: float | None = None, every: float | None = None):
        self.log, self.what, self.progress = log, what, progress
        self.first = self.first_s if first is None else float(first)
        self.every = self.every_s if every is None else float(every)
        self._stop = None
        self._thread = None

    def __enter__(self) -> "Heartbeat":
        if self.log is None:
            return self
        import threading
        import time
        self._stop = threading.Event()
        started = time.perf_counter()

        def beat():
            wait = self.first
            while not self._stop.wait(wait):
                detail = ""
                if self.progress is not None:
                    try:
                        detail = self.progress() or ""
                    except Exception:           # a progress probe must never break the phase
                        detail = ""
                self.log(f"{self.what}: still running after {time.perf_counter() - started:.0f} s"
                         + (f" ({detail})" if detail else ""))
                wait = self.every
        self._thread = threading.Thread(target=beat, name="ds_pfc-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
        return False
