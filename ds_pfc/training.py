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

import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError, DsPfcConfig, ScheduleConfig, split_config
from .data.loader import MicroBatchLoader
from .data.sampler import DistributedIdentitySampler
from .deepspeed_plugin import PfcEngine, initialize, list_checkpoints, remove_checkpoint
from .devices import bind_local_device

__all__ = ["Trainer", "load_config", "schedule_factor", "build_eval_sets", "evaluate"]


def load_config(path: str) -> dict:
    """Read a job JSON (clear errors for a missing file or bad JSON)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path!r}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None


def schedule_factor(schedule: ScheduleConfig, steps_per_epoch: int, total_steps: int):
    """``step -> factor`` of the peak learning rate (for ``torch.optim.lr_scheduler.LambdaLR``)."""
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


# ---------------------------------------------------------------------------- data
def build_train_set(cfg: DsPfcConfig):
    data = cfg.data
    if data.source == "synthetic":
        from .data.faces import SyntheticFaces
        s = data.synthetic
        return SyntheticFaces(s.identities, s.images_per_identity, image_size=s.image_size, seed=s.seed)
    if not os.path.exists(data.path):
        raise FileNotFoundError(f"ds_pfc.data.path {data.path!r} does not exist")
    if data.source == "recordio":
        from .data.recordio import InsightFaceRecord
        dataset = InsightFaceRecord(data.path)
    else:
        from .data.hf import load_image_dataset
        dataset = load_image_dataset(data.path, split=data.split, image_column=data.image_column,
                                     label_column=data.label_column)
    if dataset.num_classes > cfg.head.num_classes:
        raise ConfigError(f"the data has labels up to {dataset.num_classes - 1} but ds_pfc.head.num_classes is "
                          f"{cfg.head.num_classes}")
    return dataset


def build_eval_sets(cfg: DsPfcConfig) -> dict[str, tuple[torch.Tensor, list[bool]]]:
    """Verification pair sets: ``name -> (uint8 images [2P, 3, H, W], issame)``."""
    sets = {}
    ev = cfg.evaluation
    if cfg.data.source == "synthetic" and ev.synthetic_pairs:
        from .data.faces import SyntheticFaces
        s = cfg.data.synthetic
        held = SyntheticFaces(s.held_out_identities, s.images_per_identity, image_size=s.image_size,
                              first_identity=s.identities, seed=s.seed)
        sets["synthetic_held_out"] = held.pairs(ev.synthetic_pairs, seed=s.seed)
    for path in ev.bins:
        from .data.transforms import decode_image
        from .eval.verification import load_bin
        images, issame = load_bin(path, decode=decode_image)
        sets[os.path.splitext(os.path.basename(path))[0]] = (torch.stack(images), issame)
    return sets


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
    from .data.transforms import normalize
    from .eval.verification import embed, verification_metrics
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
    """

    def __init__(self, config: dict, *, output_dir: str | None = None, max_steps: int | None = None, log=None):
        self.raw_config = config
        self.ds_config, self.cfg = split_config(config)
        if output_dir is not None:
            self.cfg.train.output_dir = output_dir
        if max_steps is not None:
            self.cfg.train.max_steps = max_steps
        self._log = log or (lambda line: print(line, flush=True))
        self._check_ds_config()

    def _check_ds_config(self) -> None:
        ds = self.ds_config
        if "train_micro_batch_size_per_gpu" not in ds:
            raise ConfigError("the config must set train_micro_batch_size_per_gpu (the per-rank micro batch)")
        if self.cfg.train.schedule is not None and "scheduler" in ds:
            raise ConfigError("set either DeepSpeed's 'scheduler' block or ds_pfc.train.schedule, not both")
        if "optimizer" not in ds:
            raise ConfigError("the config must have DeepSpeed's 'optimizer' block (the backbone's optimizer; "
                              "its lr is also the heads' base learning rate)")

    rank = 0

    def log(self, line: str) -> None:
        if self.rank == 0:
            self._log(line)

    # -- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        cfg = self.cfg
        self.dataset = build_train_set(cfg)      # bad data paths fail before any process group exists
        # cuda:LOCAL_RANK before any CUDA work: DeepSpeed binds the device only inside
        # deepspeed.initialize, after the head, the data and the evaluation exist.
        bound = bind_local_device()
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = bound or torch.device(get_accelerator().current_device_name())
        self.micro = int(self.ds_config["train_micro_batch_size_per_gpu"])
        self.gas = int(self.ds_config.get("gradient_accumulation_steps", 1))
        self.output_dir = cfg.train.output_dir
        self.checkpoint_dir = os.path.join(self.output_dir, "checkpoints")

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
        self.total_steps = max(total, 1)

        torch.manual_seed(cfg.train.seed)
        backbone = cfg.backbone.build(cfg.head.embedding_size)
        head = cfg.head.build(group=None, device=self.device)
        scheduler, self.schedule = None, None
        if cfg.train.schedule is not None:
            factor = self.schedule = schedule_factor(cfg.train.schedule, self.steps_per_epoch, self.total_steps)

            def scheduler(optimizer):
                return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        ds_config = dict(self.ds_config)
        monitor = ds_config.get("csv_monitor")
        if isinstance(monitor, dict) and monitor.get("enabled") and "output_path" not in monitor:
            ds_config["csv_monitor"] = dict(monitor, output_path=os.path.join(self.output_dir, "monitor"))
        self.engine: PfcEngine = initialize(model=backbone, config=ds_config, lr_scheduler=scheduler,
                                            heads={"head": (head, cfg.head.optimizer.lr_ratio)})
        self.head = head
        self.eval_sets = build_eval_sets(cfg)
        params = sum(p.numel() for p in backbone.parameters())
        self.log(f"ds_pfc: {self.world_size} rank(s) on {self.device.type}, backbone {cfg.backbone.name} "
                 f"(width {cfg.backbone.width}, {params / 1e6:.2f} M parameters), {head}")
        self.log(f"data: {cfg.data.source}, {len(self.dataset)} images, {self.steps_per_epoch} steps/epoch of "
                 f"{self.micro} x {self.gas} x {self.world_size} = {self.micro * self.gas * self.world_size} images; "
                 f"{self.total_steps} steps")

    # -- checkpoints ------------------------------------------------------------------
    def resume(self) -> bool:
        if not self.cfg.checkpoint.resume:
            if list_checkpoints(self.checkpoint_dir):
                raise ConfigError(f"{self.checkpoint_dir} holds checkpoints but resuming is off; use another "
                                  "output_dir or remove them")
            return False
        loaded = self.engine.load_checkpoint(self.checkpoint_dir)
        if loaded is None:
            return False
        self.sampler.load_state_dict(loaded["rank_state"]["sampler"])
        if self.schedule is not None:
            # The saved optimizer carries the learning rate the saved run's schedule set
            # for the next step; this run's schedule (e.g. another max_steps) decides.
            engine = self.engine.engine
            for group, base in zip(engine.optimizer.param_groups, engine.lr_scheduler.base_lrs):
                group["lr"] = base * self.schedule(engine.lr_scheduler.last_epoch)
        self.log(f"resumed from {os.path.join(self.checkpoint_dir, loaded['tag'])} at step "
                 f"{self.engine.global_steps} (epoch {self.sampler.epoch}, saved on {loaded['world_size']} rank(s))")
        return True

    def save(self) -> str:
        tag = f"step{self.engine.global_steps:08d}"
        if os.path.isdir(os.path.join(self.checkpoint_dir, tag)) and tag in list_checkpoints(self.checkpoint_dir):
            return os.path.join(self.checkpoint_dir, tag)
        path = self.engine.save_checkpoint(self.checkpoint_dir, tag,
                                           client_state={"ds_pfc_config": self.raw_config["ds_pfc"]},
                                           rank_state={"sampler": self.sampler.state_dict()},
                                           metadata={"config": self.raw_config})
        keep = self.cfg.checkpoint.keep
        if self.rank == 0 and keep:
            for old in list_checkpoints(self.checkpoint_dir)[:-keep]:
                remove_checkpoint(self.checkpoint_dir, old)
        if self.world_size > 1:
            dist.barrier()
        self.log(f"checkpoint {path}")
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
                                           device=self.device, dtype=self.engine.dtype))
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
        results = evaluate(self.engine.module, self.eval_sets, batch_size=ev.batch_size, flip=ev.flip, far=ev.far,
                           device=self.device, dtype=self.engine.dtype, rank=self.rank, world_size=self.world_size)
        self.log(f"eval step {self.engine.global_steps}: {_format_eval(results)} "
                 f"({time.perf_counter() - start:.1f} s)")
        return results

    def run(self) -> dict:
        """Train to ``total_steps`` (resuming if a checkpoint exists), evaluate, save,
        export. Returns a summary dict (losses per step, evaluations, paths)."""
        if not hasattr(self, "engine"):
            self.setup()
        resumed = self.resume()
        cfg, engine = self.cfg, self.engine
        summary = {"losses": [], "evaluations": {}, "resumed": resumed}
        if not resumed and cfg.evaluation.every_steps:
            summary["evaluations"][0] = self.run_evaluation()
        step = engine.global_steps
        progress = _Progress(time.perf_counter(), step)
        bar = _Bar(self.total_steps) if self.rank == 0 and sys.stderr.isatty() else None
        window, batches = [], self._batches()
        batch = next(batches)
        while step < self.total_steps:
            step_loss = 0.0
            for _ in range(self.gas):
                images, labels = batch
                loss = self.head(engine(images), labels)
                engine.backward(loss)
                self.sampler.advance(self.micro)
                batch = next(batches)
                if self.head._stager is not None:      # tiered bank: stage the next step's rows now
                    self.head.prefetch(batch[1])
                engine.step()
                step_loss += float(loss.detach()) / self.gas
            step = engine.global_steps
            progress.samples += self.micro * self.gas * self.world_size
            summary["losses"].append(step_loss)
            window.append(step_loss)
            if bar is not None:
                bar.update(step, step_loss)
            if step % cfg.train.log_every == 0 or step == self.total_steps:
                elapsed = time.perf_counter() - progress.start
                rate = progress.samples / max(elapsed, 1e-9)
                eta = (self.total_steps - step) * (elapsed / max(step - progress.start_step, 1))
                self.log(f"step {step}/{self.total_steps} epoch {self.sampler.epoch} loss "
                         f"{sum(window) / len(window):.4f} lr {engine.get_lr():.3e} {rate:.1f} samples/s "
                         f"eta {_duration(eta)}")
                window = []
            if cfg.evaluation.every_steps and step % cfg.evaluation.every_steps == 0 and step < self.total_steps:
                summary["evaluations"][step] = self.run_evaluation()
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < self.total_steps:
                self.save()
        batches.close()
        if bar is not None:
            bar.close()
        summary["evaluations"][step] = self.run_evaluation()
        summary["checkpoint"] = self.save()
        if cfg.checkpoint.export:
            summary["export"] = self.export(summary["checkpoint"])
        summary["elapsed_s"] = time.perf_counter() - progress.start
        return summary

    def export(self, tag_dir: str) -> str:
        from .export import export_checkpoint
        out = os.path.join(self.output_dir, "export", "model.safetensors")
        if self.rank == 0:
            export_checkpoint(tag_dir, out, config=self.raw_config)
            self.log(f"export {out}")
        if self.world_size > 1:
            dist.barrier()
        return out

    def close(self) -> None:
        self.head.close()


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
