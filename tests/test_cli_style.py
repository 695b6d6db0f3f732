"""One command-line style for every ds_pfc command (``ds_pfc._args``): each parser of
the console commands, of the benchmarks behind ``ds-pfc-bench`` and of the ``launch/``
examples, sub-commands included, is the helper's ``ArgumentParser`` with the program name
users type, a one-line description that is a complete sentence, one-line help for every
argument and ``--version``; every ``--a_b`` option also parses as ``--a-b`` (and the other
way round) to the same namespace."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

import pytest

from ds_pfc._args import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = ("head", "bank", "accuracy", "data", "plan", "rows", "hostpath", "grow")

# id -> (how to build the parser, its program name)
COMMANDS = {
    **{f"ds-pfc-{name}": (f"ds_pfc.cli.{name}", f"ds-pfc-{name}")
       for name in ("train", "eval", "export", "bench", "experiments", "selfcheck", "migrate", "clean")},
    **{f"bench-{name}": (f"ds_pfc.bench.{name}", f"ds-pfc-bench {name}") for name in BENCHMARKS},
    "bench-head-predict": ("ds_pfc.bench.predict", "ds-pfc-bench head --predict"),
    "bench-clean-predict": ("ds_pfc.bench.clean_predict", "ds-pfc-bench clean-predict"),
    "launch-demo": ("launch/demo.py", "python launch/demo.py"),
    "launch-multitask_tp": ("launch/multitask_tp.py", "deepspeed launch/multitask_tp.py"),
}


def _build(source: str) -> argparse.ArgumentParser:
    if source.endswith(".py"):
        name = "_cli_style_" + os.path.splitext(os.path.basename(source))[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, source))
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.join(ROOT, "launch"))       # the scripts import launch/_common.py
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(os.path.join(ROOT, "launch"))
    else:
        module = importlib.import_module(source)
    return module.build_parser()


def _walk(parser, prog: str, path=()):
    """``(parser, expected prog, sub-command path)`` of the parser and of every sub-parser."""
    yield parser, prog, list(path)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prog} {name}", (*path, name))


def _skipped(action) -> bool:
    return isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.help == argparse.SUPPRESS


def _value(action) -> list[str]:
    """A valid value (as command-line words) for the action."""
    if action.nargs == 0:
        return []
    if action.choices is not None:
        word = str(next(iter(action.choices)))
    else:
        word = None
        for candidate in ("1", "0.5", "x"):
            try:
                if action.type is not None:
                    action.type(candidate)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
            word = candidate
            break
        assert word is not None, f"no valid value found for {action.option_strings or action.dest}"
    return [word] * (action.nargs if isinstance(action.nargs, int) else 1)


def _required(parser, leave_out=None) -> tuple[list[str], list[str]]:
    """The words of the parser's required options, and of its positionals (sub-commands and
    REMAINDER excepted)."""
    options, positionals = [], []
    for action in parser._actions:
        if action is leave_out or isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            if action.required:
                options += [action.option_strings[0], *_value(action)]
        elif action.nargs not in (argparse.REMAINDER, "*", "?"):
            positionals += _value(action)
    return options, positionals


@pytest.fixture(scope="module", params=sorted(COMMANDS))
def command(request):
    source, prog = COMMANDS[request.param]
    return _build(source), prog


def test_every_parser_of_the_package_is_listed():
    """Each ``build_parser()`` under ds_pfc/cli and ds_pfc/bench, and each launch script
    with one, is walked here."""
    listed = {source for source, _ in COMMANDS.values()}
    found = set()
    for package in ("cli", "bench"):
        folder = os.path.join(ROOT, "ds_pfc", package)
        for filename in sorted(os.listdir(folder)):
            if filename.endswith(".py"):
                with open(os.path.join(folder, filename), encoding="utf-8") as f:
                    if "def build_parser(" in f.read():
                        found.add(f"ds_pfc.{package}.{filename[:-3]}")
    for filename in sorted(os.listdir(os.path.join(ROOT, "launch"))):
        if filename.endswith(".py"):
            with open(os.path.join(ROOT, "launch", filename), encoding="utf-8") as f:
                if "def build_parser(" in f.read():
                    found.add(f"launch/{filename}")
    assert found <= listed, f"parsers not covered: {sorted(found - listed)}"


def test_no_plain_argparse_parsers_left():
    """Every parser is built by ``ds_pfc._args.parser`` (or is its sub-parser)."""
    bad = []
    for folder in ("ds_pfc", "launch"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                path = os.path.join(dirpath, filename)
                if filename.endswith(".py") and path != os.path.join(ROOT, "ds_pfc", "cli", "_args.py"):
                    with open(path, encoding="utf-8") as f:
                        if "argparse.ArgumentParser(" in f.read():
                            bad.append(os.path.relpath(path, ROOT))
    assert not bad, f"built with argparse.ArgumentParser instead of ds_pfc._args.parser: {bad}"


def test_parsers_are_the_helpers(command):
    parser, prog = command
    for p, expected, _ in _walk(parser, prog):
        assert isinstance(p, ArgumentParser), f"{expected}: {type(p)}"
        assert p.prog == expected


def test_descriptions_are_one_complete_line(command):
    parser, prog = command
    for p, expected, _ in _walk(parser, prog):
        text = p.description or ""
        assert text.strip() == text and text, f"{expected}: no description"
        assert "\n" not in text and "``" not in text, f"{expected}: {text!r}"
        assert text[0].isupper() and text.endswith((".", ")")), f"{expected}: not a complete sentence: {text!r}"


def test_every_argument_has_help(command):
    parser, prog = command
    for p, expected, _ in _walk(parser, prog):
        p.format_help()                                         # every %(...)s in the help resolves
        for action in p._actions:
            if _skipped(action):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip() and "\n" not in action.help, f"{expected} {name}: no help"
            for choice in getattr(action, "_choices_actions", []):        # a sub-command's line
                assert choice.help and choice.help.strip(), f"{expected} {choice.dest}: no help"


def test_version(command, capsys):
    """The command and each of its sub-commands print the version under their own name."""
    parser, prog = command
    for p, expected, path in _walk(parser, prog):
        assert any(isinstance(a, argparse._VersionAction) and "--version" in a.option_strings for a in p._actions), expected
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(path + ["--version"])
        assert caught.value.code in (0, None)
        out = capsys.readouterr().out
        assert "ds_pfc" in out and out.startswith(expected + " ("), (expected, out)


def _other(option: str) -> str:
    body = option[2:]
    return "--" + (body.replace("_", "-") if "_" in body else body.replace("-", "_"))


def test_both_spellings_parse_alike(command):
    parser, prog = command
    for p, expected, path in _walk(parser, prog):
        declared = p._option_string_actions
        for action in p._actions:
            if _skipped(action) or not action.option_strings:
                continue
            for option in action.option_strings:
                if not option.startswith("--") or not ("_" in option[2:] or "-" in option[2:]):
                    continue
                other = _other(option)
                if other in declared:
                    assert declared[other] is action, f"{expected}: {other} and {option} are different options"
                    continue
                options, positionals = _required(p, leave_out=action)
                value = _value(action)

                def parse(words):
                    return vars(parser.parse_args(path + options + words + positionals))
                want = parse([option, *value])
                assert parse([other, *value]) == want, f"{expected}: {other} differs from {option}"
                if len(value) == 1:
                    assert parse([f"{other}={value[0]}"]) == want, f"{expected}: {other}=... differs from {option}"
