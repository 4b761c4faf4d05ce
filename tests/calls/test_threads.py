"""Threads calling one module at once share its compiled programs and get right gradients."""

import threading

import torch

from tests.support import pipeline
from tests.support.twins import residual_block_module


def test_threads_share_the_cache_and_get_correct_gradients():
    m = residual_block_module()
    batches = [torch.randn(b, 8) for b in (2, 3, 2, 3, 4, 2, 4, 3)]
    params = list(m.parameters())

    def grads(x):
        y = m(x)
        return torch.autograd.grad((y * y).sum(), params)

    expected = [grads(x) for x in batches]
    results = [None] * len(batches)
    errors = []

    def work(i):
        try:
            for _ in range(5):
                results[i] = grads(batches[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert len(pipeline.entries(m)) == 3  # one program per batch size, shared by all threads
