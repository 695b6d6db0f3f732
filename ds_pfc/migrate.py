"""``python -m ds_pfc.migrate``: convert arcface_torch files for ds_pfc
(:mod:`ds_pfc.cli.migrate`; the conversion is :mod:`ds_pfc.app.migrate`)."""
import sys

from ds_pfc.cli.migrate import main

if __name__ == "__main__":
    sys.exit(main())
