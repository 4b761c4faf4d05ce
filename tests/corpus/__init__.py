"""The docstring examples of lifted transforms, run through the bridge; docs/coverage.md."""
