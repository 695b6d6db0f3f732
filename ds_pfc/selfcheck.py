"""``python -m ds_pfc.selfcheck``: the GPU self-check (:mod:`ds_pfc.cli.selfcheck`; the
checks are in :mod:`ds_pfc.bench.selfcheck`)."""
import sys

from ds_pfc.cli.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
