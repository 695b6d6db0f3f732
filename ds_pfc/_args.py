"""One command-line style for every ds_pfc command (the console commands, the benchmarks,
launch/*.py): each ``--a_b`` option is also accepted
as ``--a-b`` (and the other way round); help shows the spelling the option was declared
with. Every parser, sub-commands' included, has ``--version``. Commands build theirs with
:func:`parser`."""
from __future__ import annotations

import argparse

__all__ = ["ArgumentParser", "parser"]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reads ``--a-b`` as ``--a_b`` where only the one
    spelling is declared (and vice versa), also after ``--opt=value`` and in the
    sub-commands (which are built with this class too)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._canonical(args), namespace)

    def _canonical(self, args: list) -> list:
        known = set(self._option_string_actions)
        out = []
        for i, arg in enumerate(args):
            if arg == "--":                       # everything after it is positional
                return out + args[i:]
            if isinstance(arg, str) and arg.startswith("--") and len(arg) > 2:
                name, eq, value = arg.partition("=")
                if name not in known:
                    for other in (name[:2] + name[2:].replace("-", "_"), name[:2] + name[2:].replace("_", "-")):
                        if other in known:
                            arg = other + eq + value
                            break
            out.append(arg)
        return out

    def add_subparsers(self, **kwargs):
        """Sub-commands are parsers of this class with their own ``--version``
        (``ds-pfc-export onnx --version``)."""
        action = super().add_subparsers(**kwargs)
        add_parser = action.add_parser

        def add(name, **kw):
            sub = add_parser(name, **kw)
            _add_version(sub)
            return sub
        action.add_parser = add
        return action


def _add_version(p: argparse.ArgumentParser) -> None:
    from ._versions import __version__
    p.add_argument("--version", action="version", version=f"{p.prog} (ds_pfc) {__version__}",
                   help="print the ds_pfc version and exit")


def parser(prog: str, description: str, **kwargs) -> ArgumentParser:
    """The parser of the command ``prog`` (its name as users type it, e.g.
    ``ds-pfc-train``), with ``--version``."""
    p = ArgumentParser(prog=prog, description=description, **kwargs)
    _add_version(p)
    return p
