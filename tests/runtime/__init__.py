"""Tests of fastattn's runtime (the package's top level)."""
