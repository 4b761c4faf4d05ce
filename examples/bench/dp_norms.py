"""Per-sample gradient norms of the DP-SGD rows' Flax block: summed where made, or after.

The figures quoted for NOTE [Summed squares] and NOTE [Ghost norms]
(``flaxside/derivatives/_summed_squares.py``): for the Flax part of ``_dp.py``'s model (an
``nn.remat_scan`` trunk and a ``Dense`` head), the per-sample norms program as Opacus's
norm sampler builds it (``summed_squares`` of the batched VJP, each layer's kernel summed
from its Grams), the same without the Grams (each product formed and summed where made),
and the same VJP's per-sample gradients reduced after the fact (every one stored as XLA
temporaries). Prints each program's temporaries and median time, and
the largest relative difference of their sums.

How to run:
    python examples/bench/dp_norms.py            # the benchmark's full size
    python examples/bench/dp_norms.py --smoke    # tiny, to check it runs
"""

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _dp import CLASSES, SHAPES, Head  # noqa: E402

from flaxside.derivatives._functions import _moved_axes  # noqa: E402
from flaxside.derivatives._summed_squares import squares, summed_squares  # noqa: E402


def _median_ms(f, args, repeats: int = 9) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    _, width, lengths, batch = SHAPES["smoke" if args.smoke else "full"]
    head = Head(width, lengths, CLASSES)
    k = jax.random.split(jax.random.key(0), 3)
    params = jax.jit(head.init)(k[0], jnp.zeros((1, width)))
    x = jax.random.normal(k[1], (batch, width))
    c = jax.random.normal(k[2], (batch, CLASSES))

    def one(p, x, c):
        _, vjp = jax.vjp(lambda p: head.apply(p, x[None]), p)
        return jax.tree_util.tree_leaves(vjp(c[None])[0])

    axes = _moved_axes(jax.make_jaxpr(jax.vmap(one, in_axes=(None, 0, 0)))(
        params, x[:2], c[:2]).jaxpr)
    grads = jax.vmap(one, in_axes=(None, 0, 0), out_axes=list(axes))
    stored = sum(a.size * a.dtype.itemsize for a in jax.eval_shape(grads, params, x, c))
    ways = {"ghost norms": jax.jit(lambda *a: summed_squares(grads, list(a), axes)[0]),
            "summed where made": jax.jit(lambda *a: summed_squares(grads, list(a), axes,
                                                                   ghost=False)[0]),
            "reduced after": jax.jit(lambda *a: [squares(g, ax) for g, ax in
                                                 zip(grads(*a), axes, strict=True)])}
    print(f"nn.remat_scan{lengths}, width {width}, batch {batch}: per-sample gradients "
          f"{stored / 2**20:.2f} MiB")
    sums = {}
    for name, f in ways.items():
        temp = f.lower(params, x, c).compile().memory_analysis().temp_size_in_bytes
        ms = _median_ms(f, (params, x, c))
        sums[name] = f(params, x, c)
        print(f"  {name:18s} temporaries {temp / 2**20:8.2f} MiB   {ms:7.1f} ms")
    after = sums["reduced after"]
    for name in ("ghost norms", "summed where made"):
        worst = max(float(jnp.max(jnp.abs(a - b) / jnp.abs(b)))
                    for a, b in zip(sums[name], after, strict=True))
        print(f"  {name}: largest relative difference from the sums after: {worst:.1e}")


if __name__ == "__main__":
    main()
