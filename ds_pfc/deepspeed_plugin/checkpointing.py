"""Checkpoint I/O of a :class:`~ds_pfc.deepspeed_plugin.PfcEngine`: :func:`save` and
:func:`load` (the bodies of its ``save_checkpoint`` and ``load_checkpoint``), the
heads' layouts recorded in the marker, waiting for DeepSpeed's writer to commit,
fsync, the per-rank state file with the RNG states, :func:`list_checkpoints` and
:func:`remove_checkpoint`. The engine decides what to save and passes itself in;
this module never imports it."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import uuid
from typing import TYPE_CHECKING

import torch

from ..checkpoint import files
from ..checkpoint import shards as ckpt
from ..checkpoint import tags
from ..checkpoint import universal
from .._ds_internals import internal, require_internal

if TYPE_CHECKING:
    from ..core.head import PartialFC
# ``engine`` arguments are :class:`~ds_pfc.deepspeed_plugin.engine.PfcEngine` objects; the
# annotations name it without importing it (the engine module imports this one).

__all__ = ["COMPLETE_MARKER", "list_checkpoints", "remove_checkpoint"]

COMPLETE_MARKER = tags.COMPLETE_MARKER


def head_layouts(engine: PfcEngine) -> dict[str, dict]:
    """Every head of the job, as every rank sees it (a collective over the world):
    ``name -> {"world_size": k, "num_classes": C, "embedding_size": d,
    "writers": {class rank: global rank}}``. A head's shards are indexed by its rank
    in its class group; ranks that hold the same shard (a head replicated over
    tensor-parallel ranks) leave it to the lowest global rank among them; ranks
    without the head (earlier pipeline stages) hold none."""
    mine = {name: (head.rank, head.world_size, head.num_classes, head.embedding_size)
            for name, head in engine.heads.items()}
    if torch.distributed.is_available() and torch.distributed.is_initialized() and engine.world_size > 1:
        table = [None] * engine.world_size
        torch.distributed.all_gather_object(table, mine)
    else:
        table = [mine]
    layouts: dict[str, dict] = {}
    for global_rank, heads in enumerate(table):
        for name, (rank, k, num_classes, d) in heads.items():
            layout = layouts.setdefault(name, {"world_size": k, "num_classes": num_classes, "embedding_size": d,
                                               "writers": {}})
            if (layout["world_size"], layout["num_classes"], layout["embedding_size"]) != (k, num_classes, d):
                raise ValueError(f"head {name!r} is not the same head on every rank: rank {global_rank} has "
                                 f"{num_classes} classes of size {d} over {k} rank(s), another rank "
                                 f"{layout['num_classes']} of size {layout['embedding_size']} over "
                                 f"{layout['world_size']}")
            layout["writers"].setdefault(rank, global_rank)
    for name, layout in layouts.items():
        missing = sorted(set(range(layout["world_size"])) - set(layout["writers"]))
        if missing:
            raise ValueError(f"head {name!r}: no rank holds its shard(s) {missing} of {layout['world_size']}")
    return layouts


def save(engine: PfcEngine, save_dir: str, tag: str, *, client_state: dict | None = None,
         rank_state: dict | None = None, metadata: dict | None = None, replace: bool = False) -> str:
    """:meth:`PfcEngine.save_checkpoint <ds_pfc.deepspeed_plugin.PfcEngine.save_checkpoint>`
    (its docstring describes the layout and the commit)."""
    layouts = head_layouts(engine)
    tag = tags.check_tag_name(tag)
    tag_dir = os.path.join(save_dir, tag)

    def prepare():
        os.makedirs(save_dir, exist_ok=True)
        if not replace and os.path.isfile(os.path.join(tag_dir, COMPLETE_MARKER)):
            raise FileExistsError(f"checkpoint {tag_dir} exists and is complete; use a new tag")
        return f"{tag}{tags.TMP_INFIX}{uuid.uuid4().hex}"

    staging = tags.on_rank0(prepare)
    staging_dir = os.path.join(save_dir, staging)
    error = None
    try:
        with _recorded_writes(engine.engine) as written:
            engine.engine.save_checkpoint(save_dir, staging, client_state=client_state or {}, save_latest=False)
            _wait_for_commit(engine.engine)
        os.makedirs(staging_dir, exist_ok=True)
        for name, head in engine.heads.items():
            if layouts[name]["writers"][head.rank] == engine.rank:      # one copy of a replicated shard
                written.append(ckpt.save_head_shard(head, staging_dir, name=name))
        state = {"user": rank_state or {}, "rng": _rng_state(), "world_size": engine.world_size, "rank": engine.rank,
                 "skipped_steps": engine.skipped_steps}
        written.append(os.path.join(staging_dir, tags.rank_state_name(engine.rank, engine.world_size)))
        files.atomic_torch_save(state, written[-1])
        _fsync_written(written, staging_dir, engine.engine)
    except Exception as err:
        error = err
    try:
        tags.agree(error)
    except Exception:
        if engine.rank == 0:
            shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    marker = {"tag": tag, "world_size": engine.world_size, "global_steps": engine.global_steps,
              "heads": sorted(layouts), "head_layouts": _layout_record(layouts), "metadata": metadata or {}}

    def commit():
        marker["engine_files"] = tags.engine_files(staging_dir, tags.head_world_sizes(marker), engine.world_size)
        return tags.commit_staged(save_dir, staging, tag, marker)

    return tags.on_rank0(commit)


def load(engine: PfcEngine, load_dir: str, tag: str | None = None, *, restore_rng: bool = True) -> dict | None:
    """:meth:`PfcEngine.load_checkpoint <ds_pfc.deepspeed_plugin.PfcEngine.load_checkpoint>`
    (its docstring describes the checks and what it returns)."""
    layouts = head_layouts(engine)

    def choose():
        choice = tags.choose_tag(load_dir, tag)
        if choice is not None:
            # Another world size and ZeRO partitions: DeepSpeed needs the universal
            # conversion of the tag (UniversalCheckpointError with the recipe without one).
            name, _ = universal.loadable_tag(load_dir, choice.tag, engine.world_size)
            if name != choice.tag:
                note = (f"{choice.tag} holds ZeRO partitions of {choice.marker['world_size']} rank(s): loading "
                        f"its universal conversion {name} on {engine.world_size}")
                choice = tags.Choice(name, tags.read_marker(os.path.join(load_dir, name)),
                                     f"{choice.note}; {note}" if choice.note else note)
            try:     # headers and sizes only: the ranks share the content checks below
                tags.verify_tag(os.path.join(load_dir, choice.tag), choice.marker, deep=False)
            except tags.CheckpointError as err:
                raise tags.with_fallback(err, load_dir, exclude=(choice.tag,)) from None
        return choice

    choice = tags.on_rank0(choose)
    if choice is None:
        return None
    marker, tag_dir = choice.marker, os.path.join(load_dir, choice.tag)
    if sorted(marker["heads"]) != sorted(layouts):
        raise ValueError(f"{tag_dir} holds heads {marker['heads']} but this model has {sorted(layouts)}")
    saved_world = int(marker["world_size"])
    head_shards = tags.head_world_sizes(marker)
    _verify_contents(engine, load_dir, choice.tag, marker,
                     sorted(n for n, k in head_shards.items() if k != layouts[n]["world_size"]))
    error = state = client_state = None
    try:
        client_state, state = _load_files(engine, load_dir, choice.tag, saved_world, head_shards,
                                          universal_tag=bool(marker.get("universal")))
    except Exception as err:
        error = tags.with_fallback(err, load_dir, exclude=(choice.tag,)) \
            if isinstance(err, tags.CheckpointError) else err
    tags.agree(error)
    if saved_world == engine.world_size and restore_rng and state.get("rng") is not None:
        _set_rng_state(state["rng"])
    engine.skipped_steps = int(state.get("skipped_steps", 0))
    return {"tag": choice.tag, "client_state": client_state, "rank_state": state["user"],
            "world_size": saved_world, "metadata": marker.get("metadata", {}), "note": choice.note}


def _layout_record(layouts: dict) -> dict:
    """The marker's ``head_layouts``: per head its number of shards and how they split
    the classes, described as DeepSpeed describes a tensor-parallel parameter
    (partitioned along dimension 0, the class dimension, contiguously, the first
    ``C mod k`` shards one row larger)."""
    return {name: {"world_size": lay["world_size"], "num_classes": lay["num_classes"],
                   "embedding_size": lay["embedding_size"], "partition_dim": 0, "tensor_model_parallel": True,
                   "partition": "contiguous; the first num_classes mod world_size shards hold one more class",
                   "writers": {str(r): g for r, g in sorted(lay["writers"].items())}}
            for name, lay in sorted(layouts.items())}


def _verify_contents(engine: PfcEngine, load_dir: str, tag: str, marker: dict, sliced_heads: list[str]) -> None:
    """The content checks of a load, spread over the ranks (each checks its share of
    the ``torch.save`` files and of the shards of ``sliced_heads``, the heads whose
    shards are read in slices: every file is checked by one rank), then agreed: a
    damaged file raises the same CheckpointError, naming it and the tag to fall back
    to, on every rank (a collective)."""
    error = None
    try:
        tags.verify_share(os.path.join(load_dir, tag), marker, rank=engine.rank, world_size=engine.world_size,
                          shard_heads=sliced_heads)
    except Exception as err:
        error = err
        if isinstance(err, tags.CheckpointError):
            try:
                error = tags.with_fallback(err, load_dir, exclude=(tag,))
            except Exception:     # no hint rather than a rank missing from the agreement
                pass
    tags.agree(error, same=True)


def _load_files(engine: PfcEngine, load_dir: str, tag: str, saved_world: int, head_shards: dict[str, int], *,
                universal_tag: bool = False) -> tuple[dict, dict]:
    """This rank's part of a load: DeepSpeed's files, the head shards, the per-rank
    state. Damaged files raise CheckpointCorruptError naming them; mismatches
    between checkpoint and model (classes, dimensions) raise ValueError. The
    shards of heads saved at another world size are read unverified: every rank
    checked its share of them first (:func:`_verify_contents`)."""
    tag_dir = os.path.join(load_dir, tag)
    try:
        if universal_tag:
            path, client_state = universal.load_universal(engine.engine, load_dir, tag)
        else:
            path, client_state = engine.engine.load_checkpoint(load_dir, tag)
    except universal.UniversalCheckpointError:
        raise       # the tag cannot load into this engine (ZeRO stage); not a damaged file
    except ValueError as err:
        if "doesn't match the size of optimizer's group" not in str(err):
            raise tags.CheckpointCorruptError(f"DeepSpeed could not load its files in {tag_dir} "
                                              f"({type(err).__name__}: {err})", path=tag_dir) from err
        # The files are intact; the backbone trains another set of parameters than the run that wrote them.
        trained = sum(p.requires_grad for p in engine.module.parameters())
        raise tags.CheckpointError(
            f"{tag_dir} was saved by a backbone that trains another number of tensors than this one ({trained}): "
            "the checkpoint's optimizer cannot load. A checkpoint of ds_pfc 0.2.0 of a MobileFaceNet or ViT, which "
            "kept the final BatchNorm's scale fixed, resumes with ds_pfc.backbone.options.train_embedding_scale "
            "false", path=tag_dir) from err
    except Exception as err:
        raise tags.CheckpointCorruptError(f"DeepSpeed could not load its files in {tag_dir} "
                                          f"({type(err).__name__}: {err})", path=tag_dir) from err
    if path is None:
        raise tags.CheckpointCorruptError(f"DeepSpeed found no engine checkpoint in {tag_dir}", path=tag_dir)
    for name, head in engine.heads.items():
        shard = os.path.join(tag_dir, ckpt.shard_file_name(name, head.rank, head.world_size))
        saved_shards = head_shards[name]
        try:
            if saved_shards == head.world_size:
                ckpt.load_head_shard(head, tag_dir, name=name)
            else:
                _load_resharded(head, tag_dir, name, saved_shards, verify=False)
        except (ValueError, TypeError):
            raise      # the model does not match the checkpoint (classes, dimensions, optimizer)
        except Exception as err:     # safetensors' own error type, OSError
            where = shard if saved_shards == head.world_size else f"the {name!r} shards in {tag_dir}"
            raise tags.CheckpointCorruptError(f"{where} could not be read ({type(err).__name__}: {err})",
                                              path=shard) from err
    same_world = saved_world == engine.world_size
    rank_file = os.path.join(tag_dir, tags.rank_state_name(engine.rank if same_world else 0, saved_world))
    try:
        state = torch.load(rank_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise tags.CheckpointCorruptError(f"{rank_file} could not be read ({type(err).__name__}: {err})",
                                          path=rank_file) from err
    return client_state, state


@contextlib.contextmanager
def _recorded_writes(engine):
    """Yields a list that collects the paths DeepSpeed's checkpoint writer saves to
    inside the block (every engine, optimizer and ZeRO file goes through its
    ``save(state_dict, path)``)."""
    written: list[str] = []
    why = "to fsync every file DeepSpeed writes into a checkpoint"
    writer = internal(engine, "checkpoint_engine", owner="engine", why=why)
    require_internal(writer, "save", owner=f"checkpoint_engine ({type(writer).__name__})", why=why)
    own = vars(writer).get("save")
    save = writer.save

    def recording_save(*args, **kwargs):
        result = save(*args, **kwargs)
        written.append(str(kwargs["path"] if "path" in kwargs else args[1]))
        return result

    writer.save = recording_save
    try:
        yield written
    finally:
        if own is None:
            del writer.save
        else:
            writer.save = own


def _wait_for_commit(engine) -> None:
    """Return once DeepSpeed's files are written: a decoupled (asynchronous) writer
    commits them only at the next optimizer step, or here, on request."""
    why = "to write the completion marker only after DeepSpeed's checkpoint writer has committed its files"
    writer = internal(engine, "checkpoint_engine", owner="engine", why=why)
    if not internal(writer, "is_decoupled", owner=f"checkpoint_engine ({type(writer).__name__})", why=why)():
        return
    internal(engine, "_commit_decoupled_checkpoint", owner="engine", why=why)()


def _fsync_written(paths: list[str], staging_dir: str, engine) -> None:
    """fsync the files this rank wrote for a checkpoint and the directories holding
    them (also DeepSpeed's copy of NVMe-offloaded optimizer state for this rank)."""
    written = {os.path.abspath(p) for p in paths if os.path.isfile(p)}
    offload = os.path.join(staging_dir, "offloaded_tensors")
    if os.path.isdir(offload):
        rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
        for root, _, names in os.walk(os.path.join(offload, f"rank{rank:0>2d}")):
            written.update(os.path.join(root, n) for n in names)
    for path in sorted(written):
        files.fsync_file(path)
    for directory in sorted({os.path.dirname(p) for p in written} | {os.path.abspath(staging_dir)}):
        files.fsync_dir(directory)


def list_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoint tags in ``save_dir``, oldest first by the optimizer step
    their marker records (ties by name)."""
    return [info.name for info in tags.complete_tags(save_dir)]


def _load_resharded(head: PartialFC, tag_dir: str, name: str, world_size: int | None = None, *,
                    verify: bool = True) -> None:
    """Load ``head``'s classes from shards of another world size: only the shards
    that overlap its class range are read, and of them only its rows (safetensors
    slices), streamed into the bank a block at a time
    (:func:`ds_pfc.checkpoint.load_resharded`): the memory this needs is one block, not
    the head's own shard. ``verify``: check the shards read from against their
    checksums first (False when the load checked every shard already)."""
    ckpt.load_resharded(head, ckpt.open_shards(tag_dir, name=name, world_size=world_size), verify=verify)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def remove_checkpoint(save_dir: str, tag: str) -> None:
    """Delete a checkpoint tag directory: renamed away first, so it leaves the listings
    at once, and a crash during the deletion leaves a leftover the next save removes."""
    tags.remove_tag(save_dir, tag)
