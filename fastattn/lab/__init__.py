"""fastattn's lab: what the workbook measures, judges and reports with; the runtime never imports it.

Layers, bottom up: measurement (``bench/``: records, timing, sweeps, targets); one module per notebook for 02-04
(``experiments/``); the readings a notebook and the report share (``diagnosis`` for 01, ``profiling`` for 05,
``claims``); reports and running on top (``report``, ``workbook``, ``runner``, ``budget``, ``gpucheck``, ``doctor``,
``upstream``). ``paths`` knows where the checkout's files are; ``tables`` and ``plots`` draw."""
