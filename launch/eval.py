"""``python launch/eval.py`` from a checkout: the ``ds-pfc-eval`` command (:mod:`ds_pfc.cli.eval`)."""
import _common  # noqa: F401  (puts the checkout on sys.path)
from ds_pfc.cli.eval import build_parser, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
