"""Recording the DLPack route's ordering steps, so that tests check them without a GPU.

``DlpackExchange.run`` (``_exchange.py``) records each step only while a
``record_ordering`` block is open (``recorders`` is not empty); otherwise no code here runs.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


class OrderingEvent(NamedTuple):
    """One ordering step of the DLPack route, as ``record_ordering`` sees it.

    Attributes:
        kind: ``"torch->jax"``: JAX's stream now waits for everything torch has queued on
            its current stream (the fence); ``"run"``: a program is dispatched;
            ``"jax->torch"``: torch's current stream now waits for the program's results.
        device: the torch device the program runs on.
        stream: torch's current CUDA stream (``cuda_stream``) at that step; ``None`` on CPU.
        detail: for ``"run"`` the program's name, for ``"jax->torch"`` the memory handed to
            torch, as ``(data pointer, bytes)`` per tensor.
    """

    kind: str
    device: torch.device
    stream: int | None = None
    detail: object = None


recorders: list[list] = []


@contextlib.contextmanager
def record_ordering():
    """Records the ordering steps every DLPack-route ``run`` takes, in order.

    With ``FLAXTORCH_EXCHANGE=dlpack`` a CPU run makes exactly the calls a CUDA run makes,
    so a test can check, without a GPU, that each program run is fenced once, after
    torch's writes and before JAX reads, and that its results are handed back to torch's
    stream before torch touches them. Yields the list of ``OrderingEvent``s; a test may
    append markers of its own to it.

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


def record(kind: str, device: torch.device, detail=None) -> None:
    """Appends one step to every open ``record_ordering`` log (``recorders``)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    event = OrderingEvent(kind, device, stream, detail)
    for log in recorders:
        log.append(event)
