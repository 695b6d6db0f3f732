"""A JSON Schema of the job config, generated from the config classes of
:mod:`ds_pfc.app.config` (their fields, types, defaults and the docstring under each
field), for editors:

    ds-pfc-train --schema > ds_pfc.schema.json

and in a job JSON ``"$schema": "./ds_pfc.schema.json"`` (VS Code, JetBrains and other
editors then complete and check the ``ds_pfc`` block). The ``ds_pfc`` block is described
exactly (unknown keys are errors, as for the parser); DeepSpeed's own top-level keys are
listed without their contents, which DeepSpeed checks itself."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing

__all__ = ["job_schema"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def job_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a job config: DeepSpeed's top-level keys plus
    the ``ds_pfc`` block."""
    from . import config
    defs: dict[str, dict] = {}
    root = _dataclass_schema(config.DsPfcConfig, defs)
    deepspeed = {key: {"description": "DeepSpeed's key (checked by DeepSpeed)"}
                 for key in sorted(config.DEEPSPEED_TOP_LEVEL_KEYS)}
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "ds_pfc job config",
        "description": "DeepSpeed's config plus the ds_pfc block (ds_pfc.app.config).",
        "type": "object",
        "properties": {"$schema": {"type": "string"}, **deepspeed, "ds_pfc": root},
        "required": ["ds_pfc"],
        "$defs": defs,
    }


def _dataclass_schema(cls, defs: dict) -> dict:
    """``{"$ref": ...}`` to ``cls``'s schema, added to ``defs`` once."""
    name = cls.__name__
    if name not in defs:
        defs[name] = {}                     # placeholder: a class may refer to itself
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        properties, required = {}, []
        for f in dataclasses.fields(cls):
            prop = _type_schema(hints[f.name], defs)
            if f.name in docs:
                prop["description"] = docs[f.name]
            default = _default(f)
            if default is not dataclasses.MISSING:
                prop["default"] = default
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            choices = _CHOICES.get((name, f.name))
            if choices:
                prop["enum"] = list(choices())
            properties[f.name] = prop
        body = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            body["required"] = required
        doc = inspect.getdoc(cls)
        if doc:
            body["description"] = doc
        defs[name] = body
    return {"$ref": f"#/$defs/{name}"}


def _type_schema(hint, defs: dict) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_type_schema(a, defs) for a in typing.get_args(hint)]
        return {"anyOf": options}
    if dataclasses.is_dataclass(hint):
        return _dataclass_schema(hint, defs)
    base = origin or hint
    if hint is type(None):
        return {"type": "null"}
    if base is bool:
        return {"type": "boolean"}
    if base is int:
        return {"type": "integer"}
    if base is float:
        return {"type": "number"}
    if base is str:
        return {"type": "string"}
    if base in (list, tuple):
        return {"type": "array"}
    if base is dict:
        return {"type": "object"}
    return {}


def _default(f: dataclasses.Field):
    """A field's default as JSON (a default factory's value; MISSING when required or
    not JSON)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return dataclasses.MISSING
    if dataclasses.is_dataclass(value):
        return dataclasses.MISSING          # described by its own schema
    if value is None or isinstance(value, (bool, int, float, str, list, dict)):
        return value
    return dataclasses.MISSING


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each field of ``cls`` (the string right after it)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _margin_types():
    from .config import _MARGIN_PARAMS
    return sorted(_MARGIN_PARAMS)


def _nonfinite_policies():
    from .config import NONFINITE_POLICIES
    return NONFINITE_POLICIES


# Fields whose values come from a fixed list: (class, field) -> the list.
def _validate_modes():
    from .config import VALIDATE_MODES
    return VALIDATE_MODES


_CHOICES = {("MarginConfig", "type"): _margin_types, ("TrainConfig", "on_nonfinite"): _nonfinite_policies,
            ("HeadConfig", "validate"): _validate_modes}
