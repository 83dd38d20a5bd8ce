"""Tests for the Triton kernels in ``kernels/`` (CPU through Triton's interpreter)."""
