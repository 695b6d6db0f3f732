"""``ds-pfc-migrate`` / ``python -m ds_pfc.cli.migrate``: convert insightface arcface_torch
files for ds_pfc (the conversion is :mod:`ds_pfc.app.migrate`).

    ds-pfc-migrate config configs/wf42m_pfc02_r100.py -o wf42m_pfc02_r100.json
"""
from __future__ import annotations

import argparse
import sys

from .._args import parser

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = parser("ds-pfc-migrate", "Convert insightface arcface_torch files for ds_pfc.")
    sub = p.add_subparsers(dest="command", required=True, help="what to convert ('COMMAND --help' lists its "
                                                                "options)")
    c = sub.add_parser("config", help="an arcface_torch configs/*.py -> a ds_pfc job JSON (read, never executed)",
                       description="Convert an arcface_torch config (configs/*.py, read as literal assignments, "
                                   "never executed) into a ds_pfc job JSON, with a report of what maps to what.")
    c.add_argument("config", help="the arcface_torch config (.py)")
    c.add_argument("-o", "--output", default=None, help="write the JSON here (default: stdout; the report goes "
                                                         "to stderr then)")
    c.add_argument("--world-size", type=int, default=None,
                   help="GPUs the recipe ran on (only to turn save_all_states' per-epoch checkpoints into steps)")
    c.add_argument("--skip-unknown", action="store_true",
                   help="convert even if some statements are not literal config assignments (they are skipped)")
    c.add_argument("--force", action="store_true", help="overwrite --output")
    c.add_argument("--faithful", action="store_true",
                   help="keep the recipe's resume and save_all_states as they are (default: resume on and a "
                        "checkpoint every 30 minutes of wall time, and every epoch with --world-size)")
    return p


def main(argv=None) -> int:
    """``ds-pfc-migrate`` / ``python -m ds_pfc.cli.migrate``: exit status 1 on a refused conversion."""
    from ..app.migrate import MigrateError, _config_command

    args = build_parser().parse_args(argv)
    try:
        return _config_command(args)
    except MigrateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":     # python -m ds_pfc.cli.migrate
    sys.exit(main())
