"""Compatibility shim: `python -m launcher kernel-profile <verb> ...` is `kprof <verb> ...`."""
