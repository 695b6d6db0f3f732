"""The ds_pfc release (one place: the package, setup.cfg and the app's logs read it)."""
__version__ = "0.2.0"
