"""Fixtures of the trainer tests."""

import socket

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone, destroyed after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
