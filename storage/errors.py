"""Errors of both stores (importing neither engine); the hook layer maps them to answers and reason codes.

StorageError            the store could not do what was asked; nothing was committed
├── StorageFull         LMDB: the map reached map_max_bytes and cannot grow
├── LockTimeout         PostgreSQL: a statement waited too long for a lock someone else holds
├── EarlyTriggersFull   too many triggers are waiting for their data
├── PoliciesFull        as many campaign policies are in force as max_policies allows
├── RequestAborted      the request's campaign was aborted: its batches are refused
├── PlanError           the directory is not a GC plan this build can apply
└── CommitTimeout       a write did not commit within its deadline (it may still land later)
"""


class StorageError(Exception):
    """The store failed; the operation was not committed."""


class StorageFull(StorageError):
    """The LMDB map cannot grow any further (map_max_bytes reached)."""


class EarlyTriggersFull(StorageError):
    """The bounded store of triggers waiting for their data is full."""


class PoliciesFull(StorageError):
    """As many campaign policies are in force as the bound allows; a new request id's is refused."""


class RequestAborted(StorageError):
    """The request's campaign was aborted by its policy's criterion; a batch of it is refused
    until a new policy for the request re-opens it."""


class PlanError(StorageError):
    """The directory is not a GC plan this build can apply."""


class CommitTimeout(StorageError):
    """A write did not commit within its deadline (it may still land later)."""


class LockTimeout(StorageError):
    """PostgreSQL: a statement waited longer than its lock_timeout for a lock another session
    holds (a vehicle's rows, a request's cancel); its transaction was rolled back."""
