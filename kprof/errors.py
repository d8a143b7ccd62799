"""One root error, one subclass per failure; `exit_code` is the only place errors map to exit codes."""

from __future__ import annotations

__all__ = [
    "KprofError",
    "UsageError",
    "SpecError",
    "LedgerError",
    "LedgerVersionError",
    "IntegrityError",
    "exit_code",
]


class KprofError(Exception):
    """Root of every error kprof raises on purpose. The message says what, where, and how to fix it."""

    exit_code = 1


class UsageError(KprofError):
    """Bad input from the caller: nothing was written."""

    exit_code = 2


class SpecError(UsageError):
    """A spec that does not fit its table's KernelArgs."""

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None, value=None):
        self.index = index
        self.field = field
        self.value = value
        where = f"spec {index}: " if index is not None else ""
        super().__init__(where + message)


class LedgerError(KprofError):
    """The ledger file cannot be opened or used as asked (missing, locked, not a ledger)."""

    exit_code = 2


class LedgerVersionError(LedgerError):
    """The ledger was written by a newer kprof format than this one reads."""

    def __init__(self, path: str, found: int, supported: int):
        self.path, self.found, self.supported = path, found, supported
        super().__init__(
            f"ledger {path} has format version {found}, but this kprof reads versions up to {supported}; "
            f"upgrade kprof to read it"
        )


class IntegrityError(KprofError):
    """The ledger's contents are inconsistent or damaged (exit 3)."""

    exit_code = 3


def exit_code(error: BaseException) -> int:
    if isinstance(error, KprofError):
        return error.exit_code
    return 1
