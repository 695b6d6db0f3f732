"""``python launch/experiments.py`` from a checkout: the ``ds-pfc-experiments`` command (:mod:`ds_pfc.cli.experiments`)."""
import _common  # noqa: F401  (puts the checkout on sys.path)
from ds_pfc.cli.experiments import build_parser, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
