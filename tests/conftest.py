import os
import sys

# tests/ helpers (``_dist``) importable from every test module and spawned rank.
sys.path.insert(0, os.path.dirname(__file__))
