"""The first-order call pipeline (NOTE [Call path] in ``_call.py``): resolve, build, run."""
