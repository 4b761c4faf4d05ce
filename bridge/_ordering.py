"""Recording the DLPack route's ordering steps, so that tests check them without a GPU.

The DLPack route (``_exchange.py``) hands JAX and torch ``Observed`` wrappers instead of
the tensors and arrays themselves, on every call; while a ``record_ordering`` block is
open (``recorders`` is not empty) each step is recorded from inside the ``__dlpack__``
call that does it, with the stream the consumer passed, so a step that does not happen (a
fence imported once and reused, an import without a stream) is missing from the log
rather than logged anyway. The path is the same with and without a block open.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


class OrderingEvent(NamedTuple):
    """One ordering step of the DLPack route, as ``record_ordering`` sees it.

    Attributes:
        kind: ``"torch->jax"``: the fence's export to JAX, once per program run (JAX's
            stream then waits for everything torch queued on ``stream``); ``"import"``:
            an argument or cotangent imported for one call (an ordering of its own);
            ``"run"``: a program is dispatched; ``"jax->torch"``: a program's results
            exported to torch (torch's ``stream`` then waits for them).
        device: the torch device the program runs on.
        stream: the torch stream ordered: for ``"torch->jax"`` and ``"import"`` torch's
            current CUDA stream at the export, which torch's ``__dlpack__`` orders before
            the consumer's; for ``"jax->torch"`` the stream torch passed to JAX's
            ``__dlpack__``; ``None`` on CPU and for ``"run"``.
        detail: ``"torch->jax"`` / ``"import"``: ``(consumer stream, data pointer)``, the
            stream JAX passed to ``__dlpack__`` and the memory it imports; ``"run"``: the
            program's name; ``"jax->torch"``: the memory handed to torch, as ``(data
            pointer, bytes)`` per tensor.
    """

    kind: str
    device: torch.device
    stream: int | None = None
    detail: object = None


recorders: list[list] = []


@contextlib.contextmanager
def record_ordering():
    """Records the ordering steps every DLPack-route call takes, in order.

    With ``FLAXTORCH_EXCHANGE=dlpack`` a CPU run makes exactly the calls a CUDA run makes,
    so a test can check, without a GPU, that each program run imports its fence once,
    after torch's writes and before JAX reads, and that its results are handed back to
    torch's stream before torch touches them. Yields the list of ``OrderingEvent``s; a
    test may append markers of its own to it.

    Example:
        >>> with record_ordering() as log:
        ...     pass
        >>> log
        []
    """
    log: list = []
    recorders.append(log)
    try:
        yield log
    finally:
        recorders.remove(log)


def current_stream(device: torch.device) -> int | None:
    """The current CUDA stream of torch on ``device``, as DLPack names it (``None`` on CPU).

    The legacy default stream, whose handle is 0, is 1 in DLPack's ``stream=`` (0 is not a
    valid value there): the number ``torch.from_dlpack`` passes to a producer's ``__dlpack__``.
    """
    if device.type != "cuda":
        return None
    handle = torch.cuda.current_stream(device).cuda_stream
    return 1 if handle == 0 and torch.version.hip is None else handle
