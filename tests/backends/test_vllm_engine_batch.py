"""The engine tests of tests/backends/test_vllm.py (behaviour log-probs, seeds, top-k, stop
strings, prefix continuation, the `driver` and data-plane weight syncs) run again on the
fixed-batch mode, ``serving="batch"`` (``vllm.LLM``); test_vllm.py itself runs them on the
default, request mode (``AsyncLLM``). Same tests, same tolerances, one engine for the module
(the session's batch engine, tests/backends/conftest.py)."""

from __future__ import annotations

import pytest

from tests.backends import test_vllm as base

model_dir = base.model_dir
hf = base.hf


@pytest.fixture(scope="module")
def engine(vllm_batch):
    """The session's batch-mode engine (tests/backends/conftest.py, ``vllm.LLM``), which also
    gives test_vllm_engine.py its reference outputs: one engine start instead of two."""
    return vllm_batch


test_behaviour_logprobs_equal_transformers = base.test_behaviour_logprobs_equal_transformers
test_seeded_requests_repeat_whatever_the_batch = base.test_seeded_requests_repeat_whatever_the_batch
test_top_k_one_is_greedy_with_log_prob_zero = base.test_top_k_one_is_greedy_with_log_prob_zero
test_stop_string_ends_the_response = base.test_stop_string_ends_the_response
test_prefix_continuation_is_token_exact = base.test_prefix_continuation_is_token_exact
test_weight_sync_is_in_place_and_exact = base.test_weight_sync_is_in_place_and_exact
test_data_plane_sync_into_the_engine_is_bitwise = (
    base.test_data_plane_sync_into_the_engine_is_bitwise
)
