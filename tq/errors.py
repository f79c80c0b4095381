"""Exception types of the TransferQueue service.

Every error a server reports crosses the wire as ``{"type": <class name>, "message": ...}`` and is
re-raised on the client as the class of that name from this module (looked up in a fixed table, never
evaluated), so callers can catch precise types.
"""

from __future__ import annotations


class TQError(Exception):
    """Base class of every TransferQueue error."""


class TQTimeoutError(TQError, TimeoutError):
    """A request or a wait did not complete within its timeout."""


class TQConnectionError(TQError, ConnectionError):
    """A server did not answer (down, unreachable or not yet started)."""


class PartitionNotFoundError(TQError, KeyError):
    """The partition id is not registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PartitionExistsError(TQError):
    """The partition id is already registered (pass ``reuse=True`` to clear and reuse it)."""


class KeyNotFoundError(TQError, KeyError):
    """A sample key is not registered in the partition."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateKeyError(TQError):
    """A key given as new already exists, or a batch names the same key twice."""


class FieldNotProducedError(TQError):
    """A field asked for has not been produced for some of the keys."""


class SchemaConflictError(TQError):
    """A column's kind, dtype or trailing shape disagrees with the partition's schema for that field,
    or a field is written twice for the same key."""


class InvalidRequestError(TQError, ValueError):
    """A request is well-formed on the wire but its arguments are wrong."""


class MalformedMessageError(TQError):
    """A message could not be decoded (not msgpack, missing parts, wrong frame count or sizes)."""


class MessageTooLargeError(TQError):
    """A message or a declared size exceeds the server's limit."""


class ProtocolVersionError(TQError):
    """The peer speaks another protocol version."""


class AuthenticationError(TQError):
    """The request's signature is missing or wrong for the server's secret."""


class ReplayError(AuthenticationError):
    """A correctly signed request that is not fresh: already seen from its sender, or its timestamp is
    outside the server's window (a replay, or clocks out of sync)."""


class UnknownOperationError(TQError):
    """The server has no such operation."""


class CapacityError(TQError):
    """A storage unit has no room left in its byte budget."""


class StorageUnitError(TQError):
    """A storage unit failed to serve data (e.g. it holds no such block)."""


class FencedCommitError(TQError):
    """A commit named a stored block the controller had already reclaimed (its put timed out or was
    refused): nothing was made visible, and nothing will be - the put did not land."""


class ForkedClientError(TQError, RuntimeError):
    """A :class:`~tq.TQClient` was used in a process forked from the one that opened it (a DataLoader
    worker, a ``multiprocessing`` child): its sockets, slabs and leases belong to that process. Open a
    client in the child (``TQConnection.connect()``; a ``TQConnection`` pickles)."""


class JournalError(TQError):
    """The controller could not journal a change (e.g. its disk is full), so it did not make the change
    and stopped: restarted on the same journal dir it recovers every change journaled before."""


# The wire names clients may re-raise; anything else becomes a plain TQError.
ERROR_TYPES: dict[str, type[TQError]] = {
    cls.__name__: cls
    for cls in (
        TQError,
        TQTimeoutError,
        TQConnectionError,
        PartitionNotFoundError,
        PartitionExistsError,
        KeyNotFoundError,
        DuplicateKeyError,
        FieldNotProducedError,
        SchemaConflictError,
        InvalidRequestError,
        MalformedMessageError,
        MessageTooLargeError,
        ProtocolVersionError,
        AuthenticationError,
        ReplayError,
        UnknownOperationError,
        CapacityError,
        StorageUnitError,
        FencedCommitError,
        JournalError,
    )
}

__all__ = [*ERROR_TYPES, "ERROR_TYPES"]
