"""Tests of fastattn.lab, tools/ and scripts/: what measures, judges, reports and generates."""
