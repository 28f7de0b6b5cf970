"""fastattn.clock, the one timing loop: interleaved rounds (CUDA events on CUDA) and the rotation of long runs."""

from fastattn import clock


def test_the_timing_loop_on_cuda_reads_one_reused_event_pair(monkeypatch):
    """clock.interleaved's CUDA branch, fed fake events on CPU: each sample is the time between its pair's
    records, and one pair serves every sample (no event made inside a timed call)."""
    made = []

    class Event:
        now = [0.0]

        def __init__(self, enable_timing=True):
            made.append(self)

        def record(self):
            Event.now[0] += 2.0
            self.t = Event.now[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(clock.torch.cuda, "Event", Event)
    monkeypatch.setattr(clock.torch.cuda, "synchronize", lambda *device: None)
    out = clock.interleaved({"a": lambda: None, "b": lambda: None}, repeats=3, warmup=1, device="cuda")
    assert out == {"a": [0.002] * 3, "b": [0.002] * 3} and len(made) == 2
    assert clock.elapsed_s(1.0, 3.5) == 2.5  # host stamps: perf_counter floats


def test_long_runs_rotate_so_each_variant_leads_in_turn():
    """Whole decodes, streams and the consumer study alternate by :func:`clock.rotated`: A B, B A for two."""
    assert [clock.rotated(["up", "pa"], r) for r in range(4)] == [["up", "pa"], ["pa", "up"]] * 2
    assert [clock.rotated("abc", r) for r in range(3)] == [list("abc"), list("bca"), list("cab")]
    assert clock.rotated((False, True), 1) == [True, False]
