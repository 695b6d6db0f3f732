"""``python launch/bench.py`` from a checkout: the ``ds-pfc-bench`` command (:mod:`ds_pfc.cli.bench`)."""
import _common  # noqa: F401  (puts the checkout on sys.path)
from ds_pfc.cli.bench import build_parser, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
