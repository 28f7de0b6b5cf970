"""The repository's own tools, outside the package the notebooks import: the generator of README's findings,
docs/results.md and the upstream PR texts (``make docs`` runs it through scripts/docs.py), and ``ingest``, which
reads a maintainer's bench JSON back as a row of them."""
