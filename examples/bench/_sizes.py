"""The benchmark's sizes: ``full`` (the docs' run), ``quick`` and ``smoke`` (the tests').

Every part of ``benchmark.py`` reads its shapes, budgets and repeats from one entry.
"""

SIZES = {
    # medium_width; deep = (depth, width, batch); leaves = depth of the unrolled stack;
    # depths of the sweep; budget = seconds of timed calls per workload (rounds fill it);
    # sync_row = also measure TINY with synchronous JAX CPU dispatch (child process);
    # leaf_counts = parameter leaves of the leaf-count sweep, at a fixed total size;
    # shard = the block trained over 2 processes: remat_scan lengths, width, batch per rank
    # (its rounds: min_repeats).
    "full": dict(
        medium_width=512,
        deep=(128, 128, 64),
        leaves=128,
        depths=(16, 64, 256, 1024),
        budget=4.0,
        min_repeats=7,
        warmup=2,
        sweep_repeats=5,
        sync_row=True,
        leaf_counts=(1, 4, 16, 64, 256, 1024, 4096),
        shard=dict(lengths=(4, 4), width=256, batch=64),
    ),
    "quick": dict(
        medium_width=256,
        deep=(128, 128, 64),
        leaves=32,
        depths=(16, 1024),
        budget=0.4,
        min_repeats=3,
        warmup=1,
        sweep_repeats=1,
        sync_row=False,
        leaf_counts=(1, 64, 1024),
        shard=dict(lengths=(4, 2), width=256, batch=32),
    ),
    "smoke": dict(
        medium_width=32,
        deep=(8, 16, 4),
        leaves=4,
        depths=(4, 16),
        budget=0.05,
        min_repeats=2,
        warmup=1,
        sweep_repeats=1,
        sync_row=True,
        leaf_counts=(1, 4),
        shard=dict(lengths=(2, 2), width=16, batch=4),
    ),
}
