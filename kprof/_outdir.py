"""Output directories written once: the checks made before any work, so a refusal leaves nothing behind."""

from __future__ import annotations

import os
import tempfile

from .errors import UsageError

__all__ = ["check_output_dir"]

_FIX = "pass a new directory (it is created if absent)"


def check_output_dir(path: str, names, what: str) -> None:
    """Refuses a directory the files `names` (`what` they make, e.g. "a snapshot") could not be written to: empty,
    holding any of them already (outputs are immutable), not a directory, or not writable, nor creatable (a
    directory is made and removed again in its parent to prove it). Leaves nothing."""
    if not path.strip():
        raise UsageError(f"--output-dir {path!r} is empty; {_FIX}, or omit --output-dir")
    if os.path.isdir(path):
        held = [name for name in names if os.path.lexists(os.path.join(path, name))]
        if held:
            raise UsageError(f"--output-dir {path} already holds {what} ({', '.join(held)}); outputs are immutable: "
                             f"{_FIX}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--output-dir {path} is not writable for this user; {_FIX}, or fix its permissions")
        return
    if os.path.lexists(path):
        kind = "a file" if os.path.exists(path) else "a broken link"
        raise UsageError(f"--output-dir {path} is {kind}, not a directory; {_FIX}")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(ancestor):  # the nearest existing directory it would be created in
        if os.path.lexists(ancestor):
            raise UsageError(f"--output-dir {path} passes through {ancestor}, which is not a directory; {_FIX}")
        ancestor = os.path.dirname(ancestor)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {path} cannot be created: {ancestor} is not writable for this user; {_FIX}")
    try:  # permissions are not all: a read-only mount, or /proc and /sys, refuse a directory whatever they say
        os.rmdir(tempfile.mkdtemp(prefix=".kprof-probe-", dir=ancestor))
    except OSError as exc:
        raise UsageError(f"--output-dir {path} cannot be created in {ancestor} ({exc.strerror}); {_FIX}") from None
