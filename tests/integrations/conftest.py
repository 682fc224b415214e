"""What the tiny-model generate() tests share (test_transformers.py and test_sessions.py ask for it by name)."""

import warnings

import pytest
import torch


@pytest.fixture
def quiet_and_single_threaded():
    """One torch thread (tiny models: threads only contend on a shared CPU, 10x slower here) and transformers'
    FutureWarning about generate's arguments silenced (5.24 renames its past_key_values to cache)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    torch.set_num_threads(threads)
