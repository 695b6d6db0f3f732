"""Convert an insightface arcface_torch config (a Python file) into a ds_pfc job JSON.

    ds-pfc-migrate config configs/wf42m_pfc02_r100.py -o wf42m_pfc02_r100.json

arcface_torch configs are Python modules (``config = edict(); config.lr = 0.1``), and
its ``get_config`` lays each one over ``configs/base.py``. This module never executes
them: it parses the file with :mod:`ast` and evaluates only assignments of literal
values (numbers, strings, tuples, lists, dicts, ``None``/``True``/``False``, simple
arithmetic on them, and references to ``config`` keys assigned earlier) to
``config.<key>``. Any other statement (an import other than easydict/the base config,
a function call, a loop) is reported as not understood, and the file is refused
unless ``--skip-unknown`` is given. Every key is then mapped to DeepSpeed's config and
the ``ds_pfc`` block; keys without a ds_pfc counterpart are listed with the reason,
and the differences in what the mapped settings compute are printed.

The result is checked with ds_pfc's own parser (:func:`ds_pfc.app.config.split_config`)
before it is written.
"""
from __future__ import annotations

import ast
import json
import operator
import os
import sys
import warnings
from dataclasses import dataclass, field

__all__ = ["MigrateError", "ParsedConfig", "Conversion", "parse_arcface_config", "convert_arcface_config",
           "ARCFACE_BASE_DEFAULTS"]


class MigrateError(ValueError):
    """The arcface_torch config cannot be read or converted; the message says why."""


# The values of arcface_torch's configs/base.py, which its get_config() lays every
# config over. Used when the config's directory has no base.py of its own.
ARCFACE_BASE_DEFAULTS = {
    "margin_list": (1.0, 0.5, 0.0), "network": "r50", "resume": False, "save_all_states": False,
    "output": "ms1mv3_arcface_r50", "embedding_size": 512, "sample_rate": 1, "interclass_filtering_threshold": 0,
    "fp16": False, "batch_size": 128, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
    "verbose": 2000, "frequent": 10, "dali": False, "dali_aug": False, "gradient_acc": 1, "seed": 2048,
    "num_workers": 2, "wandb_key": "XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX", "suffix_run_name": None,
    "using_wandb": False, "wandb_entity": "entity", "wandb_project": "project", "wandb_log_all": True,
    "save_artifacts": False, "wandb_resume": False,
}

# Keys train_v2.py needs that base.py does not set: a config without them fails there.
_REQUIRED = ("rec", "num_classes", "num_image", "num_epoch", "warmup_epoch", "val_targets")

# arcface_torch network name -> (ds_pfc names to try, in order; backbone options).
# The ViT options are those arcface_torch's get_model builds each name with.
_NETWORKS = {
    "r18": (("r18", "iresnet18"), {}),
    "r34": (("r34", "iresnet34"), {}),
    "r50": (("r50", "iresnet50"), {}),
    "r100": (("r100", "iresnet100"), {}),
    "r200": (("r200", "iresnet200"), {}),
    "r2060": (("r2060", "iresnet2060"), {}),
    "mbf": (("mbf", "mobilefacenet"), {}),
    "mbf_large": (("mbf_large", "mobilefacenet_large"), {}),
    "vit_t": (("vit_t",), {"style": "arcface", "drop_path_rate": 0.1, "mask_ratio": 0.1}),
    "vit_t_dp005_mask0": (("vit_t",), {"style": "arcface", "drop_path_rate": 0.05, "mask_ratio": 0.0}),
    "vit_s": (("vit_s",), {"style": "arcface", "drop_path_rate": 0.1, "mask_ratio": 0.1}),
    "vit_s_dp005_mask_0": (("vit_s",), {"style": "arcface", "drop_path_rate": 0.05, "mask_ratio": 0.0}),
    "vit_b": (("vit_b",), {"drop_path_rate": 0.1, "mask_ratio": 0.1}),
    "vit_b_dp005_mask_005": (("vit_b",), {"drop_path_rate": 0.05, "mask_ratio": 0.05}),
    "vit_l_dp005_mask_005": (("vit_l",), {"drop_path_rate": 0.05, "mask_ratio": 0.05}),
    "vit_h": (("vit_h",), {"drop_path_rate": 0.1, "mask_ratio": 0.0}),
}

_WANDB_KEYS = ("wandb_key", "suffix_run_name", "using_wandb", "wandb_entity", "wandb_project", "wandb_log_all",
               "save_artifacts", "wandb_resume", "notes")

_NOT_EXECUTED = "nothing in the file was executed"


# ---------------------------------------------------------------------------- parsing
@dataclass
class ParsedConfig:
    """What :func:`parse_arcface_config` read: the merged values and their origins."""

    path: str
    values: dict
    """key -> value, base config first, then the file's own assignments."""
    from_base: set = field(default_factory=set)
    """Keys whose value comes from the base config (not overridden by the file)."""
    base: str | None = None
    """The base config read (a path), ``"built-in"`` for :data:`ARCFACE_BASE_DEFAULTS`."""
    not_understood: list = field(default_factory=list)
    """``(line, source)`` of every statement that was not evaluated."""


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _NotLiteral(Exception):
    pass


def _is_config(node, name="config") -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _config_key(target) -> str | None:
    """``config.key`` or ``config["key"]`` -> ``"key"``; anything else None."""
    if isinstance(target, ast.Attribute) and _is_config(target.value):
        return target.attr
    if isinstance(target, ast.Subscript) and _is_config(target.value):
        sl = target.slice
        if isinstance(sl, ast.Constant) and isinstance(sl.value, str):
            return sl.value
    return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _evaluate(node, known: dict):
    """The value of a literal expression, allowing arithmetic and earlier config keys.
    Raises _NotLiteral for anything else; executes nothing."""
    key = _config_key(node)
    if key is not None:
        if key not in known:
            raise _NotLiteral(f"config.{key} is read before it is assigned")
        return known[key]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, known), _evaluate(node.right, known)
        if _number(left) and _number(right):
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise _NotLiteral("power too large to be a config value")
            try:
                return _BINOPS[type(node.op)](left, right)
            except (ArithmeticError, ValueError) as err:
                raise _NotLiteral(str(err)) from None
        if isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, (str, tuple, list)):
            return left + right
        raise _NotLiteral("arithmetic on values that are not numbers")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _evaluate(node.operand, known)
        if not _number(operand):
            raise _NotLiteral("sign of a value that is not a number")
        return _UNARY[type(node.op)](operand)
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_evaluate(e, known) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _NotLiteral("dict unpacking")
        return {_evaluate(k, known): _evaluate(v, known) for k, v in zip(node.keys, node.values)}
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _NotLiteral("not a literal value") from None


def _is_edict_import(stmt) -> bool:
    if isinstance(stmt, ast.ImportFrom) and stmt.module == "easydict" and stmt.level == 0:
        return all(a.name == "EasyDict" for a in stmt.names)
    if isinstance(stmt, ast.Import):
        return all(a.name == "easydict" for a in stmt.names)
    return False


def _base_import(stmt) -> str | None:
    """``from configs.base import config`` (or ``.base``, ``base``) -> ``"base"``."""
    if isinstance(stmt, ast.ImportFrom) and stmt.module and len(stmt.names) == 1:
        alias = stmt.names[0]
        if alias.name == "config" and alias.asname in (None, "config"):
            return stmt.module.split(".")[-1]
    return None


def _is_new_config(stmt) -> bool:
    """``config = edict()`` / ``config = EasyDict()`` / ``config = easydict.EasyDict()``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _is_config(stmt.targets[0])):
        return False
    call = stmt.value
    if not isinstance(call, ast.Call) or call.args or call.keywords:
        return False
    f = call.func
    return (isinstance(f, ast.Name) and f.id in ("edict", "EasyDict", "dict")) or \
        (isinstance(f, ast.Attribute) and f.attr == "EasyDict" and isinstance(f.value, ast.Name)
         and f.value.id == "easydict")


def _read_module(path: str):
    if not os.path.isfile(path):
        raise MigrateError(f"config file not found: {path!r}")
    if not path.endswith(".py"):
        raise MigrateError(f"{path}: not a .py file; arcface_torch configs are Python modules (configs/*.py)")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise MigrateError(f"{path}: cannot be read ({err})") from None
    try:
        return source, ast.parse(source, filename=path)
    except SyntaxError as err:
        raise MigrateError(f"{path}: not valid Python (line {err.lineno}: {err.msg}); {_NOT_EXECUTED}") from None
    except (ValueError, RecursionError, MemoryError) as err:
        raise MigrateError(f"{path}: cannot be parsed ({type(err).__name__}: {err}); {_NOT_EXECUTED}") from None


def _assignments(path: str, known: dict, not_understood: list, *, allow_base: bool):
    """Evaluate ``path``'s literal ``config`` assignments into ``known``. Returns the base
    module named by a ``from ...base import config`` line, if any."""
    source, tree = _read_module(path)
    base_name = None
    assigned = set()
    for stmt in tree.body:
        text = (ast.get_source_segment(source, stmt) or "").splitlines()[0:1]
        text = text[0] if text else type(stmt).__name__
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue                          # a docstring
        if _is_edict_import(stmt) or _is_new_config(stmt):
            continue
        if allow_base and _base_import(stmt) is not None:
            base_name = _base_import(stmt)
            continue
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            keys = [_config_key(t) for t in targets]
            if stmt.value is not None and keys and all(k is not None for k in keys):
                try:
                    value = _evaluate(stmt.value, known)
                    if isinstance(stmt, ast.AugAssign):
                        if len(keys) != 1 or keys[0] not in known:
                            raise _NotLiteral(f"config.{keys[0]} is updated before it is assigned")
                        op = _BINOPS.get(type(stmt.op))
                        old = known[keys[0]]
                        if op is None or not (_number(old) and _number(value)):
                            raise _NotLiteral("augmented assignment other than arithmetic on numbers")
                        value = op(old, value)
                except _NotLiteral as why:
                    not_understood.append((stmt.lineno, f"{text}  ({why})"))
                    continue
                except (ArithmeticError, ValueError) as err:
                    not_understood.append((stmt.lineno, f"{text}  ({err})"))
                    continue
                for k in keys:
                    known[k] = value
                    assigned.add(k)
                continue
        not_understood.append((stmt.lineno, text))
    return base_name, assigned


def parse_arcface_config(path: str, *, base: str | None = "auto") -> ParsedConfig:
    """Read arcface_torch config ``path`` without executing it.

    ``base``: ``"auto"`` lays the file over ``base.py`` in the same directory (what
    arcface_torch's ``get_config`` does with ``configs/base.py``), or over
    :data:`ARCFACE_BASE_DEFAULTS` where there is none; a path names the base file;
    None uses no base. A ``from configs.base import config`` line in the file names
    its base explicitly (it must then exist beside the file)."""
    path = os.fspath(path)
    own: dict = {}
    not_understood: list = []
    # First pass on the file alone, to learn whether it imports a base itself.
    base_name, _ = _assignments(path, {}, [], allow_base=True)
    directory = os.path.dirname(os.path.abspath(path))
    base_path, base_values, base_label = None, {}, None
    if base_name is not None:
        base_path = os.path.join(directory, base_name + ".py")
        if not os.path.isfile(base_path):
            raise MigrateError(f"{path}: imports its base config from {base_name!r}, but {base_path} does not exist")
    elif base == "auto":
        beside = os.path.join(directory, "base.py")
        if os.path.isfile(beside) and os.path.abspath(beside) != os.path.abspath(path):
            base_path = beside
    elif base is not None:
        base_path = os.fspath(base)
    if base_path is not None:
        base_not_understood: list = []
        _assignments(base_path, base_values, base_not_understood, allow_base=False)
        not_understood += [(line, f"{os.path.basename(base_path)}: {text}") for line, text in base_not_understood]
        base_label = base_path
    elif base == "auto" or base_name is not None:
        base_values = dict(ARCFACE_BASE_DEFAULTS)
        base_label = "built-in"
    own = dict(base_values)
    _, assigned = _assignments(path, own, not_understood, allow_base=True)
    return ParsedConfig(path=path, values=own, from_base=set(base_values) - assigned, base=base_label,
                        not_understood=not_understood)


# ---------------------------------------------------------------------------- mapping
@dataclass
class Conversion:
    """The ds_pfc job and what the user must know about it."""

    config: dict
    """DeepSpeed's config with the ``ds_pfc`` block (JSON-ready)."""
    mapped: list = field(default_factory=list)
    """``(arcface_torch key, value, where it went)``."""
    unmapped: list = field(default_factory=list)
    """``(arcface_torch key, value, reason)`` of the keys with no ds_pfc counterpart."""
    notes: list = field(default_factory=list)
    """Differences in what the converted settings compute."""


def _require(values, key, kinds, what):
    v = values[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
        raise MigrateError(f"config.{key} must be {what}, got {v!r}")
    return v


def _steps(micro_steps: int, gradient_acc: int) -> int:
    """arcface_torch counts micro batches; ds_pfc counts optimizer steps."""
    return max(1, int(micro_steps) // gradient_acc)


def _network(name: str):
    from ..models import ALIASES, BACKBONES
    if name not in _NETWORKS:
        return None, {}, f"arcface_torch has no network {name!r} (its names: {', '.join(_NETWORKS)})"
    candidates, options = _NETWORKS[name]
    for c in candidates:
        if c in ALIASES or c in BACKBONES:
            return c, dict(options), None
    return None, {}, (f"this ds_pfc has no backbone matching arcface_torch's {name!r} "
                      f"(its backbones: {', '.join(BACKBONES)})")


#: Wall-clock minutes between checkpoints that a converted config asks for (unless faithful).
CHECKPOINT_MINUTES = 30.0


def convert_arcface_config(parsed: ParsedConfig, *, world_size: int | None = None,
                           faithful: bool = False) -> Conversion:
    """Map the arcface_torch keys of ``parsed`` to a ds_pfc job (see the README's
    table). ``world_size`` (the GPUs the recipe ran on) is only used to turn
    per-epoch settings into steps; the config itself never holds it.

    By default the job keeps what a long cluster run needs whatever the recipe says:
    resuming on (a rerun continues from the newest checkpoint), a checkpoint every
    :data:`CHECKPOINT_MINUTES` minutes of wall time (and every epoch when ``world_size``
    is given), and TensorBoard (as arcface_torch always writes). ``faithful=True`` keeps
    the recipe's ``resume`` and ``save_all_states`` as they are (TensorBoard too)."""
    v = dict(parsed.values)
    name = os.path.splitext(os.path.basename(parsed.path))[0]
    missing = [k for k in _REQUIRED if k not in v]
    if missing:
        raise MigrateError(f"{parsed.path}: missing {', '.join('config.' + k for k in missing)} (arcface_torch's "
                           "train_v2.py needs them and base.py does not set them)")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise MigrateError(f"world_size must be a positive integer, got {world_size!r}")
    out = Conversion(config={})
    done: set = set()

    def mapped(key, where, value=None):
        out.mapped.append((key, v[key] if value is None else value, where))
        done.add(key)

    def unmapped(key, reason):
        out.unmapped.append((key, v[key], reason))
        done.add(key)

    batch = _require(v, "batch_size", int, "a positive integer (images per GPU)")
    acc = _require(v, "gradient_acc", int, "a positive integer")
    num_classes = _require(v, "num_classes", int, "a positive integer")
    emb = _require(v, "embedding_size", int, "a positive integer")
    lr = _require(v, "lr", (int, float), "a number")
    wd = _require(v, "weight_decay", (int, float), "a number")
    epochs = _require(v, "num_epoch", (int, float), "a number")
    warmup = _require(v, "warmup_epoch", (int, float), "a number")
    sample_rate = _require(v, "sample_rate", (int, float), "a number in (0, 1]")
    seed = _require(v, "seed", int, "an integer")
    for key, value in (("batch_size", batch), ("gradient_acc", acc), ("num_classes", num_classes),
                       ("embedding_size", emb)):
        if value < 1:
            raise MigrateError(f"config.{key} must be a positive integer, got {value!r}")

    ds: dict = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": acc,
                "gradient_clipping": 5.0, "steps_per_print": 100000000}
    mapped("batch_size", "train_micro_batch_size_per_gpu (images per GPU per micro step)")
    mapped("gradient_acc", "gradient_accumulation_steps")
    head: dict = {"num_classes": num_classes, "embedding_size": emb}
    mapped("num_classes", "ds_pfc.head.num_classes")
    mapped("embedding_size", "ds_pfc.head.embedding_size")
    if sample_rate == 0:
        # arcface_torch then samples int(0 * C_q) = 0 negatives: the batch's positive
        # classes only. ds_pfc needs r > 0; any r with floor(r C_q) = 0 does the same.
        head["sample_rate"] = 0.5 / num_classes
        mapped("sample_rate", f"ds_pfc.head.sample_rate {head['sample_rate']:.3g} (= 0.5 / num_classes: no "
               "negatives, the batch's positive classes only, as arcface_torch samples with 0)")
    elif 0 < sample_rate <= 1:
        head["sample_rate"] = float(sample_rate)
        mapped("sample_rate", "ds_pfc.head.sample_rate")
    else:
        raise MigrateError(f"config.sample_rate must be in [0, 1], got {sample_rate!r}")
    out.notes.append("gradient_clipping 5.0: arcface_torch clips the backbone's gradient norm at 5 (hard-wired in "
                     "train_v2.py, not a config key).")

    # margin (arcface_torch's scale is always 64)
    ml = v["margin_list"]
    if not (isinstance(ml, (tuple, list)) and len(ml) == 3 and all(_number(m) for m in ml)):
        raise MigrateError(f"config.margin_list must be three numbers (m1, m2, m3), got {ml!r}")
    m1, m2, m3 = (float(m) for m in ml)
    if m1 == 1.0 and m3 == 0.0:
        margin = {"type": "arcface", "scale": 64.0, "margin": m2, "straight_through": True}
        out.notes.append(f"ArcFace (m2 = {m2}): arcface_torch computes cos(theta + m) under no_grad, so its "
                         "gradient is that of the plain cosine logit (a straight-through derivative), not the "
                         "derivative of cos(theta + m). The converted head keeps that (straight_through: true); "
                         "set it false for ArcFace's true derivative.")
    elif m3 > 0:
        margin = {"type": "cosface", "scale": 64.0, "margin": m3}
        if m1 != 1.0 or m2 != 0.0:
            out.notes.append(f"margin_list {tuple(ml)}: arcface_torch applies only the cosine margin m3 when m3 > 0 "
                             f"and ignores m1 = {m1} and m2 = {m2}; the converted head does the same (cosface, "
                             f"margin {m3}). ds_pfc's combined type would apply all three.")
    else:
        margin = {"type": "combined", "scale": 64.0, "m1": m1, "m2": m2, "m3": m3}
        out.notes.append(f"margin_list {tuple(ml)}: arcface_torch's CombinedMarginLoss refuses this combination "
                         "(it handles only m1 = 1, m3 = 0 and m3 > 0); converted to ds_pfc's combined margin "
                         "cos(m1 theta + m2) - m3 with its true derivative.")
    head["margin"] = margin
    mapped("margin_list", f"ds_pfc.head.margin = {json.dumps(margin)}")

    # inter-class filter
    tau = _require(v, "interclass_filtering_threshold", (int, float), "a number")
    if tau > 0:
        head["filter_threshold"] = float(tau)
        mapped("interclass_filtering_threshold", "ds_pfc.head.filter_threshold")
        out.notes.append(f"filter_threshold {tau}: arcface_torch multiplies a filtered negative's cosine by 0, so it "
                         "stays in the softmax denominator as exp(0) = 1; ds_pfc removes it from the denominator. "
                         "Losses differ by those terms; both stop its gradient.")
    else:
        mapped("interclass_filtering_threshold", "ds_pfc.head.filter_threshold (off: arcface_torch filters only "
               "when > 0)", tau)

    # precision
    fp16 = _require(v, "fp16", bool, "true or false")
    head["compute_dtype"] = "fp32"
    if fp16:
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 100,
                      "hysteresis": 1, "min_loss_scale": 1}
        mapped("fp16", "fp16 (DeepSpeed, dynamic loss scale from 2^16, doubled after 100 clean steps as "
               "arcface_torch's GradScaler) + ds_pfc.head.compute_dtype fp32")
        out.notes.append("fp16: arcface_torch autocasts the backbone (float32 weights, float16 compute); DeepSpeed's "
                         "fp16 block keeps float16 weights with float32 master copies. For autocast instead, replace "
                         "the fp16 block by \"torch_autocast\": {\"enabled\": true, \"dtype\": \"float16\"}.")
    else:
        mapped("fp16", "(no DeepSpeed fp16 block) + ds_pfc.head.compute_dtype fp32")
    out.notes.append("compute_dtype fp32: arcface_torch's train_v2.py builds PartialFC_V2 with fp16=False, so its "
                     "head GEMMs are float32 whatever config.fp16 says. bf16 runs them on tensor cores, several "
                     "times faster, with float32 accumulation.")

    # optimizer
    opt = _require(v, "optimizer", str, "'sgd' or 'adamw'")
    momentum = v.get("momentum", 0.9)
    if opt == "sgd":
        ds["optimizer"] = {"type": "SGD", "params": {"lr": lr, "momentum": 0.9, "weight_decay": wd}}
        head["optimizer"] = {"type": "sgd", "lr_ratio": 1.0, "momentum": 0.9, "weight_decay": wd}
        if "momentum" in v:
            if momentum != 0.9:
                unmapped("momentum", f"arcface_torch's train_v2.py ignores config.momentum and uses 0.9; the "
                                     f"converted config uses 0.9 too (set optimizer.params.momentum and "
                                     f"ds_pfc.head.optimizer.momentum to {momentum} to change it)")
            else:
                mapped("momentum", "optimizer.params.momentum, ds_pfc.head.optimizer.momentum")
    elif opt == "adamw":
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": wd, "torch_adam": True}}
        head["optimizer"] = {"type": "adamw", "lr_ratio": 1.0, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": wd}
        if "momentum" in v:
            unmapped("momentum", "not used with adamw (arcface_torch's AdamW has torch's betas (0.9, 0.999))")
    else:
        raise MigrateError(f"config.optimizer must be 'sgd' or 'adamw' (the two arcface_torch trains with), "
                           f"got {opt!r}")
    mapped("optimizer", f"optimizer.type {ds['optimizer']['type']} + ds_pfc.head.optimizer.type {opt}")
    mapped("lr", "optimizer.params.lr (the head follows it: lr_ratio 1.0)")
    mapped("weight_decay", "optimizer.params.weight_decay, ds_pfc.head.optimizer.weight_decay")
    out.notes.append("Lazy head updates: ds_pfc updates only the rows of the classes sampled in a step (their "
                     "momentum/moments and weight decay included); arcface_torch's dense optimizer also moves "
                     "momentum and weight decay on every unsampled row of its shard. With sample_rate 1 there "
                     "is no difference.")
    if acc > 1:
        out.notes.append(f"gradient_acc {acc}: arcface_torch sums the gradients of the {acc} micro steps (no "
                         f"1/{acc}); DeepSpeed averages them. With SGD that is a factor {acc} in the effective "
                         "learning rate; with AdamW it changes only clipping and eps.")

    # schedule: arcface_torch's PolynomialLRWarmup with its default power 1, as train_v2.py steps it
    train: dict = {"epochs": epochs}
    warm = warmup
    if warmup < 0:
        warm = 0
        out.notes.append(f"warmup_epoch {warmup} < 0 is converted to no warm-up (PolynomialLRWarmup with a "
                         "negative warm-up decays as with none).")
    schedule = {"type": "arcface", "warmup_epochs": warm, "power": 1.0}
    num_image = v.get("num_image")
    if _number(num_image) and num_image >= 1 and float(num_image).is_integer():
        schedule["images_per_epoch"] = int(num_image)
        mapped("num_image", "ds_pfc.train.schedule.images_per_epoch (the epoch size train_v2.py counts its "
               "schedule from; the run's epochs are still those of the data)")
    train["schedule"] = schedule
    mapped("num_epoch", "ds_pfc.train.epochs")
    mapped("warmup_epoch", "ds_pfc.train.schedule.warmup_epochs (type arcface: PolynomialLRWarmup, power 1, as "
           "train_v2.py uses it)")
    out.notes.append("Schedule: type arcface is train_v2.py's PolynomialLRWarmup (power 1) stepped per micro "
                     "batch: the full lr at the first micro batch, k / w of it at micro batch k of the warm-up, "
                     "then linear decay to 0; each optimizer step takes the lr of its last micro batch, so the "
                     "learning rate of every optimizer step is arcface_torch's.")

    # gradient compression: train_v2.py registers DDP's fp16_compress_hook whatever config.fp16 says
    ds["communication_data_type"] = "fp16"
    ds["prescale_gradients"] = True
    out.notes.append("Gradient compression: train_v2.py all-reduces the backbone's gradients in float16, divided "
                     "by the number of GPUs before the sum (DDP's fp16_compress_hook); the converted job does the "
                     "same (communication_data_type fp16, prescale_gradients true). DeepSpeed multiplies by 1/GPUs "
                     "where the hook divides: the same float16 values when the GPU count is a power of 2, within "
                     "one float16 rounding otherwise. Remove both keys for float32 all-reduces (twice the bytes).")
    train["seed"] = seed
    head["seed"] = seed
    mapped("seed", "ds_pfc.train.seed, ds_pfc.head.seed, ds_pfc.data.seed")
    frequent = _require(v, "frequent", int, "a positive integer")
    train["log_every"] = _steps(frequent, acc)
    mapped("frequent", "ds_pfc.train.log_every (optimizer steps = frequent // gradient_acc)")
    output = v.get("output")
    if output is None:
        output = os.path.join("work_dirs", name)      # get_config's rule
    if not isinstance(output, str):
        raise MigrateError(f"config.output must be a directory path or None, got {output!r}")
    train["output_dir"] = output
    mapped("output", "ds_pfc.train.output_dir (None: work_dirs/<config name>, as get_config does)", output)

    # data
    rec = _require(v, "rec", str, "a directory path or 'synthetic'")
    data: dict = {"seed": seed, "flip": True, "shuffle": True}
    if rec == "synthetic":
        data["source"] = "synthetic"
        mapped("rec", "ds_pfc.data.source synthetic (ds_pfc's procedural identities, one per class)")
        out.notes.append("rec 'synthetic': arcface_torch's synthetic set is one random image; ds_pfc's is a "
                         "procedural identity set with held-out verification pairs.")
    elif os.path.isdir(rec) and not os.path.isfile(os.path.join(rec, "train.rec")):
        data.update(source="hf", path=rec)
        mapped("rec", "ds_pfc.data.source hf, path (an image folder, as arcface_torch reads a directory "
               "without train.rec)")
    else:
        data.update(source="recordio", path=os.path.join(rec, "train.rec"))
        mapped("rec", "ds_pfc.data.path = <rec>/train.rec (source recordio; train.idx beside it)")
    workers = _require(v, "num_workers", int, "an integer >= 0")
    data["workers"] = workers
    mapped("num_workers", "ds_pfc.data.workers")
    if "num_image" not in done:
        unmapped("num_image", "not a positive whole number: the schedule counts epochs of the training set")
    if _require(v, "dali", bool, "true or false"):
        unmapped("dali", "ds_pfc reads the same train.rec with its own worker processes (no DALI)")
    else:
        mapped("dali", "(nothing: ds_pfc's own loader)")
    if _require(v, "dali_aug", bool, "true or false"):
        unmapped("dali_aug", "ds_pfc augments by horizontal flip only (data.flip); DALI's extra augmentation "
                             "has no counterpart")
    else:
        mapped("dali_aug", "(nothing)")

    # evaluation
    targets = v["val_targets"]
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise MigrateError(f"config.val_targets must be a list of names, got {targets!r}")
    verbose = _require(v, "verbose", int, "a positive integer")
    evaluation: dict = {"every_steps": _steps(verbose, acc)}
    if targets and rec != "synthetic":
        evaluation["bins"] = [os.path.join(rec, t + ".bin") for t in targets]
    elif targets:
        out.notes.append("val_targets with rec 'synthetic': ds_pfc evaluates on its synthetic held-out pairs.")
    mapped("val_targets", "ds_pfc.evaluation.bins = <rec>/<name>.bin")
    mapped("verbose", "ds_pfc.evaluation.every_steps (optimizer steps = verbose // gradient_acc)")

    # checkpoints
    checkpoint: dict = {"export": True}
    resume = _require(v, "resume", bool, "true or false")
    save_all = _require(v, "save_all_states", bool, "true or false")
    per_epoch = None
    if world_size is not None and isinstance(v["num_image"], int):
        per_epoch = max(1, v["num_image"] // (batch * world_size * acc))
    if faithful:
        checkpoint["resume"] = resume
        mapped("resume", "ds_pfc.checkpoint.resume (--faithful)")
        if resume:
            out.notes.append("resume: arcface_torch resumes from its checkpoint_gpu_<rank>.pt files in output; "
                             "ds_pfc resumes from its own checkpoints in output_dir and does not read those files "
                             "as they are.")
        else:
            out.notes.append("resume false: ds_pfc refuses to start over checkpoints already in output_dir "
                             "(arcface_torch would overwrite them); continue with launch/train.py --resume, or "
                             "delete them.")
        if save_all and per_epoch is not None:
            checkpoint["every_steps"] = per_epoch
            mapped("save_all_states", f"ds_pfc.checkpoint.every_steps = one epoch at {world_size} GPUs (--faithful)")
        elif save_all:
            checkpoint["every_steps"] = 0
            mapped("save_all_states", "ds_pfc.checkpoint (at the end only: give --world-size for one per epoch)")
            out.notes.append("save_all_states: arcface_torch saves every epoch; set ds_pfc.checkpoint.every_steps "
                             "to num_image // (batch_size x GPUs x gradient_acc) for the same (or pass "
                             "--world-size).")
        else:
            checkpoint["every_steps"] = 0
            mapped("save_all_states", "ds_pfc.checkpoint.every_steps 0 (--faithful: ds_pfc always writes a full "
                   "checkpoint at the end, and export/model.safetensors like arcface_torch's model.pt)")
    else:
        checkpoint["resume"] = True
        checkpoint["every_minutes"] = CHECKPOINT_MINUTES
        checkpoint["every_steps"] = per_epoch or 0
        mapped("resume", "ds_pfc.checkpoint.resume = true whatever the recipe says (a rerun after a crash "
               "continues; --faithful keeps the recipe's value)", True)
        every = f"every {CHECKPOINT_MINUTES:g} minutes of wall time" + (
            f" and every epoch at {world_size} GPUs" if per_epoch else "")
        mapped("save_all_states", f"ds_pfc.checkpoint: {every} (--faithful keeps the recipe's "
               f"{'per-epoch' if save_all else 'final-only'} checkpoints)", save_all)
        if not resume:
            out.notes.append("resume: the recipe says false, the converted job resumes (a rerun continues from "
                             "the newest checkpoint in output_dir; launch/train.py --no_resume starts fresh where "
                             "there is none). ds_pfc does not read arcface_torch's checkpoint_gpu_<rank>.pt files.")
        out.notes.append(f"checkpoints: {every}, so a crash or preemption loses at most that much; "
                         "ds_pfc.checkpoint.keep (2) bounds the disk used.")

    # network
    network = _require(v, "network", str, "a network name")
    backbone_name, options, why = _network(network)
    if backbone_name is None:
        raise MigrateError(f"config.network: {why}")
    backbone: dict = {"name": backbone_name}
    if options:
        backbone["options"] = options
    mapped("network", f"ds_pfc.backbone = {json.dumps(backbone)}")

    # weights & biases
    if v.get("using_wandb") is True:
        wb = {"enabled": True}
        if isinstance(v.get("wandb_project"), str):
            wb["project"] = v["wandb_project"]
        if isinstance(v.get("wandb_entity"), str):
            wb["team"] = v["wandb_entity"]
        ds["wandb"] = wb
        mapped("using_wandb", "wandb.enabled (DeepSpeed's monitor)")
        for k in ("wandb_project", "wandb_entity"):
            if k in v:
                mapped(k, "wandb.project" if k == "wandb_project" else "wandb.team")
    for k in _WANDB_KEYS:
        if k in v and k not in done:
            if k == "wandb_key":
                unmapped(k, "not written: log in with `wandb login` or WANDB_API_KEY")
            else:
                unmapped(k, "Weights & Biases option of arcface_torch's own logger; DeepSpeed's wandb block has no "
                            "counterpart" if v.get("using_wandb") is True else "W&B logging is off")

    for k in sorted(set(v) - done):
        unmapped(k, "not an arcface_torch setting (train_v2.py does not read it)")

    out.notes.append("Batch size: batch_size is per GPU, and neither config names the number of GPUs; the global "
                     "batch is batch_size x GPUs x gradient_acc, set by how many ranks you launch. The lr is used "
                     "as given, as arcface_torch does (it is tied to the recipe's GPU count).")
    description = (f"Converted from arcface_torch config {os.path.basename(parsed.path)} by ds-pfc-migrate "
                   f"(margin_list {tuple(ml)}, network {network}).")
    # arcface_torch always writes TensorBoard events (its SummaryWriter in output)
    if "tensorboard" not in ds:
        ds["tensorboard"] = {"enabled": True}
        out.notes.append("tensorboard: on, as arcface_torch always logs (events in <output_dir>/tensorboard/train); "
                         "needs the tensorboard package (pip install tensorboard, or ds_pfc[tensorboard]).")
    ds["ds_pfc"] = {"description": description, "head": head, "backbone": backbone, "data": data, "train": train,
                    "evaluation": evaluation, "checkpoint": checkpoint}
    out.config = ds
    _validate(ds)
    return out


def _validate(config: dict) -> None:
    """The converted JSON must parse with ds_pfc's own loader."""
    from .config import ConfigError, split_config
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            split_config(json.loads(json.dumps(config)))
    except (ConfigError, UserWarning) as err:
        raise MigrateError(f"the converted config does not load in ds_pfc: {err}") from None


# ---------------------------------------------------------------------------- CLI
def _report(parsed: ParsedConfig, conv: Conversion, written: str | None) -> str:
    lines = [f"arcface_torch config {parsed.path} (read with ast; {_NOT_EXECUTED})"]
    if parsed.base == "built-in":
        lines.append("base: no base.py beside it; arcface_torch's stock base.py values were used")
    elif parsed.base:
        lines.append(f"base: {parsed.base}")
    lines.append("mapped:")
    for key, value, where in conv.mapped:
        origin = " (base)" if key in parsed.from_base else ""
        lines.append(f"  {key} = {value!r}{origin} -> {where}")
    if conv.unmapped:
        lines.append("not mapped:")
        for key, value, reason in conv.unmapped:
            lines.append(f"  {key} = {value!r}: {reason}")
    if parsed.not_understood:
        lines.append(f"not understood (skipped; {_NOT_EXECUTED}):")
        for line, text in parsed.not_understood:
            lines.append(f"  line {line}: {text}")
    lines.append("differences to know:")
    for note in conv.notes:
        lines.append(f"  - {note}")
    if written:
        lines.append(f"wrote {written}")
    return "\n".join(lines)


def _config_command(args) -> int:
    parsed = parse_arcface_config(args.config)
    if parsed.not_understood and not args.skip_unknown:
        listed = "; ".join(f"line {line}: {text}" for line, text in parsed.not_understood)
        raise MigrateError(f"{args.config}: not converted, statements that are not literal config assignments "
                           f"({_NOT_EXECUTED}): {listed}; pass --skip-unknown to convert the rest")
    conv = convert_arcface_config(parsed, world_size=args.world_size, faithful=args.faithful)
    text = json.dumps(conv.config, indent=2) + "\n"
    if args.output:
        if os.path.exists(args.output) and not args.force:
            raise MigrateError(f"{args.output} exists; pass --force to overwrite it")
        with open(args.output, "w") as f:
            f.write(text)
        print(_report(parsed, conv, args.output))
    else:
        sys.stdout.write(text)
        print(_report(parsed, conv, None), file=sys.stderr)
    return 0
