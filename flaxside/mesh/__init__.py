"""Programs over a mesh of processes: ``OnMesh``, packed and per-rank scans and stacks."""
