"""The training app behind ``launch/train.py``: a DeepSpeed engine for the backbone, a
Partial FC head beside it, data, evaluation, checkpoints, resume and export.

    deepspeed launch/train.py --deepspeed_config configs/cpu_quickstart.json

One optimizer step = ``gradient_accumulation_steps`` micro batches of
``train_micro_batch_size_per_gpu`` on each rank. The sampler shards the epoch in
micro-batch blocks, so the global batch of every micro step is the same for any
``world_size x gradient_accumulation_steps`` product (see
:class:`~ds_pfc.data.DistributedIdentitySampler`).
"""
from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError, DsPfcConfig, ScheduleConfig, split_config
from .datasets import build_eval_sets, build_train_set, check_eval_decoder
from ..data.loader import MicroBatchLoader
from ..data.sampler import DistributedIdentitySampler
from ..checkpoint import tags
from . import resume_changes
from ..deepspeed_plugin import PfcEngine, init_distributed, initialize, list_checkpoints
from ..devices import bind_local_device
from .._checks import NonFiniteError
from ..core.late import LateRead
from .. import launchers

__all__ = ["Trainer", "load_config", "schedule_factor", "build_eval_sets", "evaluate"]


def load_config(path: str) -> dict:
    """Read a job JSON (clear errors for a missing file, bad JSON or an arcface_torch
    ``.py`` config, which ``ds-pfc-migrate config`` converts)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path!r}")
    if path.endswith(".py"):
        raise ConfigError(f"{path}: arcface_torch configs are Python; convert with "
                          f"ds-pfc-migrate config {path}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None


def schedule_factor(schedule: ScheduleConfig, steps_per_epoch: int, total_steps: int, *,
                    micro_batches_per_epoch: int | None = None, accumulation: int = 1, epochs: float | None = None):
    """``step -> factor`` of the peak learning rate at optimizer step ``step`` (0 first;
    for ``torch.optim.lr_scheduler.LambdaLR``).

    The ``arcface`` type counts micro batches as arcface_torch does and needs
    ``micro_batches_per_epoch`` (its ``num_image // (micro batch x ranks)``),
    ``accumulation`` (micro batches per optimizer step) and ``epochs``."""
    if schedule.type == "arcface":
        if micro_batches_per_epoch is None or epochs is None:
            raise ValueError("the arcface schedule needs micro_batches_per_epoch and epochs")
        return _arcface_factor(schedule, micro_batches_per_epoch, accumulation, epochs)
    warmup = int(round(schedule.warmup_epochs * steps_per_epoch))
    milestones = [int(round(m * steps_per_epoch)) for m in schedule.milestones]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule.type == "poly":
            span = max(total_steps - warmup, 1)
            return max(0.0, 1.0 - (step - warmup) / span) ** schedule.power
        return schedule.gamma ** sum(step >= m for m in milestones)
    return factor


def _arcface_factor(schedule: ScheduleConfig, micro_batches_per_epoch: int, accumulation: int, epochs: float):
    """arcface_torch's ``PolynomialLRWarmup(warmup_iters=w, total_iters=t, power)``
    stepped after every micro batch, read at the last micro batch of each optimizer step.

    Its micro batch ``k`` (0 first) runs at: the full lr at ``k = 0`` (``get_lr`` returns
    the group's lr when ``last_epoch == 0``), ``k / w`` for ``1 <= k <= w``, then
    ``(1 - (k - w) / (t - w))^power`` (a chained product of ratios there, equal to this
    closed form to double rounding); past ``t`` it keeps the value of its last step
    within ``t`` (0 at the end of a decay)."""
    w = micro_batches_per_epoch * schedule.warmup_epochs
    t = micro_batches_per_epoch * epochs
    power = schedule.power

    def factor(step: int) -> float:
        k = (step + 1) * accumulation - 1
        if k > t:
            k = math.floor(t)
        if k <= 0:
            return 1.0
        if k <= w:
            return k / w
        return (1.0 - (k - w) / (t - w)) ** power
    return factor


@torch.no_grad()
def evaluate(model, sets: dict, *, batch_size: int, flip: bool, far: list, device, dtype,
             rank: int = 0, world_size: int = 1, group=None) -> dict[str, dict]:
    """1:1 verification of ``model`` on every set, the work split over the ranks.

    Every rank embeds an equal share of the images (padded by wrap-around, so every
    rank runs the same number of forward passes: ZeRO-3 gathers parameters
    collectively) and the embeddings are all-gathered; every rank then computes the
    same metrics. No rank ever waits for another one evaluating alone."""
    results = {}
    was_training = model.training
    model.eval()
    try:
        for name, (images, issame) in sets.items():
            results[name] = _evaluate_set(model, images, issame, batch_size=batch_size, flip=flip, far=far,
                                          device=device, dtype=dtype, rank=rank, world_size=world_size, group=group)
    finally:
        model.train(was_training)
    return results


def _evaluate_set(model, images, issame, *, batch_size, flip, far, device, dtype, rank, world_size, group):
    from ..data.transforms import normalize
    from ..eval.verification import embed, verification_metrics
    total = images.shape[0]
    per_rank = math.ceil(total / world_size)
    index = (torch.arange(per_rank) * world_size + rank) % total
    local = embed(lambda x: model(normalize(x).to(device, dtype)), images[index], batch_size, flip=flip)
    if world_size > 1:
        local = local.to(device)
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local, group=group)
        gathered = torch.stack(parts, 1).reshape(-1, local.shape[1]).cpu()[:total]
    else:
        gathered = local
    return verification_metrics(gathered[0::2], gathered[1::2], issame, far_targets=tuple(far))


def _format_eval(results: dict) -> str:
    parts = []
    for name, r in results.items():
        tar = " ".join(f"TAR@FAR={f:g} {t:.4f}" for f, t in r.tar_at_far.items())
        parts.append(f"{name}: acc {r.accuracy:.4f}+-{r.accuracy_std:.4f} {tar}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------- app
@dataclass
class _Progress:
    start: float
    start_step: int
    samples: int = 0


class Trainer:
    """Builds everything from a job config and runs it (every rank calls :meth:`run`).

    Args:
        config: the job JSON as a dict (DeepSpeed's keys plus the ``ds_pfc`` block).
        output_dir: overrides ``ds_pfc.train.output_dir``.
        max_steps: overrides ``ds_pfc.train.max_steps``.
        log: where rank 0's progress lines go (default: stdout).
        resume_from: checkpoint tag to resume instead of the newest (see :meth:`resume`).
        allow_batch_change: resume a checkpoint trained with another global batch.
        allow_config_change: resume a checkpoint trained with other settings that
            change training (see :meth:`resume`); the new values take effect.
        config_path: the file ``config`` was read from, named in ``training.log``.

    Rank 0's progress lines also go to ``<output_dir>/training.log`` (appended across
    resumes; see :class:`ds_pfc.app.run_outputs.TrainingLog`).
    """

    def __init__(self, config: dict, *, output_dir: str | None = None, max_steps: int | None = None, log=None,
                 resume_from: str | None = None, allow_batch_change: bool = False, allow_config_change: bool = False,
                 config_path: str | None = None):
        self.raw_config, self.config_path = config, config_path
        self.resume_from, self.allow_batch_change = resume_from, bool(allow_batch_change)
        self.allow_config_change = bool(allow_config_change)
        self.ds_config, self.cfg = split_config(config, source=config_path)
        # The command-line overrides of ds_pfc.train, saved with every checkpoint so
        # that a resume compares the settings the run really had.
        self.overrides = {}
        if output_dir is not None:
            self.cfg.train.output_dir = self.overrides["output_dir"] = output_dir
        if max_steps is not None:
            self.cfg.train.max_steps = self.overrides["max_steps"] = max_steps
        self._log = log or (lambda line: print(line, flush=True))
        self._check_ds_config()
        self._check_diagnostics()
        self._check_resume_request()

    def _check_resume_request(self) -> None:
        """The resume refusals that need only the config and the output directory, before
        anything heavy is built (each names the fix; :meth:`resume` checks the rest)."""
        if self.cfg.checkpoint.resume:
            return
        if self.resume_from is not None:
            raise ConfigError(f"resume_from={self.resume_from!r} but ds_pfc.checkpoint.resume is false: set it true "
                              "(launch/train.py --resume_from does that itself)")
        found = list_checkpoints(os.path.join(self.cfg.train.output_dir, "checkpoints"))
        if found:
            raise ConfigError(
                f"{os.path.join(self.cfg.train.output_dir, 'checkpoints')} holds checkpoints (newest: {found[-1]}) "
                "but ds_pfc.checkpoint.resume is false: continue that run with launch/train.py --resume (or set "
                "ds_pfc.checkpoint.resume true), or start another with --output_dir, or remove them")

    def _check_ds_config(self) -> None:
        ds = self.ds_config
        if "train_micro_batch_size_per_gpu" not in ds and "train_batch_size" not in ds:
            raise ConfigError("the config must set train_micro_batch_size_per_gpu (the per-rank micro batch) or "
                              "train_batch_size (the global batch), and optionally gradient_accumulation_steps")
        if self.cfg.train.schedule is not None and "scheduler" in ds:
            raise ConfigError("set either DeepSpeed's 'scheduler' block or ds_pfc.train.schedule, not both")
        init = self.cfg.train.init
        if init is not None and init.scales_backbone and "scheduler" in ds:
            raise ConfigError("ds_pfc.train.init.freeze_backbone_steps / backbone_lr_scale scale the backbone's "
                              "learning rate through ds_pfc's schedule: replace DeepSpeed's 'scheduler' block with "
                              "ds_pfc.train.schedule (or leave it out for a constant learning rate)")
        if self.cfg.train.on_nonfinite == "rollback" and "scheduler" in ds:
            raise ConfigError("ds_pfc.train.on_nonfinite 'rollback' lowers the learning rate through ds_pfc's "
                              "schedule: replace DeepSpeed's 'scheduler' block with ds_pfc.train.schedule (or leave "
                              "it out for a constant learning rate)")
        if "optimizer" not in ds:
            raise ConfigError("the config must have DeepSpeed's 'optimizer' block (the backbone's optimizer; "
                              "its lr is also the heads' base learning rate)")
        if ds.get("gradient_allreduce_op", "mean") == "sum":
            raise ConfigError("gradient_allreduce_op: 'sum' is not supported: the Partial FC head's embedding "
                              "gradient is that of the mean loss over the global batch, so DeepSpeed must average "
                              "the gradients over the ranks; remove the key (or set it to 'mean')")
        if isinstance(ds.get("checkpoint"), dict) and ds["checkpoint"].get("use_node_local_storage"):
            raise ConfigError("checkpoint.use_node_local_storage is not supported: the checkpoints need one output "
                              "directory that every rank reads and writes")
        from .run_outputs import check_monitor_packages
        check_monitor_packages(ds)          # tensorboard / wandb enabled without their package

    def _check_diagnostics(self) -> None:
        cfg = self.cfg
        if not cfg.train.diagnostics.flip_mechanism:
            return
        if not cfg.data.stress.label_flip:
            raise ConfigError("ds_pfc.train.diagnostics.flip_mechanism measures label flips: it needs "
                              "ds_pfc.data.stress.label_flip > 0")
        if not cfg.head.bank.is_default():
            raise ConfigError("ds_pfc.train.diagnostics.flip_mechanism reads the centers between steps from the "
                              "device bank: leave ds_pfc.head.bank at its default (device)")

    rank = 0

    _training_log = None

    _nonfinite: "_NonFiniteGuard | None" = None
    """ds_pfc.train.on_nonfinite's state (None: ``stop``)."""

    flip_mechanism = None
    """The :class:`~ds_pfc.app.diagnostics.FlipMechanism` of the run (None: off)."""

    def log(self, line: str) -> None:
        if self.rank == 0:
            self._log(line)
            self.record(line)

    def _heartbeat(self, what: str):
        """A :class:`~ds_pfc.app.run_outputs.Heartbeat` for a long phase, on rank 0's log."""
        from .run_outputs import Heartbeat
        return Heartbeat(self.log if self.rank == 0 else None, what)

    def record(self, line: str) -> None:
        """Add ``line`` to ``training.log`` only (rank 0; once the log is open), e.g. an
        error the launch script prints itself."""
        if self.rank == 0 and self._training_log is not None:
            self._training_log.write(line)

    # -- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        from deepspeed.accelerator import get_accelerator

        cfg = self.cfg
        # Bad data paths fail before any process group exists; the first rank of the launch says
        # what takes long (a RecordIO set's first indexing).
        first = (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK")
                 or os.environ.get("PMI_RANK") or "0") == "0"
        self.dataset = build_train_set(cfg, log=self._log if first else None)
        check_eval_decoder(cfg)          # .bin pair sets: a missing decoder fails now, not after the build
        # Rank, world and local rank from the launcher (srun and mpirun set no RANK),
        # checked against the scheduler's task count; then the process group; then
        # cuda:<local rank> before any CUDA work (DeepSpeed binds the device only inside
        # deepspeed.initialize, after the head, the data and the evaluation exist).
        launch = launchers.export()
        init_distributed()
        launchers.check_process_group(launch)
        bound = bind_local_device(local_rank=launch.local_rank)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = bound or torch.device(get_accelerator().current_device_name())
        self.decode_on_device = cfg.data.decode_on(self.device)     # data.decode: refused here if it cannot run
        # The batch geometry as DeepSpeed resolves it (any two of the three batch keys,
        # elasticity): the engine built below must agree.
        self.micro, self.gas = _batch_geometry(self.ds_config)
        if cfg.train.on_nonfinite != "stop" and self.gas != 1:
            raise ConfigError(f"ds_pfc.train.on_nonfinite {cfg.train.on_nonfinite!r} needs gradient_accumulation_steps "
                              f"1 (this config resolves to {self.gas}): a step is dropped or rolled back whole, "
                              "before any of its micro batches has been back-propagated. Use a larger "
                              "train_micro_batch_size_per_gpu instead, or on_nonfinite 'stop'")
        self.output_dir = cfg.train.output_dir
        self.checkpoint_dir = os.path.join(self.output_dir, "checkpoints")
        if self.rank == 0 and self._training_log is None:
            from .run_outputs import TrainingLog, versions_line
            self._training_log = TrainingLog(self.output_dir, config_path=self.config_path,
                                             world_size=self.world_size)
            self.log(versions_line())

        self.sampler = DistributedIdentitySampler(len(self.dataset), rank=self.rank, world_size=self.world_size,
                                                  seed=cfg.data.seed, shuffle=cfg.data.shuffle, drop_last=True,
                                                  block_size=self.micro)
        self.steps_per_epoch = self.sampler.num_per_rank // (self.micro * self.gas)
        if self.steps_per_epoch < 1:
            raise ConfigError(f"the training set ({len(self.dataset)} images) is smaller than one global batch "
                              f"({self.micro} x {self.gas} x {self.world_size} ranks)")
        total = int(cfg.train.epochs * self.steps_per_epoch)
        if cfg.train.max_steps is not None:
            total = min(total, cfg.train.max_steps)
        # max_steps 0: no step; the initial state is saved and exported (run()).
        self.total_steps = 0 if cfg.train.max_steps == 0 else max(total, 1)

        torch.manual_seed(cfg.train.seed)
        backbone = cfg.backbone.build(cfg.head.embedding_size)
        with self._heartbeat("building the head"):
            # skip and rollback decide before a step is applied: its checks cannot wait a step.
            head = cfg.head.build(group=None, device=self.device,
                                  validate="immediate" if cfg.train.on_nonfinite != "stop" else None)
        init = cfg.train.init
        if init is not None and (init.backbone or init.head):
            self._load_init(init, backbone, head)
        scheduler, self.schedule = None, None
        base_factor = None
        if cfg.train.schedule is not None:
            schedule = cfg.train.schedule
            images = schedule.images_per_epoch or len(self.dataset)
            base_factor = schedule_factor(schedule, self.steps_per_epoch, self.total_steps,
                                          micro_batches_per_epoch=images // (self.micro * self.world_size),
                                          accumulation=self.gas, epochs=cfg.train.epochs)
        if init is not None and init.scales_backbone:
            # The backbone's lr factor carries the frozen steps and the multiplier; the
            # heads follow the schedule alone (BackboneScaledLR.head_lr).
            from .finetune import BackboneScaledLR, backbone_factor
            base = base_factor if base_factor is not None else (lambda step: 1.0)
            self.schedule = backbone_factor(base, freeze_steps=init.freeze_backbone_steps,
                                            scale=init.backbone_lr_scale)

            def scheduler(optimizer):
                return BackboneScaledLR(optimizer, base, freeze_steps=init.freeze_backbone_steps,
                                        scale=init.backbone_lr_scale)
        elif cfg.train.schedule is not None:
            factor = self.schedule = base_factor

            def scheduler(optimizer):
                return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        from .run_outputs import monitor_config
        # csv / TensorBoard / W&B under the output directory unless the blocks say otherwise
        ds_config = monitor_config(self.ds_config, self.output_dir, rank=self.rank)
        try:
            with self._heartbeat("building the DeepSpeed engine (a first run JIT-compiles DeepSpeed's ops, which "
                                 f"takes minutes once; they are cached in TORCH_EXTENSIONS_DIR={_extensions_dir()})"):
                self.engine: PfcEngine = initialize(model=backbone, config=ds_config, lr_scheduler=scheduler,
                                                    heads={"head": (head, cfg.head.optimizer.lr_ratio)})
        except (TypeError, ValueError, KeyError, AssertionError) as err:
            # Raised where DeepSpeed or torch builds the optimizer, the scheduler or the engine
            # from the config's blocks (e.g. a misspelt optimizer.params key): the config's fault.
            origin = _raised_in(err)
            if not any(part in origin for part in (os.sep + "deepspeed" + os.sep, os.sep + "torch" + os.sep)):
                raise
            raise ConfigError(f"DeepSpeed could not build the engine from the config ({type(err).__name__} in "
                              f"{_short_path(origin)}: {err}); check the 'optimizer' block (type, params), "
                              "'scheduler', 'fp16'/'bf16' and 'zero_optimization'") from err
        self.head = head
        inner = self.engine.engine
        resolved = (int(inner.train_micro_batch_size_per_gpu()), int(inner.gradient_accumulation_steps()))
        if resolved != (self.micro, self.gas):
            raise RuntimeError(f"the engine runs micro batches of {resolved[0]} x {resolved[1]} accumulation steps, "
                               f"the app planned {self.micro} x {self.gas}")
        self.eval_sets = build_eval_sets(cfg)
        if cfg.train.on_nonfinite != "stop":
            self._nonfinite = _NonFiniteGuard(self.engine.module)
        if cfg.train.diagnostics.flip_mechanism:
            self._setup_flip_mechanism()
        # ZeRO-3 leaves each parameter an empty placeholder; ds_numel is its true size.
        params = sum(getattr(p, "ds_numel", p.numel()) for p in backbone.parameters())
        self.log(f"ds_pfc: {self.world_size} rank(s) on {self.device.type}, backbone {cfg.backbone.name} "
                 f"(width {cfg.backbone.width}, {params / 1e6:.2f} M parameters, {_dtype_name(self.engine.dtype)}), "
                 f"{head}, head products {_dtype_name(head.product_dtype)}")
        if cfg.data.stress.active:
            self.log(f"stress: {self.dataset!r}")
        self.log(f"data: {cfg.data.source}, {len(self.dataset)} images, {self.steps_per_epoch} steps/epoch of "
                 f"{self.micro} x {self.gas} x {self.world_size} = {self.micro * self.gas * self.world_size} images; "
                 f"{self.total_steps} steps")

    def _setup_flip_mechanism(self) -> None:
        """The flip-mechanism diagnostic and what it needs to know of every batch: the
        training and true labels of the stressed set, by sample index."""
        from .diagnostics import FlipMechanism
        true_labels = getattr(self.dataset, "true_labels", None)
        if true_labels is None:
            raise ConfigError(f"ds_pfc.train.diagnostics.flip_mechanism: the training set "
                              f"{type(self.dataset).__name__} does not know its labels before the flips")
        self._flip_labels = (self.dataset.labels(), true_labels())
        self._flip_shard = None           # (epoch, start, this rank's shard of the epoch)
        self.flip_mechanism = FlipMechanism(self.head, seed=self.cfg.head.seed)

    def _batch_true_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The true labels of the micro batch the sampler's position points at (the one
        being trained on: the loop advances the sampler after it), checked against the
        labels the loader delivered."""
        s = self.sampler
        if self._flip_shard is None or self._flip_shard[:2] != (s.epoch, s.start):
            self._flip_shard = (s.epoch, s.start, s.shard())
        index = self._flip_shard[2][s.consumed: s.consumed + self.micro]
        train, true = self._flip_labels
        if not torch.equal(train[index], labels.cpu()):
            raise RuntimeError("flip_mechanism: the loader's batch does not match the sampler's position")
        return true[index].to(labels.device)

    def _close_flip_interval(self, step: int) -> None:
        """Every rank: the flip-mechanism numbers of the steps since the last interval,
        into the history (``summary.json``), the log and the monitors."""
        numbers = self.flip_mechanism.interval()
        if numbers["steps"][0] is None:
            return
        self.history.setdefault("flip_mechanism", {})[step] = numbers
        self.log(f"flip mechanism steps {numbers['steps'][0]}-{numbers['steps'][1]}: {numbers['flipped']} flipped "
                 f"samples, true class active {numbers['true_active_share']:.4f} (expected "
                 f"{numbers['true_active_expected']:.4f}), dcos true {numbers['dcos_true']:+.2e} "
                 f"(when active {numbers['dcos_true_active']:+.2e}) control {numbers['dcos_control']:+.2e}, "
                 f"drift true {numbers['drift_true']:.2e} control {numbers['drift_control']:.2e}")
        self._monitor([(f"Diagnostics/flip_{key}", numbers[key]) for key in
                       ("true_active_share", "true_active_expected", "cos_true", "dcos_true", "dcos_control",
                        "drift_true", "drift_control") if math.isfinite(numbers[key])])

    def _flip_interval_due(self, step: int) -> bool:
        every = self.cfg.train.diagnostics.every_steps or self.cfg.evaluation.every_steps
        return bool(every) and step % every == 0 and step < self.total_steps

    def _load_init(self, init, backbone, head) -> None:
        """Pretrained weights (``ds_pfc.train.init``) into the backbone before DeepSpeed
        wraps it and into this rank's head shard, for a fresh run only: a run that
        will resume a checkpoint (``resume_from``, or complete tags in
        ``checkpoint_dir`` with resuming on) has its own and skips them. With
        ``class_map`` the head grows from the old shards (:mod:`ds_pfc.app.grow`): its
        new rows are imprinted by the backbone loaded just before, on this rank's
        device (every rank takes part: a collective)."""
        if self.cfg.checkpoint.resume and (self.resume_from is not None or list_checkpoints(self.checkpoint_dir)):
            self.log("ds_pfc.train.init: resuming a checkpoint, which holds its own weights; the pretrained "
                     "weights are not read (the frozen steps and backbone_lr_scale still apply by step)")
            return
        from .finetune import head_directory, load_backbone_weights, load_head_weights
        if init.backbone:
            load_backbone_weights(backbone, init.backbone)
            self.log(f"init: backbone weights from {init.backbone}")
        head_dir = None
        if init.head:
            # A run's checkpoints directory: the tag 'latest' names, chosen once by rank 0.
            head_dir, note = tags.on_rank0(lambda: head_directory(init.head))
            if note:
                self.log(note)
        if init.head and not init.class_map:
            states = load_head_weights(head, head_dir, seed=self.cfg.head.seed,
                                       optimizer_states=init.optimizer_states)
            self.log(f"init: head centers from {head_dir} ({self.world_size} shard(s); {states})")
        elif init.head:
            # Growing a head: the old rows move to their new ids; the others are the fresh
            # rows, or imprinted from the initial backbone (after init.backbone is in).
            from .grow import grow_head, imprint_rows, read_class_map
            grown = grow_head(head, head_dir, *read_class_map(init.class_map),
                              optimizer_states=init.optimizer_states)
            imprinted, note = 0, ""
            if init.new_rows == "imprint" and grown.new_classes.numel():
                from ..data.loader import default_workers
                workers = default_workers() if self.cfg.data.workers == "auto" else self.cfg.data.workers
                backbone.to(self.device)          # DeepSpeed keeps it there
                with self._heartbeat(f"init: imprinting {grown.new_classes.numel()} new classes from their "
                                     "training images (one pass)"):
                    done = imprint_rows(head, backbone, self.dataset, grown.new_classes, device=self.device,
                                        batch_size=self.cfg.evaluation.batch_size, workers=workers)
                imprinted = done.imprinted
                note = (f" ({done.images} images embedded"
                        + (f"; {done.without_images} new classes have no training image and keep their random "
                           "row" if done.without_images else "") + ")")
            random_rows = head.num_classes - grown.moved - imprinted
            self.log(f"init: head grown from {head_dir} ({grown.old_num_classes} classes on "
                     f"{grown.old_world_size} rank(s)) to {head.num_classes} classes by {init.class_map}: "
                     f"{grown.moved} old rows moved ({'with' if init.optimizer_states else 'without'} optimizer "
                     f"states), {imprinted} imprinted, {random_rows} random{note}")

    # -- checkpoints ------------------------------------------------------------------
    _resumed_tag: str | None = None
    """The tag this run resumed from (its state is on disk already)."""
    _saved_tag: str | None = None
    """The tag this run saved last."""
    _ran_before: list = []
    """What earlier runs of the checkpoint this run resumed ran (its marker's ``ran``)."""
    _segment_start: int = 1
    """The first step this run trains."""

    def ran_record(self) -> list[dict]:
        """What ran to reach the current step, oldest first, one entry per stretch of steps
        run alike: ``{"steps": [first, last], "device": "cpu"|"cuda"|..., ("device_name":
        the GPU's name,) "world_size", "head_products": the dtype of the head's matrix
        products as they ran (``compute_dtype`` resolved on the device), "backbone": the
        dtype the engine ran the backbone in, "versions": "ds_pfc X, torch Y, deepspeed
        Z"}``. Steps of an earlier run that recorded none of this are one entry
        ``{"steps": [1, N], "not_recorded": true}``. Saved in every checkpoint's marker
        (``metadata.ran``); the model card reads it."""
        from .run_outputs import versions_line
        now = {"steps": [self._segment_start, int(self.engine.global_steps)], "device": self.device.type,
               "world_size": self.world_size, "head_products": _dtype_name(self.head.product_dtype),
               "backbone": _dtype_name(self.engine.dtype), "versions": versions_line()}
        if self.device.type == "cuda":
            now["device_name"] = torch.cuda.get_device_name(self.device)
        before = [dict(entry) for entry in self._ran_before]

        def alike(entry):
            return {k: v for k, v in entry.items() if k != "steps"}
        if before and alike(before[-1]) == alike(now):
            before[-1]["steps"] = [before[-1]["steps"][0], now["steps"][1]]
            return before
        return before + [now]

    def resume(self) -> bool:
        """Continue from a checkpoint in ``checkpoint_dir``; every rank calls it at
        start-up (a collective). Returns whether a checkpoint was loaded.

        First checks that every rank sees the files rank 0 writes there
        (:func:`ds_pfc.checkpoint.tags.check_shared_directory`). Loads ``resume_from``
        if set, else the tag ``latest`` names, or the newest complete tag when
        ``latest`` is missing or lags behind one (logged, and ``latest`` moved). After
        an explicit ``resume_from`` of an older tag, the newer ones move to
        ``checkpoints/superseded/``. A damaged checkpoint stops the run with an error
        naming the file and the newest intact tag.

        Before anything is loaded (from the checkpoint's marker alone), the run's job
        config is compared with the one the checkpoint was trained with
        (:mod:`ds_pfc.app.resume_changes`); every difference is listed by dotted key.
        Settings that change training stop the run unless ``allow_config_change``
        (the new values then take effect: the optimizer's settings, the learning
        rate and its schedule from the next step on, a new margin starting from its
        initial state); what the checkpoint cannot be loaded into (the head's classes
        or dimension, the backbone, the optimizers' types) stops it always; the rest
        is logged. A global batch (micro x accumulation x ranks) other than the
        checkpoint's stops it unless ``allow_batch_change``. Any other number of ranks
        resumes at any step: the data position is kept in samples
        (:class:`~ds_pfc.data.DistributedIdentitySampler`). Restores the run
        history (``history``: per-step losses and evaluations since step 1) saved
        with the checkpoint."""
        self.history = {"start_step": 0, "losses": [], "evaluations": {}}
        self._resumed_tag = None
        self._ran_before, self._segment_start = [], 1
        self.config_changes = []
        self._fresh_optimizer = self._optimizer_settings()     # this job's, before any load
        tags.check_shared_directory(self.checkpoint_dir)
        if not self.cfg.checkpoint.resume:
            self._check_resume_request()     # again: checkpoints may have appeared since the start
            return False
        try:
            choice = tags.on_rank0(lambda: tags.choose_tag(self.checkpoint_dir, self.resume_from))
            if choice is None:
                return False
            # Every check that needs only the marker comes before the expensive part
            # (the universal conversion, DeepSpeed's load, the head shards).
            changes = self._check_config(choice.tag, choice.marker)
            self._check_batch(choice.tag, choice.marker)
            relabel = self._check_labels_file(choice.tag, choice.marker)
            restart = self._check_data_position(choice.tag, (choice.marker.get("metadata") or {}).get("sampler"))
            if relabel is not None:
                restart = relabel if restart is None else max(restart, relabel)
            self._convert_for_world_size(choice.tag)
            with self._saved_margin(changes, choice.marker), self._heartbeat(f"resuming {choice.tag}"):
                loaded = self.engine.load_checkpoint(self.checkpoint_dir, choice.tag)
        except tags.CheckpointError as err:
            raise _with_resume_hint(err) from None
        tag = loaded["tag"]
        if choice.note:
            self.log(choice.note)
        if self.resume_from is not None:
            moved = tags.on_rank0(lambda: tags.supersede(self.checkpoint_dir, tag))
            if moved:
                self.log(f"resumed {tag} on request: moved the newer checkpoint(s) {', '.join(moved)} to "
                         f"{os.path.join(self.checkpoint_dir, tags.SUPERSEDED)}")
        elif choice.note:
            tags.on_rank0(lambda: tags.write_latest(self.checkpoint_dir, tag))
        self._resumed_tag = tag
        earlier = (choice.marker.get("metadata") or {}).get("ran")
        self._ran_before = (list(earlier) if isinstance(earlier, list) and earlier else
                            [{"steps": [1, int(self.engine.global_steps)], "not_recorded": True}])
        self._segment_start = int(self.engine.global_steps) + 1
        self._restore_data_position(loaded["rank_state"]["sampler"], restart, tag)
        self.lr_scale = float(loaded["client_state"].get("ds_pfc_lr_scale", 1.0))     # earlier rollbacks
        self._after_load(loaded)
        if any(c.key == "ds_pfc.head.seed" for c in changes):
            self.head.seed = self.cfg.head.seed       # the checkpoint's head carries its own
        self.log(f"resumed from {os.path.join(self.checkpoint_dir, tag)} at step "
                 f"{self.engine.global_steps} (epoch {self.sampler.epoch}, saved on {loaded['world_size']} rank(s))")
        return True

    def _after_load(self, loaded: dict) -> None:
        """What :meth:`resume` and a rollback set after the engine loaded ``loaded``:
        this job's optimizer settings (times ``lr_scale``) and the run history saved
        with the checkpoint."""
        self._apply_optimizer_settings(self._fresh_optimizer)
        self.history = _restored_history(loaded["client_state"].get("ds_pfc_history"), self.engine.global_steps)

    def _check_config(self, tag: str, marker: dict) -> list:
        """Compare the job config with the one saved in ``marker``; refuse, or log,
        as :meth:`resume` says. Returns the differences."""
        meta = marker.get("metadata") or {}
        where = os.path.join(self.checkpoint_dir, tag)
        saved = meta.get("config")
        if not isinstance(saved, dict):
            self.log(f"{where} records no job config: the settings cannot be compared")
            return []
        changes = resume_changes.differences(
            resume_changes.effective_config(saved, meta.get("overrides")),
            resume_changes.effective_config(self.raw_config, self.overrides))
        self.config_changes = changes
        by_kind = {kind: [c for c in changes if c.kind == kind] for kind in ("fixed", "training", "harmless", "batch")}

        def listed(kind):
            return "; ".join(map(str, by_kind[kind]))
        if by_kind["fixed"]:
            others = [c for c in changes if c.kind != "fixed"]
            raise ConfigError(f"{where} cannot be resumed by this job, which changes {listed('fixed')}: the "
                              "checkpoint cannot be loaded into that. Use a new output directory (--output_dir, "
                              "ds_pfc.train.output_dir) or restore these settings"
                              + (f" (other changes: {'; '.join(map(str, others))})" if others else ""))
        if by_kind["training"] and not self.allow_config_change:
            others = [c for c in changes if c.kind != "training"]
            raise ConfigError(f"the job config differs from the one {where} was trained with in settings that "
                              f"change training: {listed('training')}. Restore them, or resume with the new values "
                              "with --allow_config_change (Trainer(allow_config_change=True)); they take effect "
                              "from the next step" + (f" (other changes, allowed: {'; '.join(map(str, others))})"
                                                      if others else ""))
        if by_kind["training"]:
            self.log(f"warning: resuming {where} with changed settings (allow_config_change), in effect from the "
                     f"next step: {listed('training')}")
        if by_kind["harmless"]:
            self.log(f"resuming {where} with changed settings that do not change training: {listed('harmless')}")
        if by_kind["batch"]:
            self.log(f"resuming {where} with another batch split (the global batch is checked next): "
                     f"{listed('batch')}")
        return changes

    def _check_data_position(self, tag: str, state: dict | None):
        """Whether the saved data position can carry over (checked on rank 0's saved
        sampler state in the marker before the load; checkpoints without it are
        checked after the load). Returns the epoch to restart from when the data
        changed and ``allow_config_change`` (a new epoch order), else None."""
        if not state:
            return None
        probe = copy.copy(self.sampler)
        try:
            probe.load_state_dict(state)
        except ValueError as err:
            where = os.path.join(self.checkpoint_dir, tag)
            same_order = all(state.get(k, getattr(self.sampler, k)) == getattr(self.sampler, k)
                             for k in ("num_samples", "seed", "shuffle"))
            if same_order or not self.allow_config_change:
                hint = "" if same_order else (" (the training set or its order changed: resume with "
                                              "--allow_config_change to start the next epoch in the new order)")
                raise ConfigError(f"the data position of {where} cannot carry over: {err}{hint}") from None
            epoch = int(state["epoch"]) + (1 if int(state.get("consumed", 0)) or int(state.get("start", 0)) else 0)
            self.log(f"warning: the training set or its order changed since {where} ({err}); training continues "
                     f"with epoch {epoch} from its start (allow_config_change)")
            return epoch
        return None

    def _check_labels_file(self, tag: str, marker: dict):
        """Refuse a resume whose ``ds_pfc.data.labels`` file differs from the one the
        checkpoint trained on (by content: the same path may hold another file), unless
        ``allow_config_change``; then the next epoch starts from its start in the new
        data's order. Returns that epoch, or None when the file is the same."""
        meta = marker.get("metadata") or {}
        saved, now = meta.get("labels_sha256"), getattr(self.dataset, "digest", None)
        if saved == now:
            return None
        where = os.path.join(self.checkpoint_dir, tag)
        what = (f"the label file {self.cfg.data.labels} (sha256 {now[:12]}...)" if now else "no label file")
        before = f"one of sha256 {saved[:12]}..." if saved else "no label file"
        if not self.allow_config_change:
            raise ConfigError(f"ds_pfc.data.labels: this job trains on {what}, but {where} trained on {before}: "
                              "the images and labels of the data position differ. Restore the file, or resume "
                              "with --allow_config_change to start the next epoch on the new labels")
        state = meta.get("sampler") or {}
        epoch = int(state.get("epoch", 0)) + (1 if int(state.get("consumed", 0)) or int(state.get("start", 0)) else 0)
        self.log(f"warning: this job trains on {what}, {where} on {before}; training continues with epoch {epoch} "
                 "from its start (allow_config_change)")
        return epoch

    def _restore_data_position(self, state: dict, restart: int | None, tag: str) -> None:
        if restart is None:
            restart = self._check_data_position(tag, state)
        self.sampler.load_state_dict(state if restart is None else {"epoch": restart, "consumed": 0})

    def _optimizer_settings(self):
        """The backbone optimizer's settings as this job's config built them, before a
        load puts the checkpoint's back: ``(param group settings, base lrs)``."""
        engine = self.engine.engine
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is None:
            return None
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        scheduler = getattr(engine, "lr_scheduler", None)
        return groups, (list(scheduler.base_lrs) if hasattr(scheduler, "base_lrs") else None)

    lr_scale = 1.0
    """The product of the rollbacks' learning-rate factors (1.0 without any), saved with
    every checkpoint and applied to this job's learning rates on resume."""

    def _apply_optimizer_settings(self, fresh) -> None:
        """After a load: the optimizer's settings (momentum, weight decay, betas, ...)
        and base learning rates are this job's (times :attr:`lr_scale`), and the
        learning rate of the next step is this job's schedule at the resumed step (the
        checkpoint's optimizer carries the ones the saved run had, e.g. another lr or
        max_steps)."""
        if fresh is None:
            return
        engine = self.engine.engine
        groups, base_lrs = fresh
        param_groups = engine.optimizer.param_groups
        if len(param_groups) != len(groups):
            return
        for group, settings in zip(param_groups, groups):
            group.update({k: v for k, v in settings.items() if k != "lr"})
        scheduler = getattr(engine, "lr_scheduler", None)
        if self.schedule is not None and base_lrs is not None:
            scheduler.base_lrs = [base * self.lr_scale for base in base_lrs]
            lrs = [base * self.schedule(scheduler.last_epoch) for base in scheduler.base_lrs]
        elif scheduler is None:
            lrs = [settings["lr"] * self.lr_scale for settings in groups]
        elif hasattr(scheduler, "last_batch_iteration") and hasattr(scheduler, "get_lr") \
                and scheduler.last_batch_iteration >= 0:
            lrs = list(scheduler.get_lr())       # DeepSpeed's schedulers: the lr of their current iteration
        else:
            return
        for group, lr in zip(param_groups, lrs):
            group["lr"] = lr

    def _saved_margin(self, changes: list, marker: dict):
        """While loading: the head holds a margin of the saved type, so that the
        running state of a stateful margin loads into its own kind; the new margin
        (another type) then starts from its initial state."""
        import contextlib
        if not any(c.key == "ds_pfc.head.margin.type" for c in changes):
            return contextlib.nullcontext()
        from .config import MarginConfig, from_dict
        try:
            saved = from_dict(MarginConfig, marker["metadata"]["config"]["ds_pfc"]["head"]["margin"],
                              "ds_pfc.head.margin").build()
        except (ConfigError, KeyError, TypeError):
            return contextlib.nullcontext()
        head = self.head

        @contextlib.contextmanager
        def swapped():
            new = head.margin
            head.margin = saved
            try:
                yield
            finally:
                head.margin = new
        return swapped()

    def _convert_for_world_size(self, tag: str) -> None:
        """A ZeRO 1-3 checkpoint saved on another number of ranks: rank 0 converts it
        once to DeepSpeed's universal checkpoint (``<tag>-universal``, see
        :mod:`ds_pfc.checkpoint.universal`), which the load then uses."""
        from ..checkpoint import universal

        def convert():
            tag_dir = os.path.join(self.checkpoint_dir, tag)
            sibling = os.path.join(self.checkpoint_dir, tag + universal.UNIVERSAL_SUFFIX)
            if not universal.needs_universal(tag_dir, self.world_size) or os.path.isdir(sibling):
                return None
            start = time.perf_counter()
            universal.to_universal(tag_dir, sibling, impl="ds_pfc", progress=False)
            return time.perf_counter() - start

        seconds = tags.on_rank0(convert)
        if seconds is not None:
            self.log(f"{tag} holds ZeRO partitions of another number of ranks: converted it to a universal "
                     f"checkpoint for {self.world_size} rank(s) in {seconds:.1f} s")

    def _check_batch(self, tag: str, marker: dict) -> None:
        """Refuse to resume a checkpoint trained with another global batch unless
        ``allow_batch_change`` (the sampler position, the schedule and the steps per
        epoch all count in global batches)."""
        saved = _saved_batch(marker)
        now = (self.micro, self.gas, self.world_size)
        if saved is None or math.prod(saved) == math.prod(now):
            return
        detail = (f"{os.path.join(self.checkpoint_dir, tag)} was trained with a global batch of {math.prod(saved)} "
                  f"({saved[0]} micro x {saved[1]} accumulation x {saved[2]} rank(s)); this run's is "
                  f"{math.prod(now)} ({now[0]} x {now[1]} x {now[2]})")
        if not self.allow_batch_change:
            raise ConfigError(f"{detail}. {_keep_batch_hint(math.prod(saved), self.micro, self.world_size)}, or "
                              "resume anyway with --allow_batch_change (Trainer(allow_batch_change=True))")
        self.log(f"warning: {detail}; resuming anyway (allow_batch_change)")

    def save(self) -> str:
        """Checkpoint the current step as tag ``stepNNNNNNNN`` (every rank: a collective)
        with the sampler position, the run history and the batch geometry in the
        marker's metadata; then remove the oldest complete checkpoints beyond
        ``ds_pfc.checkpoint.keep`` (by step; never the newest nor the one ``latest``
        names). A tag holding this very state (the one this run resumed or last saved)
        is not written again, but ``latest`` is pointed at it. Returns the tag
        directory."""
        tag = f"step{self.engine.global_steps:08d}"
        path = os.path.join(self.checkpoint_dir, tag)
        started = time.perf_counter()
        history = getattr(self, "history", None) or {"start_step": self.engine.global_steps, "losses": [],
                                                     "evaluations": {}}
        if tag in (self._resumed_tag, self._saved_tag):
            tags.on_rank0(lambda: _point_latest(self.checkpoint_dir, tag))
        else:
            # The job config (with the command-line overrides) and the data position,
            # which a resume checks from the marker before it loads anything.
            metadata = {"config": self.raw_config, "overrides": dict(self.overrides), "micro": self.micro,
                        "gradient_accumulation_steps": self.gas, "world_size": self.world_size,
                        "global_batch": self.micro * self.gas * self.world_size,
                        "sampler": self.sampler.state_dict(), "ran": self.ran_record(),
                        "labels_sha256": getattr(self.dataset, "digest", None)}
            # A complete tag of this step that this run did not write belongs to a run
            # rolled back past it: this run's state replaces it.
            with self._heartbeat(f"checkpoint {tag}"):
                path = self.engine.save_checkpoint(self.checkpoint_dir, tag, replace=True, metadata=metadata,
                                                   client_state={"ds_pfc_config": self.raw_config["ds_pfc"],
                                                                 "ds_pfc_history": _plain_history(history),
                                                                 "ds_pfc_lr_scale": self.lr_scale},
                                                   rank_state={"sampler": self.sampler.state_dict()})
            self._saved_tag = tag
        keep = self.cfg.checkpoint.keep
        tags.on_rank0(lambda: tags.prune(self.checkpoint_dir, keep))
        seconds = time.perf_counter() - started
        self.log(f"checkpoint {path} ({_gib(_tree_bytes(path)) if self.rank == 0 else '?'}, {seconds:.1f} s)")
        return path

    # -- loop -------------------------------------------------------------------------
    def _batches(self):
        """Endless micro batches across epochs. An epoch is a whole number of optimizer
        steps: the micro batches left over at its end (fewer than one step's worth) are
        skipped, so the next epoch starts at the same step on any number of ranks."""
        per_step = self.micro * self.gas
        while True:
            if len(self.sampler) < per_step:
                self.sampler.set_epoch(self.sampler.epoch + 1)
            count = len(self.sampler) // per_step * self.gas
            loader = iter(MicroBatchLoader(self.dataset, self.sampler, flip=self.cfg.data.flip,
                                           seed=self.cfg.data.seed, workers=self.cfg.data.workers,
                                           prefetch=self.cfg.data.prefetch_batches,
                                           device=self.device, dtype=self.engine.dtype,
                                           decode_on_device=self.decode_on_device))
            try:
                for _ in range(count):
                    yield next(loader)
            finally:
                loader.close()

    def run_evaluation(self) -> dict:
        if not self.eval_sets:
            return {}
        ev = self.cfg.evaluation
        start = time.perf_counter()
        self.engine.broadcast_buffers()       # every rank evaluates the model the export will hold
        results = evaluate(self.engine.module, self.eval_sets, batch_size=ev.batch_size, flip=ev.flip, far=ev.far,
                           device=self.device, dtype=self.engine.dtype, rank=self.rank, world_size=self.world_size)
        self.log(f"eval step {self.engine.global_steps}: {_format_eval(results)} "
                 f"({time.perf_counter() - start:.1f} s)")
        events = []
        for name, r in results.items():
            events.append((f"Eval/Samples/{name}_accuracy", r.accuracy))
            # a TAR that cannot be measured (too few pairs for the FAR) is left out
            events += [(f"Eval/Samples/{name}_tar_at_far_{far:g}", tar) for far, tar in r.tar_at_far.items()
                       if math.isfinite(tar)]
        self._monitor(events)
        return results

    def _continue_monitor_files(self) -> None:
        """Rank 0: the csv monitor's files continue at the sample count training continues
        from, at the start and after a rollback
        (:func:`~ds_pfc.app.run_outputs.continue_csv_monitor`)."""
        if self.rank != 0:
            return
        from .run_outputs import continue_csv_monitor
        inner = self.engine.engine
        files, removed = continue_csv_monitor(inner, int(inner.global_samples))
        if removed:
            self.log(f"monitor: removed {removed} csv row(s) from {len(files)} file(s): rows past sample "
                     f"{inner.global_samples} (written after the checkpoint training continues from) and repeated "
                     "header lines")

    def _monitor(self, events: list[tuple[str, float]], samples: int | None = None) -> None:
        """Write ``(name, value)`` events to DeepSpeed's monitors (csv, TensorBoard,
        W&B) at the engine's sample count (or ``samples``: a step's, written later), as
        DeepSpeed writes the learning rate."""
        inner = self.engine.engine
        monitor = getattr(inner, "monitor", None)
        if monitor is not None and monitor.enabled and self.rank == 0:
            at = inner.global_samples if samples is None else samples
            monitor.write_events([(name, value, at) for name, value in events])

    def run(self) -> dict:
        """Train to ``total_steps`` (resuming if a checkpoint exists), evaluate, save,
        export. Returns a summary dict (losses per step, evaluations, paths). With
        ``total_steps`` 0 (``max_steps`` 0) nothing trains: the initial state (the init
        weights, or the seed's fresh ones) is evaluated, saved as ``step00000000`` and
        exported."""
        if not hasattr(self, "engine"):
            self.setup()
        resumed = self.resume()
        self._continue_monitor_files()
        if self._nonfinite is not None:         # its records live in the history (every checkpoint)
            records = self.history.setdefault("nonfinite", {})
            for kind in ("skipped", "rollbacks"):
                records.setdefault(kind, [])
            self._nonfinite.records = records
        cfg, engine = self.cfg, self.engine
        summary = {"losses": self.history["losses"], "evaluations": self.history["evaluations"], "resumed": resumed}
        flips = self.flip_mechanism
        if flips is not None:
            summary["flip_mechanism"] = self.history.setdefault("flip_mechanism", {})
        step = engine.global_steps
        if not resumed and cfg.evaluation.at_start and step < self.total_steps:   # else _finish evaluates it
            summary["evaluations"][0] = self.run_evaluation()
        progress = _Progress(time.perf_counter(), step)
        last_save = time.monotonic()        # ds_pfc.checkpoint.every_minutes counts from here
        if step < self.total_steps:         # max_steps 0 (or a resumed run at its end): no step
            with _Preemption(cfg.train.preempt_signals) as preempt:
                step = self._train_steps(summary, step, progress, last_save, preempt)
        else:
            self.log(f"no training steps to run (step {step} of {self.total_steps}): saving the state as it is")
        return self._finish(summary, step, progress)

    def _train_steps(self, summary, step, progress, last_save, preempt) -> int:
        """The training loop of :meth:`run`, to ``total_steps`` or a preemption (which
        saves a checkpoint and raises :class:`Preempted`). Returns the last step."""
        cfg, engine = self.cfg, self.engine
        flips, guard = self.flip_mechanism, self._nonfinite
        bar = _Bar(self.total_steps) if self.rank == 0 and sys.stderr.isatty() else None
        window, batches = [], self._batches()
        # ds_pfc.head.validate 'deferred' (with on_nonfinite stop): a step's loss and accuracy
        # are read one step later (no host sync), and its record written then, in order.
        late = guard is None and cfg.head.validate == "deferred"
        pending = None          # (the step's record, LateRead of its [gas, 2] values)
        batch = next(batches)

        def emit(record, pairs):
            """Summary, monitors, progress bar and log line of one step, from its
            micro batches' (loss, accuracy) in order."""
            nonlocal window
            step_loss = step_acc = 0.0
            for loss_value, acc_value in pairs:
                step_loss += loss_value / self.gas
                step_acc += acc_value / self.gas
            summary["losses"].append(step_loss)
            window.append((step_loss, step_acc))
            self._monitor([("Train/Samples/train_loss", step_loss), ("Train/Samples/train_accuracy", step_acc)],
                          samples=record["samples"])
            if bar is not None:
                bar.update(record["step"], step_loss)
            if record["line"] is not None:
                first, rest = record["line"]
                self.log(f"{first} loss {sum(w[0] for w in window) / len(window):.4f} acc "
                         f"{sum(w[1] for w in window) / len(window):.4f} {rest}")
                self._monitor([("Train/Samples/samples_per_second", record["rate"])], samples=record["samples"])
                window = []

        def emit_pending():
            nonlocal pending
            if pending is not None:
                record, read = pending
                pending = None
                emit(record, read.values())

        def check_head(at):
            """The head's checks put off by validate 'deferred', judged before anything is
            evaluated, saved or ended on a step whose input may have been bad."""
            try:
                self.head.check_deferred()
            except ValueError as err:
                raise self._stopped(at, err) from err

        while step < self.total_steps:
            pairs, values = [], []
            dropped = False
            if guard is not None:
                guard.before_step()
            for _ in range(self.gas):
                images, labels = batch
                embeddings = engine(images)
                reason = None
                try:
                    out = self.head(embeddings, labels, return_details=True)
                except ValueError as err:        # the head's checks, on every rank together
                    if guard is None or not isinstance(err, NonFiniteError):
                        # validate 'deferred': the error may be the previous step's (it says so).
                        raise self._stopped(step + 1, err) from err
                    reason, head_ran = str(err), False
                if guard is not None and reason is None:
                    # Read before backward, so that a non-finite loss (the same on every
                    # rank) can still be dropped: the step's one host sync, moved earlier.
                    loss_value, acc_value = _host_values(out)
                    pairs.append((loss_value, acc_value))
                    if not math.isfinite(loss_value):
                        reason, head_ran = f"the loss is {loss_value} with finite embeddings", True
                if reason is not None:           # only with on_nonfinite skip/rollback (one micro batch)
                    self.sampler.advance(self.micro)        # the batch is consumed either way
                    before = step
                    step, batches = self._on_nonfinite(step + 1, reason, head_ran, batches)
                    batch = next(batches)
                    if step < before:            # rolled back: rates and the summary restart there
                        progress.start, progress.start_step, progress.samples = time.perf_counter(), step, 0
                        summary["losses"], summary["evaluations"] = self.history["losses"], \
                            self.history["evaluations"]
                        window = []
                    dropped = True
                    break
                if flips is not None:
                    flips.observe(embeddings, labels, self._batch_true_labels(labels))
                self.sampler.advance(self.micro)
                batch = next(batches)
                if self.head._stager is not None:
                    # Tiered bank: the next step's rows are staged behind this step's
                    # backward, optimizer step and next forward (the whole step).
                    self.head.prefetch(batch[1])
                engine.backward(out.loss)
                engine.step()
                if late:                         # no host sync: read with the next step
                    values.append(torch.stack([out.loss.detach(), out.accuracy.detach()]))
                elif guard is None:              # the step's one host sync, after the step is queued
                    pairs.append(tuple(_host_values(out)))
            if dropped:
                continue
            emit_pending()                       # the previous step's record, before this step's
            if guard is not None:
                guard.after_step()
            step = engine.global_steps
            if flips is not None:
                flips.after_step(step)
                if self._flip_interval_due(step):
                    self._close_flip_interval(step)
            progress.samples += self.micro * self.gas * self.world_size
            # What the step's record needs from the host, taken now (its values may come later).
            record = {"step": step, "samples": engine.engine.global_samples, "line": None, "rate": None}
            if step % cfg.train.log_every == 0 or step == self.total_steps:
                elapsed = time.perf_counter() - progress.start
                rate = progress.samples / max(elapsed, 1e-9)
                eta = (self.total_steps - step) * (elapsed / max(step - progress.start_step, 1))
                # The learning rate the last optimizer step applied (the engine's
                # get_lr() already holds the next step's).
                lr = engine.last_lr if engine.last_lr is not None else engine.get_lr()
                from .run_outputs import loss_scale_text
                record["rate"] = rate
                record["line"] = (f"step {step}/{self.total_steps} epoch {self.sampler.epoch}",
                                  f"lr {lr:.3e} {rate:.1f} samples/s eta {_duration(eta)}"
                                  + loss_scale_text(engine.engine)
                                  + (f" skipped {engine.skipped_steps}" if engine.skipped_steps else ""))
            if late:
                pending = (record, LateRead(torch.stack(values)))
            else:
                emit(record, pairs)
            evaluate = bool(cfg.evaluation.every_steps) and step % cfg.evaluation.every_steps == 0 \
                and step < self.total_steps
            if late and (evaluate or step >= self.total_steps):
                # Everything of this step is read and checked before it is evaluated or the
                # loop ends: the one host sync of such a step.
                check_head(step)
                emit_pending()
            if evaluate:
                summary["evaluations"][step] = self.run_evaluation()
            by_steps = bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0
            by_time, signum = self._step_flags(last_save, preempt)
            if late and (by_steps or by_time or signum):
                check_head(step)                 # and before it is saved
                emit_pending()
            if signum and step < self.total_steps:
                name = _signal_name(signum)
                self.log(f"preempted by {name} at step {step}: writing a checkpoint, then exiting with code "
                         f"{PREEMPTED_EXIT_CODE} (rerun the same command to continue)")
                batches.close()
                if bar is not None:
                    bar.close()
                self.engine.broadcast_buffers()
                path = self.save()
                raise Preempted(name, step, path)
            if (by_steps or by_time) and step < self.total_steps:
                if by_time and not by_steps:
                    self.log(f"checkpoint: {cfg.checkpoint.every_minutes:g} min of wall time since the last one")
                self.engine.broadcast_buffers()
                self.save()
                last_save = time.monotonic()
        batches.close()
        if bar is not None:
            bar.close()
        return step

    def _finish(self, summary, step, progress) -> dict:
        """The end of :meth:`run`: last evaluation, checkpoint and export."""
        cfg, flips = self.cfg, self.flip_mechanism
        if flips is not None:
            self._close_flip_interval(step)
        summary["train_elapsed_s"] = time.perf_counter() - progress.start
        summary["train_samples"] = progress.samples
        summary["evaluations"][step] = self.run_evaluation()
        self.engine.broadcast_buffers()
        summary["checkpoint"] = self.save()
        if cfg.checkpoint.export:
            summary["export"] = self.export(summary["checkpoint"])
        summary["elapsed_s"] = time.perf_counter() - progress.start
        return summary

    def _stopped(self, step: int, err: ValueError) -> "TrainingStopped":
        """The error that ends training when the head refuses a step's batch: what it
        said, the newest complete checkpoint, and the usual fixes."""
        found = list_checkpoints(self.checkpoint_dir)
        last = (f"the newest complete checkpoint is {os.path.join(self.checkpoint_dir, found[-1])}" if found
                else "no checkpoint was written yet")
        text = str(err)
        if isinstance(err, NonFiniteError) or "NaN or Inf" in text or "the loss is" in text:
            fix = ("the run diverged: resume with a lower learning rate or warm-up peak (--allow_config_change), "
                   "check gradient_clipping, or train in bf16 instead of fp16; ds_pfc.train.on_nonfinite 'skip' "
                   "drops a bad batch's step and 'rollback' reloads the newest checkpoint with a lower learning "
                   "rate; see docs/troubleshooting.md")
        elif "labels" in text:
            fix = "ds_pfc.head.num_classes must cover every label of the training set"
        else:
            fix = "see docs/troubleshooting.md"
        return TrainingStopped(f"step {step}: {text}; {last}; {fix}")

    def _on_nonfinite(self, step: int, reason: str, head_ran: bool, batches):
        """``ds_pfc.train.on_nonfinite`` for a step whose embeddings or loss are NaN/Inf
        (every rank calls it, at the same step: the head's refusal and the loss are the
        same on every rank). Nothing of the step was back-propagated or applied. Returns
        ``(step to continue from, batches)``."""
        guard, policy = self._nonfinite, self.cfg.train.on_nonfinite
        if policy == "skip":
            if head_ran:
                # The head's forward already sampled and advanced its state: only a reload undoes it.
                raise self._stopped(step, ValueError(f"{reason}: the head's state is damaged, which skipping a "
                                                     "step cannot mend (on_nonfinite 'rollback' can)"))
            guard.restore_buffers()
            self.head.zero_grad()            # and a prefetch staged for this batch
            guard.consecutive += 1
            guard.records["skipped"].append({"step": step, "reason": reason})
            count = len(guard.records["skipped"])
            if guard.consecutive > self.cfg.train.max_consecutive_skips:
                raise self._stopped(step, ValueError(
                    f"{reason}; {guard.consecutive} steps in a row were non-finite (more than "
                    "ds_pfc.train.max_consecutive_skips): the model itself has diverged, which skipping cannot "
                    "mend (on_nonfinite 'rollback' reloads the newest checkpoint)"))
            self.log(f"step {step}: skipped on every rank ({reason}); its batch is dropped, nothing changed; "
                     f"{count} step(s) skipped in this run (ds_pfc.train.on_nonfinite skip)")
            self._monitor([("Train/Samples/skipped_steps", count)])
            return step - 1, batches
        # rollback
        # Rank 0 lists them for every rank (one answer, whatever each file system cache says).
        found = tags.on_rank0(lambda: [i.name for i in tags.complete_tags(self.checkpoint_dir)
                                       if i.steps < step and i.name not in guard.bad_tags])
        if guard.last_target is not None and not guard.stepped_since_rollback:
            # Not one step succeeded from there: that checkpoint may hold the damage already.
            guard.bad_tags.add(guard.last_target)
            found = [t for t in found if t != guard.last_target]
        done = len(guard.records["rollbacks"])
        if done >= self.cfg.train.max_rollbacks or not found:
            why = (f"{done} rollback(s) already (ds_pfc.train.max_rollbacks)" if found
                   else "no complete checkpoint to roll back to")
            raise self._stopped(step, ValueError(f"{reason}; {why}"))
        tag = found[-1]
        batches.close()
        self.head.zero_grad()
        self.lr_scale *= self.cfg.train.rollback_lr_factor
        with self._heartbeat(f"rolling back to {tag}"):
            loaded = self.engine.load_checkpoint(self.checkpoint_dir, tag)
        self.sampler.load_state_dict(loaded["rank_state"]["sampler"])
        self._after_load(loaded)
        self._continue_monitor_files()          # the rows of the abandoned steps go
        guard.records["rollbacks"].append({"step": step, "reason": reason, "to": tag, "lr_scale": self.lr_scale})
        self.history["nonfinite"] = guard.records
        guard.last_target, guard.stepped_since_rollback, guard.consecutive = tag, False, 0
        # The newer tags this run wrote hold the abandoned trajectory: the next save of such a
        # step writes the new state over them.
        self._resumed_tag, self._saved_tag = tag, None
        self.log(f"step {step}: {reason}; rolled back every rank to {os.path.join(self.checkpoint_dir, tag)} "
                 f"(step {self.engine.global_steps}) with the learning rate x{self.lr_scale:g} "
                 f"(rollback {done + 1} of at most {self.cfg.train.max_rollbacks}; ds_pfc.train.on_nonfinite "
                 "rollback)")
        return self.engine.global_steps, self._batches()

    def _step_flags(self, since: float, preempt) -> tuple[bool, int]:
        """``(time checkpoint due, preempting signal or 0)`` at the end of a step, the same
        on every rank: whether ``ds_pfc.checkpoint.every_minutes`` have passed since
        ``since`` on any rank's clock, and the signal any rank received. One all-reduce of
        two numbers a step (none when neither is configured, or on one process)."""
        minutes = self.cfg.checkpoint.every_minutes
        due = bool(minutes) and time.monotonic() - since >= 60.0 * minutes
        if not (minutes or preempt.active):
            return False, 0
        received = preempt.poll()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return due, received
        from ..devices import collective_device
        flags = torch.tensor([float(due), float(received)], device=collective_device(None, self.device))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        due, signum = flags.tolist()
        return bool(due), int(signum)

    def export(self, tag_dir: str) -> str:
        """Write ``export/model.safetensors`` (backbone + merged classifier) from
        checkpoint ``tag_dir`` on rank 0; every rank calls it and an error raises on
        every rank. The file gets the usual mode (0644 under the default umask)."""
        from ..checkpoint.export import export_checkpoint
        out = os.path.join(self.output_dir, "export", "model.safetensors")
        started = time.perf_counter()
        with self._heartbeat(f"export {out}"):
            tags.on_rank0(lambda: export_checkpoint(tag_dir, out, config=self.raw_config))
        seconds = time.perf_counter() - started
        self.log(f"export {out} ({_gib(os.path.getsize(out)) if self.rank == 0 else '?'}, {seconds:.1f} s)")
        return out

    def close(self) -> None:
        """Release the head's bank (its I/O worker and host tables)."""
        head = getattr(self, "head", None)
        if head is not None:
            head.close()


def _extensions_dir() -> str:
    """Where torch keeps JIT-built extensions (DeepSpeed's ops)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join("~", ".cache", "torch_extensions")


def _raised_in(err: BaseException) -> str:
    """The file of the innermost frame ``err`` was raised in ('' when unknown)."""
    import traceback
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1].filename if frames else ""


def _short_path(path: str) -> str:
    """``.../site-packages/deepspeed/x.py`` -> ``deepspeed/x.py``."""
    for root in ("deepspeed", "torch"):
        marker = os.sep + root + os.sep
        if marker in path:
            return root + os.sep + path.split(marker, 1)[1]
    return path


def _tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 if it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class _NonFiniteGuard:
    """State of ``ds_pfc.train.on_nonfinite`` skip/rollback: the run's records (kept in
    the history, so in every checkpoint), the count of skips in a row, the checkpoints a
    rollback found damaged, and a copy of the module's buffers from the start of the
    step (a NaN forward moves BatchNorm's running statistics before the head sees it)."""

    def __init__(self, module):
        self.records = {"skipped": [], "rollbacks": []}
        self.consecutive = 0
        self.bad_tags: set[str] = set()
        self.last_target: str | None = None
        self.stepped_since_rollback = False
        self._buffers = [b for b in module.buffers()]
        self._saved = [b.detach().clone() for b in self._buffers]

    def before_step(self) -> None:
        if self._buffers:
            torch._foreach_copy_(self._saved, [b.detach() for b in self._buffers])

    def restore_buffers(self) -> None:
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._saved)

    def after_step(self) -> None:
        self.consecutive = 0
        self.stepped_since_rollback = True


class TrainingStopped(Exception):
    """Training cannot go on with this input or state (the head refused a step's batch:
    NaN or Inf embeddings, labels out of range); the message says what and what to do."""


#: Exit status of a preempted run (sysexits' EX_TEMPFAIL: try again): a Slurm script requeues on it.
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """A preempting signal stopped training after a complete checkpoint (``path``) of
    ``step``; rerunning the same command resumes from it."""

    def __init__(self, signal_name: str, step: int, path: str):
        super().__init__(f"preempted by {signal_name} at step {step}: saved {path}; rerun the same command to "
                         f"continue (exit code {PREEMPTED_EXIT_CODE})")
        self.signal_name, self.step, self.path = signal_name, step, path


LAUNCHER_GONE = 1000
"""The "signal" number of a preemption by the end of the rank's ``deepspeed`` launcher
(above every real signal number; the ranks agree on the largest)."""


def _signal_name(signum: int) -> str:
    if signum == LAUNCHER_GONE:
        return "the end of its deepspeed launcher"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _LauncherWatch:
    """Whether the ``deepspeed`` launcher of this rank is gone. A rank started by
    DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, the rank's parent)
    notes at the start the launcher and the process that started it (the ``deepspeed``
    command on one node, the remote shell of a multi-node launch). ``deepspeed`` on one
    node installs no signal handler: a SIGTERM sent to it alone ends it and leaves the
    launcher and the ranks running; a launcher killed outright leaves the ranks alone
    too. :meth:`gone` says so once either process has ended (the launcher's parent, or
    this rank's, is another process then), at most one look per ``every_s`` seconds.
    Not under any other launcher (``active`` False)."""

    every_s = 1.0

    def __init__(self):
        self.launcher = self.starter = None
        self._process = None
        self._next = 0.0
        try:
            import psutil
            parent = psutil.Process(os.getppid())
            if any("deepspeed.launcher.launch" in part
                   or part.endswith(os.path.join("deepspeed", "launcher", "launch.py")) for part in parent.cmdline()):
                self.launcher, self.starter, self._process = parent.pid, parent.ppid(), parent
        except Exception:            # no psutil, no /proc, a parent already gone: no watch
            self.launcher = self.starter = None

    @property
    def active(self) -> bool:
        return self.launcher is not None

    def gone(self) -> bool:
        if self.launcher is None:
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every_s
        if os.getppid() != self.launcher:
            return True
        try:
            return self.starter > 1 and self._process.ppid() != self.starter
        except Exception:            # the launcher ended between the two looks
            return True


class _Preemption:
    """Within it, the named signals only record that they arrived (``received``: the first
    one's number, 0 while none), so that the loop can finish its step and checkpoint; the
    previous handlers come back on exit. Outside the main thread nothing is installed
    (``active`` False). With any preempting signal configured, the end of the rank's
    ``deepspeed`` launcher (:class:`_LauncherWatch`) preempts too (``received``
    :data:`LAUNCHER_GONE`), as a SIGTERM the launcher would forward: :meth:`poll`."""

    def __init__(self, names):
        self._signals = [getattr(signal, n) for n in names]
        self._previous = {}
        self.received = 0
        self.active = False
        self._watch = None

    def _handle(self, signum, frame):
        if not self.received:
            self.received = signum

    def poll(self) -> int:
        """``received``, after a look at the launcher."""
        if not self.received and self._watch is not None and self._watch.gone():
            self.received = LAUNCHER_GONE
        return self.received

    def __enter__(self):
        if self._signals and threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            self.active = True
        if self._signals:
            watch = _LauncherWatch()
            if watch.active:
                self._watch, self.active = watch, True
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False


def _batch_geometry(ds_config: dict) -> tuple[int, int]:
    """``(micro batch per rank, gradient accumulation steps)`` as DeepSpeed derives them
    from the config at this world size (after ``init_distributed``)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        resolved = DeepSpeedConfig(dict(ds_config))
    except (AssertionError, ValueError) as err:
        what = "the batch settings" if "batch" in str(err).lower() else "the config"
        raise ConfigError(f"DeepSpeed rejects {what}: {err}") from None
    return int(resolved.train_micro_batch_size_per_gpu), int(resolved.gradient_accumulation_steps)


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _keep_batch_hint(global_batch: int, micro: int, world_size: int) -> str:
    """How to keep ``global_batch`` on ``world_size`` ranks."""
    if global_batch % world_size:
        return (f"A global batch of {global_batch} does not split over {world_size} rank(s); resume on a number of "
                "ranks that divides it")
    per_rank = global_batch // world_size
    if per_rank % micro == 0:
        return (f"Keep the global batch: on {world_size} rank(s) set gradient_accumulation_steps to "
                f"{per_rank // micro} (micro batch {micro}), or set train_batch_size to {global_batch}")
    fits = max(m for m in range(1, min(micro, per_rank) + 1) if per_rank % m == 0)
    return (f"Keep the global batch: on {world_size} rank(s) each rank needs {per_rank} images per step, e.g. "
            f"train_micro_batch_size_per_gpu {fits} x gradient_accumulation_steps {per_rank // fits}")


def _with_resume_hint(err: tags.CheckpointError) -> tags.CheckpointError:
    if err.fallback is None:
        return err
    return type(err)(f"{err}; resume from it with launch/train.py --resume_from {err.fallback} "
                     f"(Trainer(resume_from={err.fallback!r}))", path=err.path, fallback=err.fallback)


def _point_latest(checkpoint_dir: str, tag: str) -> None:
    try:
        current = tags.read_latest(checkpoint_dir)
    except tags.CheckpointError:
        current = None
    if current != tag:
        tags.write_latest(checkpoint_dir, tag)
    tags.clean_leftovers(checkpoint_dir)


def _saved_batch(marker: dict) -> tuple[int, int, int] | None:
    """``(micro, accumulation, ranks)`` a checkpoint was trained with: recorded in its
    marker, or, for markers without them, from the job config it carries."""
    meta = marker.get("metadata") or {}
    try:
        if "micro" in meta:
            return int(meta["micro"]), int(meta["gradient_accumulation_steps"]), int(meta["world_size"])
        ds = meta.get("config") or {}
        if "train_micro_batch_size_per_gpu" in ds:
            return (int(ds["train_micro_batch_size_per_gpu"]), int(ds.get("gradient_accumulation_steps", 1)),
                    int(marker["world_size"]))
    except (KeyError, TypeError, ValueError):
        pass
    return None


def _plain_evaluation(results) -> dict:
    """One evaluation (``name -> VerificationResult`` or its plain form) as plain data."""
    out = {}
    for name, r in results.items():
        if isinstance(r, dict):
            out[name] = dict(r)
        else:
            out[name] = {"accuracy": float(r.accuracy), "accuracy_std": float(r.accuracy_std),
                         "tar_at_far": {str(k): float(v) for k, v in r.tar_at_far.items()}}
    return out


def _plain_history(history: dict) -> dict:
    """The run history as plain Python data (checkpoints must load without this
    module's classes)."""
    plain = {"start_step": int(history["start_step"]), "losses": [float(x) for x in history["losses"]],
             "evaluations": {int(step): _plain_evaluation(r) for step, r in history["evaluations"].items()}}
    if history.get("flip_mechanism"):       # plain numbers already (FlipMechanism.interval)
        plain["flip_mechanism"] = {int(step): dict(v) for step, v in history["flip_mechanism"].items()}
    if history.get("nonfinite"):            # ds_pfc.train.on_nonfinite's records (plain already)
        plain["nonfinite"] = copy.deepcopy(history["nonfinite"])
    return plain


def _host_values(out) -> list:
    """``[loss, accuracy]`` of a head output as Python floats: one device-to-host copy."""
    return torch.stack([out.loss.detach(), out.accuracy.detach()]).tolist()


def _restored_history(saved: dict | None, steps: int) -> dict:
    """The history saved with a checkpoint at ``steps``; one that does not end there
    (or none) keeps only what is consistent."""
    if not saved:
        return {"start_step": steps, "losses": [], "evaluations": {}}
    start, losses = int(saved.get("start_step", 0)), list(saved.get("losses", []))
    evaluations = {int(k): v for k, v in (saved.get("evaluations") or {}).items() if int(k) <= steps}
    if start + len(losses) != steps:
        start, losses = steps, []
    restored = {"start_step": start, "losses": losses, "evaluations": evaluations}
    flips = {int(k): v for k, v in (saved.get("flip_mechanism") or {}).items() if int(k) <= steps}
    if flips:
        restored["flip_mechanism"] = flips
    if saved.get("nonfinite"):
        restored["nonfinite"] = {kind: [r for r in records if int(r["step"]) <= steps]
                                 for kind, records in saved["nonfinite"].items()}
    return restored


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Bar:
    """A one-line progress bar on stderr for interactive terminals."""

    def __init__(self, total: int):
        self.total, self.start = total, time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        done = step / self.total
        filled = int(30 * done)
        rate = (time.perf_counter() - self.start) / max(step, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} loss {loss:.3f} "
                         f"eta {_duration(rate * (self.total - step))} ")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
