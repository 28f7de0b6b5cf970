import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def pytest_configure(config):
    torch.manual_seed(0)
