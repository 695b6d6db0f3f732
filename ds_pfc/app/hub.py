"""Sharing a trained model: the backbone alone (what people ship; the classifier of a
WebFace42M head is ~4 GB next to a 250 MB backbone) and a Hugging Face model folder.

- :func:`export_backbone`: ``<out>/model.safetensors`` (the backbone's float32 weights and
  the job config, the format :func:`ds_pfc.app.export.load_backbone` reads) and
  ``<out>/config.json`` (the model's facts and the job config).
- :func:`export_hub`: the same plus ``README.md``, a model card: what the model is, how it
  was trained (data, classes, margin, sample rate, batch, steps), what ran (ranks,
  device, the backbone's dtype and the head's product dtype as they ran, the versions:
  the checkpoint's ``metadata.ran``, "not recorded" for a checkpoint without it), its
  verification and IJB results, the code that loads it, and how to install the ds_pfc
  that provides it (:func:`install_text`: ds_pfc is on no package index).
- :func:`push_to_hub`: uploads such a folder with ``huggingface_hub`` (installed with
  ``datasets``).

:func:`ds_pfc.app.eval_models.load_model` reads such a folder (or one downloaded with
``huggingface_hub.snapshot_download``)."""
from __future__ import annotations

import json
import math
import os
import time
import warnings

from .export import CONFIG_FILE, MODEL_FILE, is_model_folder

__all__ = ["export_backbone", "export_hub", "push_to_hub", "is_model_folder", "MODEL_FILE"]

CARD_FILE = "README.md"


def _source(source: str, tag: str | None):
    """``(backbone state dict, job config, marker or None, run directory or None)`` of a
    checkpoint directory (its ``latest`` tag unless ``tag``), a tag directory or a model
    export (:func:`ds_pfc.app.export.backbone_weights`)."""
    from .export import backbone_weights
    state, config, marker, tag_dir = backbone_weights(source, tag)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(tag_dir))) if tag_dir else None
    if marker is None:
        marker = _export_record(source)
    return state, config, marker, run_dir


def _export_record(source: str) -> dict | None:
    """What a model folder or backbone export written by :func:`export_backbone` carries
    of its checkpoint's marker (the steps and what ran), as a marker; None when it
    carries nothing (e.g. the training app's own export)."""
    from safetensors import safe_open
    path = os.path.join(source, MODEL_FILE) if is_model_folder(source) else source
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    if "ran" not in metadata or not metadata.get("global_steps", "").isdigit():
        return None
    return {"global_steps": int(metadata["global_steps"]), "metadata": {"ran": json.loads(metadata["ran"])}}


def _facts(config: dict, marker: dict | None) -> dict:
    """What a user of the model needs: the backbone, its input and output."""
    from .config import split_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config, strict=False)
    size = cfg.backbone.options.get("image_size", 112)
    facts = {"library": "ds_pfc", "backbone": cfg.backbone.name, "width": cfg.backbone.width,
             "embedding_size": cfg.head.embedding_size,
             "input": {"shape": [3, size, size], "channels": "RGB", "normalize": "(x / 255 - 0.5) / 0.5"},
             "num_classes": cfg.head.num_classes}
    if marker is not None:
        facts["global_steps"] = int(marker.get("global_steps", 0))
    ran = ((marker or {}).get("metadata") or {}).get("ran")
    if isinstance(ran, list):
        facts["ran"] = ran
    return facts


def export_backbone(source: str, out_dir: str, *, tag: str | None = None) -> dict:
    """Write the backbone of ``source`` (a checkpoint directory, a tag directory or a
    model export) to ``out_dir``: ``model.safetensors`` (``backbone.*`` float32 weights,
    no classifier; the job config in its metadata) and ``config.json``. Returns the
    paths ``{"model", "config"}``."""
    return _export(source, out_dir, tag)[0]


def _export(source: str, out_dir: str, tag: str | None):
    """:func:`export_backbone`; also returns ``(config, marker, run dir, facts)``."""
    from ..checkpoint import shards as ckpt
    from ..checkpoint.export import EXPORT_FORMAT
    from ..checkpoint.files import atomic_write
    state, config, marker, run_dir = _source(source, tag)
    facts = _facts(config, marker)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {f"backbone.{k}": v.contiguous() for k, v in state.items()}
    metadata = {"format": EXPORT_FORMAT, "heads": "{}", "config": json.dumps(config),
                "global_steps": str(facts.get("global_steps", ""))}
    if "ran" in facts:
        metadata["ran"] = json.dumps(facts["ran"])
    model = ckpt._atomic_save(tensors, os.path.join(out_dir, MODEL_FILE), metadata)
    config_path = os.path.join(out_dir, CONFIG_FILE)
    atomic_write(config_path, (json.dumps({**facts, "job_config": config}, indent=1) + "\n").encode())
    return {"model": model, "config": config_path}, config, marker, run_dir, facts


def export_hub(source: str, out_dir: str, *, tag: str | None = None, name: str | None = None,
               summary: str | None = None, results: list[str] | None = None) -> dict:
    """:func:`export_backbone` plus a model card ``README.md`` for the Hugging Face Hub.

    ``summary``: the run's ``summary.json`` (default: the one of a checkpoint
    directory's run, if there), whose last evaluation goes into the card; ``results``:
    JSON files of ``ds-pfc-eval`` (verification or IJB) to add. ``name``: the model's
    title (default: the output folder's name). Returns the paths ``{"model", "config",
    "card"}``."""
    from ..checkpoint.files import atomic_write
    paths, config, marker, run_dir, facts = _export(source, out_dir, tag)
    if summary is None and run_dir is not None and os.path.isfile(os.path.join(run_dir, "summary.json")):
        summary = os.path.join(run_dir, "summary.json")
    evaluation = _read_json(summary, "summary") if summary else None
    extra = [(_read_json(p, "results"), os.path.basename(p)) for p in (results or [])]
    card = model_card(name or os.path.basename(os.path.abspath(out_dir)), config, facts, marker, evaluation, extra)
    paths["card"] = os.path.join(out_dir, CARD_FILE)
    atomic_write(paths["card"], card.encode())
    return paths


def _read_json(path: str, what: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file not found: {path!r}")
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as err:
            raise ValueError(f"{path} is not JSON ({err})") from None


def _number(value, digits: int = 4) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return "n/a"


def _result_rows(results) -> list[str]:
    """Markdown table rows ``| set | accuracy | TAR@FAR ... |`` from one evaluation
    (``name -> {"accuracy", "accuracy_std", "tar_at_far"}``) or an IJB result."""
    rows = []
    if not isinstance(results, dict):
        return rows
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        if "accuracy" in r:
            tars = ", ".join(f"TAR@FAR={far}: {_number(t)}" for far, t in (r.get("tar_at_far") or {}).items())
            rows.append(f"| {name} | {_number(r['accuracy'])} +- {_number(r.get('accuracy_std'))} | {tars} |")
        elif "tar_at_far" in r:             # IJB-B/C 1:1
            tars = ", ".join(f"TAR@FAR={far}: {_number(t)}" for far, t in r["tar_at_far"].items())
            rows.append(f"| {name} | | {tars} |")
    return rows


def model_card(name: str, config: dict, facts: dict, marker: dict | None, summary: dict | None,
               extra: list) -> str:
    """The model card (Markdown with the Hub's YAML header)."""
    from .run_outputs import versions_line
    pfc = config.get("ds_pfc", {})
    head, data, train = pfc.get("head", {}), pfc.get("data", {}), pfc.get("train", {})
    margin = head.get("margin", {})
    meta = (marker or {}).get("metadata") or {}
    batch = meta.get("global_batch")
    ran = meta.get("ran") if isinstance(meta.get("ran"), list) and meta.get("ran") else None
    source = data.get("source", "synthetic")
    where = data.get("path") or f"built-in {source} data"
    lines = [
        "---",
        "library_name: ds_pfc",
        "license: other",
        "pipeline_tag: image-feature-extraction",
        "tags:",
        "- face-recognition",
        "- partial-fc",
        f"- {margin.get('type', 'arcface')}",
        f"- {facts['backbone']}",
        "---",
        "",
        f"# {name}",
        "",
        f"A face-recognition backbone ({facts['backbone']}, width {facts['width']:g}) that maps an aligned "
        f"{facts['input']['shape'][1]}x{facts['input']['shape'][2]} RGB face to a {facts['embedding_size']}-d "
        "embedding; compare two faces by the cosine of their embeddings. Trained with a Partial FC margin-softmax "
        f"head over {facts['num_classes']:,} identities by ds_pfc; this folder holds the backbone only "
        "(`model.safetensors`, float32) and its config (`config.json`).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| data | {where} ({source}) |",
        f"| identities (classes) | {facts['num_classes']:,} |",
        f"| margin | {margin.get('type', 'arcface')} "
        + ", ".join(f"{k} {v}" for k, v in sorted(margin.items()) if k != "type") + " |",
        f"| sample rate (Partial FC) | {head.get('sample_rate', 1.0)} |",
        f"| steps | {facts.get('global_steps', 'n/a')} |",
        f"| global batch | {batch if batch is not None else 'n/a'} |",
        f"| optimizer | {(config.get('optimizer') or {}).get('type', 'n/a')} "
        f"{json.dumps((config.get('optimizer') or {}).get('params', {}))} |",
        f"| schedule | {json.dumps(train.get('schedule')) if train.get('schedule') else 'constant or DeepSpeed'} |",
        f"| ranks | {_ranks(ran, meta)} |",
        f"| precision (as run) | {_as_run(ran, _precision)} |",
        f"| device (as run) | {_as_run(ran, _device)} |",
        "",
        "The whole job config is `job_config` in `config.json`.",
        "",
        "## Results",
        "",
    ]
    rows = []
    evaluations = (summary or {}).get("evaluations") or {}
    if evaluations:
        last = max(evaluations, key=lambda s: int(s))
        rows += _result_rows(evaluations[last])
        lines.append(f"1:1 verification at step {last} (the training run's own evaluation):")
        lines.append("")
    for results, label in extra:
        found = _result_rows(results)
        if found:
            rows.append(f"| *{label}* | | |")
            rows += found
    if rows:
        lines += ["| set | accuracy | TAR |", "|---|---|---|", *rows]
    else:
        lines.append("No evaluation results were given.")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import torch",
        "from ds_pfc.app.eval_models import load_model",
        "",
        "model, config, _ = load_model(\"path/to/this/folder\")   # or huggingface_hub.snapshot_download(repo_id)",
        f"images = torch.rand(2, 3, {facts['input']['shape'][1]}, {facts['input']['shape'][2]}) * 255   "
        "# aligned RGB faces, 0..255",
        "with torch.no_grad():",
        "    embeddings = torch.nn.functional.normalize(model((images / 255 - 0.5) / 0.5))",
        "similarity = float(embeddings[0] @ embeddings[1])",
        "```",
        "",
        f"{install_text()} The weights are a plain safetensors file (`backbone.<name>` keys) for any other "
        "loader.",
        "",
        "## Versions",
        "",
        (f"Trained with {_as_run(ran, lambda entry: entry['versions'])}." if ran else
         f"The versions it was trained with: {NOT_RECORDED}.")
        + f" Exported with {versions_line()} on {time.strftime('%Y-%m-%d', time.gmtime())}.",
        "",
        "## Limitations",
        "",
        "Face recognition accuracy depends on face alignment matching the training data's (five-point "
        "alignment to 112x112 for the usual face datasets) and differs across demographic groups; the license "
        "of these weights follows the terms of the training data.",
        "",
    ]
    return "\n".join(lines)


NOT_RECORDED = "not recorded (the checkpoint predates ds_pfc's record of what ran)"


def _precision(entry: dict) -> str:
    return f"backbone {entry['backbone']}, head products {entry['head_products']}"


def _device(entry: dict) -> str:
    return entry["device"] + (f" ({entry['device_name']})" if entry.get("device_name") else "")


def _as_run(ran: list | None, describe) -> str:
    """``describe(entry)`` of each stretch of steps in ``ran`` (a checkpoint's
    ``metadata.ran``, see :meth:`ds_pfc.app.training.Trainer.ran_record`), neighbours
    described alike merged, with their steps when they differ; "not recorded" where
    the checkpoint holds no record."""
    if not ran:
        return NOT_RECORDED
    groups = []             # [first step, last step, text]
    for entry in ran:
        try:
            text = NOT_RECORDED if entry.get("not_recorded") else describe(entry)
            first, last = entry["steps"]
        except (KeyError, TypeError, ValueError):
            text, first, last = NOT_RECORDED, "?", "?"
        if groups and groups[-1][2] == text:
            groups[-1][1] = last
        else:
            groups.append([first, last, text])
    if len(groups) == 1:
        return groups[0][2]
    return "; ".join(f"steps {first}-{last}: {text}" for first, last, text in groups)


def _ranks(ran: list | None, meta: dict) -> str:
    if ran:
        return _as_run(ran, lambda entry: str(entry["world_size"]))
    if isinstance(meta.get("world_size"), int):
        return f"{meta['world_size']} (in the run that wrote the checkpoint)"
    return NOT_RECORDED


def install_text(distribution: str = "ds_pfc") -> str:
    """The card's sentence on getting ``load_model``: ds_pfc is on no package index, so it
    names the installed distribution's own source when its PEP 610 ``direct_url.json``
    records one that others can fetch (a VCS URL with its commit, or an http(s) archive),
    as ``pip install "ds_pfc @ <url>"``; otherwise it says that ds_pfc <version> must be
    installed from its source or a wheel."""
    from importlib import metadata
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        from .._versions import __version__ as version
    else:
        version = dist.version
    url = direct_url(dist) if dist is not None else None
    if url is not None:
        return (f"`load_model` comes with ds_pfc {version}, which is not on a package index; the source this model "
                f"was exported with installs with `pip install \"ds_pfc @ {url}\"`.")
    return (f"`load_model` comes with ds_pfc {version}, which is not on a package index: install ds_pfc {version} "
            "from its source or a wheel built from it (`pip install /path/to/ds_pfc-checkout`, or "
            f"`pip install ./ds_pfc-{version}-py3-none-any.whl`).")


def direct_url(dist) -> str | None:
    """The ``<url>`` of ``pip install "ds_pfc @ <url>"`` from ``dist``'s PEP 610
    ``direct_url.json``: ``<vcs>+<url>@<commit>`` or an http(s) archive URL (with its
    ``#subdirectory=`` if any); None for a local directory (editable or not), a local
    file or repository, no record, or a record that cannot be read."""
    try:
        text = dist.read_text("direct_url.json")
        data = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        return None
    url = data["url"]
    subdirectory = f"#subdirectory={data['subdirectory']}" if isinstance(data.get("subdirectory"), str) else ""
    vcs = data.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("vcs"), str):
        if url.startswith("file:"):
            return None
        prefix = "" if url.startswith(vcs["vcs"] + "+") else vcs["vcs"] + "+"
        revision = vcs.get("commit_id") or vcs.get("requested_revision")
        return f"{prefix}{url}" + (f"@{revision}" if revision else "") + subdirectory
    if isinstance(data.get("archive_info"), dict) and url.split(":", 1)[0] in ("http", "https"):
        return url + subdirectory
    return None


def push_to_hub(folder: str, repo_id: str, *, private: bool = False, token: str | None = None, api=None,
                commit_message: str = "Upload a ds_pfc model") -> str:
    """Upload ``folder`` (from :func:`export_hub`) to the Hub model repository
    ``repo_id`` (created if missing), with ``huggingface_hub``; ``api`` defaults to
    ``huggingface_hub.HfApi(token=token)``. Returns the repository's URL."""
    if not is_model_folder(folder) or not os.path.isfile(os.path.join(folder, CARD_FILE)):
        raise ValueError(f"{folder} is not a model folder from ds-pfc-export hub (model.safetensors, config.json, "
                         "README.md)")
    if api is None:
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise RuntimeError("uploading needs huggingface_hub: pip install huggingface_hub") from None
        api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=folder, commit_message=commit_message)
    except (OSError, ValueError) as err:      # huggingface_hub's HTTP, auth and validation errors derive from these
        raise RuntimeError(f"uploading {folder} to {repo_id} failed: {type(err).__name__}: {err} (a token: HF_TOKEN "
                           "or huggingface-cli login)") from err
    return str(url)
