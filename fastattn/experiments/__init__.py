"""One module per notebook: the experiments that exist for one notebook, tested once (riemann_book's split).

The library modules keep only what a user of the library calls; these modules hold the
notebook-specific demonstrations, each named after its notebook:

* :mod:`.backend_selection` (02): the seed's claims, checked one by one on this device;
* :mod:`.causality` (03): exactness sweeps, the calibration ladder, the padded batch, stale NaN;
* :mod:`.patch_application` (04): whole decodes against upstream, the ``torch.compile`` trap;
* :mod:`.profiling` (05): the notebook's headline findings from its records.
"""
