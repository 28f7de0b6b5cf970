"""What exactly one notebook needs and no library user calls: :mod:`.backend_selection` (02), :mod:`.causality`
(03), :mod:`.patch_application` (04), :mod:`.profiling` (05)."""
