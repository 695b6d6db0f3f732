"""The datasets of a job: the training set (synthetic faces, identity features, RecordIO
or a Hugging Face dataset, with the configured stress transforms and label file) and the verification pair sets. Used
by the training app, the paper studies and the dominant sub-center export."""
from __future__ import annotations

import os
import time

import torch

from .config import ConfigError, DsPfcConfig, StressConfig
from .run_outputs import Heartbeat

__all__ = ["build_train_set", "build_eval_sets", "check_eval_decoder", "relabelled", "stressed"]


def stressed(stress: StressConfig, dataset):
    """``dataset`` with the corruption of ``stress`` (the dataset itself when nothing is set)."""
    if not stress.active:
        return dataset
    from ..data.stress import StressedDataset
    return StressedDataset(dataset, label_flip=stress.label_flip,
                           conflict=stress.conflict.fraction if stress.conflict else 0.0,
                           conflict_splits=stress.conflict.splits if stress.conflict else 3,
                           long_tail=stress.long_tail.tail_fraction if stress.long_tail else None,
                           tail_images=tuple(stress.long_tail.tail_images) if stress.long_tail else (2, 4),
                           seed=stress.seed)


def build_train_set(cfg: DsPfcConfig, log=None):
    """The training set of ``cfg``; ``log`` (a callable taking a line, or None) hears about
    long phases (a RecordIO set's first indexing). With ``ds_pfc.data.labels``, the set
    the label file keeps, with its labels (:func:`relabelled`)."""
    data = cfg.data
    dataset = _stressed_set(cfg, log)
    if data.labels is not None:
        return relabelled(cfg, dataset, log)
    if data.source in ("synthetic", "features"):
        if dataset.num_classes != cfg.head.num_classes:
            what = "synthetic" if data.source == "synthetic" else "feature"
            raise ConfigError(f"ds_pfc.head.num_classes must be {dataset.num_classes} (the classes of the {what} "
                              f"training set after ds_pfc.data.stress), got {cfg.head.num_classes}")
    elif dataset.num_classes > cfg.head.num_classes:
        raise ConfigError(f"the data has labels up to {dataset.num_classes - 1} but ds_pfc.head.num_classes is "
                          f"{cfg.head.num_classes}")
    return dataset


def relabelled(cfg: DsPfcConfig, dataset, log=None):
    """``dataset`` (the training set after ``ds_pfc.data.stress``) restricted to the
    images ``ds_pfc.data.labels`` keeps, with its labels
    (:class:`~ds_pfc.data.relabel.RelabelledDataset`; its ``digest`` is the file's
    sha256). A :class:`ConfigError` naming the key for a file that does not fit the
    set or a class count other than ``ds_pfc.head.num_classes``."""
    from ..data.relabel import RelabelledDataset, read_labels
    path = cfg.data.labels
    try:
        labels, digest = read_labels(path, len(dataset), name="ds_pfc.data.labels")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    out = RelabelledDataset(dataset, labels, digest=digest)
    if out.num_classes != cfg.head.num_classes:
        raise ConfigError(f"ds_pfc.data.labels: {path} has labels up to {out.num_classes - 1} ({out.num_classes} "
                          f"classes) but ds_pfc.head.num_classes is {cfg.head.num_classes}; set num_classes to "
                          f"{out.num_classes}")
    if log is not None:
        log(f"data: labels from {path}: {len(out)} of {len(dataset)} images kept ({out.dropped} left out), "
            f"{out.num_classes} classes")
    return out


def _stressed_set(cfg: DsPfcConfig, log=None):
    """The training set of ``cfg`` with its own labels, after ``ds_pfc.data.stress``."""
    data = cfg.data
    if data.source == "synthetic":
        from ..data.faces import SyntheticFaces
        s = data.synthetic
        return stressed(data.stress, SyntheticFaces(s.identities, s.images_per_identity,
                                                    image_size=s.image_size, seed=s.seed))
    if data.source == "features":
        return stressed(data.stress, data.features.build())
    if not os.path.exists(data.path):
        raise FileNotFoundError(f"ds_pfc.data.path {data.path!r} does not exist")
    if data.source == "recordio":
        from ..data.recordio import InsightFaceRecord
        from ..data.transforms import check_decoder
        check_decoder(f"ds_pfc.data.source recordio ({data.path})")     # before the (long) first indexing
        # The index cache (keys, offsets, labels; ~20 bytes a record) goes to DS_PFC_CACHE_DIR
        # when set (shared by runs), else under the run's output directory: never into the data.
        cache_dir = os.environ.get("DS_PFC_CACHE_DIR") or os.path.join(cfg.train.output_dir, "cache")
        started = time.perf_counter()
        if log is not None:
            log(f"data: opening {data.path} (index cache in {cache_dir}; without one every record is indexed "
                "first, which takes tens of seconds at tens of millions of images)")
        status = [""]            # the index build's latest progress line, for the heartbeat

        def progress(text: str) -> None:
            status[0] = text
        with Heartbeat(log, f"data: indexing {data.path}", progress=lambda: status[0]):
            dataset = InsightFaceRecord(data.path, cache_dir=cache_dir, progress=progress)
            dataset.labels()
        if log is not None:
            log(f"data: {len(dataset)} images indexed in {time.perf_counter() - started:.1f} s, labels from "
                f"{dataset.label_source}")
    else:
        from ..data.hf import load_image_dataset
        dataset = load_image_dataset(data.path, split=data.split, image_column=data.image_column,
                                     label_column=data.label_column)
        if len(dataset) and isinstance(dataset[0][0], (bytes, bytearray, memoryview)):
            from ..data.transforms import check_decoder
            check_decoder(f"ds_pfc.data.source hf ({data.path}: encoded images)")
    return stressed(data.stress, dataset)


def check_eval_decoder(cfg: DsPfcConfig) -> None:
    """Raise :class:`~ds_pfc.data.transforms.ImageDecoderError` now when the verification
    sets of ``cfg`` (``.bin`` files of encoded images) cannot be decoded, rather than
    after the model is built."""
    if cfg.evaluation.bins:
        from ..data.transforms import check_decoder
        check_decoder(f"ds_pfc.evaluation.bins ({cfg.evaluation.bins[0]}"
                      + (f" and {len(cfg.evaluation.bins) - 1} more" if len(cfg.evaluation.bins) > 1 else "") + ")")


def build_eval_sets(cfg: DsPfcConfig) -> dict[str, tuple[torch.Tensor, list[bool]]]:
    """Verification pair sets: ``name -> (uint8 images [2P, 3, H, W], issame)``."""
    sets = {}
    ev = cfg.evaluation
    if cfg.data.source == "synthetic" and ev.synthetic_pairs:
        from ..data.faces import SyntheticFaces
        s = cfg.data.synthetic
        held = SyntheticFaces(s.held_out_identities, s.images_per_identity, image_size=s.image_size,
                              first_identity=s.identities, seed=s.seed)
        sets["synthetic_held_out"] = held.pairs(ev.synthetic_pairs, seed=s.seed)
    if cfg.data.source == "features" and ev.synthetic_pairs:
        # the held-out identities of the feature set, under the same name: it is scored as the faces' set
        f = cfg.data.features
        sets["synthetic_held_out"] = f.build(held_out=True).pairs(ev.synthetic_pairs, seed=f.seed)
    for path in ev.bins:
        from ..data.transforms import decode_image
        from ..eval.verification import load_bin
        images, issame = load_bin(path, decode=decode_image)
        sets[os.path.splitext(os.path.basename(path))[0]] = (torch.stack(images), issame)
    return sets
