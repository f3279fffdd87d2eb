"""The hand-written protobuf codec of `roll serve` against the client's own generated messages
(tinker's ``tinker_public_pb2``): what the client sends decodes, what the server sends parses
to the same values."""

from __future__ import annotations

import numpy as np
import pytest

from roll_core.serve import wire

pb = pytest.importorskip(
    "tinker.proto.tinker_public_pb2", reason="the tinker client is not installed"
)
conv = pytest.importorskip("tinker.proto.request_conv")
resp = pytest.importorskip("tinker.proto.response_conv")
types = pytest.importorskip("tinker.types")


def test_forward_backward_request_decodes() -> None:
    weights = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]], dtype=np.float32)
    sparse = types.TensorData.from_numpy(weights)
    req = types.ForwardBackwardRequest(
        model_id="s:train:0",
        seq_id=7,
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2, 300000]),
                    loss_fn_inputs={
                        "target_tokens": np.array([2, 300000, 4], dtype=np.int64),
                        "advantages": np.array([0.5, -1.5, 2.0], dtype=np.float32),
                    },
                ),
                types.Datum(
                    model_input=types.ModelInput(
                        chunks=[
                            types.EncodedTextChunk(tokens=[9]),
                            types.EncodedTextChunk(tokens=[8]),
                        ]
                    ),
                    loss_fn_inputs={"weights": sparse},
                ),
            ],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        ),
    )
    msg = conv.forward_backward_request_to_proto(req)
    msg.forward_only = True
    got = wire.read_forward_backward(msg.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == (
        "s:train:0",
        7,
        "ppo",
        True,
    )
    assert got.loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    )
    assert got.data[0].tokens == [1, 2, 300000]
    assert got.data[0].inputs["target_tokens"].tolist() == [2, 300000, 4]
    assert got.data[0].inputs["advantages"].tolist() == [0.5, -1.5, 2.0]
    assert got.data[1].tokens == [9, 8]
    np.testing.assert_array_equal(got.data[1].inputs["weights"], weights)


def test_sparse_tensor_decodes_dense() -> None:
    dense = np.array([[0, 0, 3], [4, 0, 0]], dtype=np.int64)
    td = types.TensorData.from_torch_sparse(__import__("torch").tensor(dense))
    msg = conv._tensor_data_to_proto(td)
    np.testing.assert_array_equal(wire.read_tensor(msg.SerializeToString()), dense)


def test_outputs_parse_in_the_client() -> None:
    body = wire.forward_backward_output(
        [
            {"logprobs": np.array([-1.0, -2.0]), "elementwise_loss": np.array([1.0, 2.0])},
            {"logprobs": np.array([-0.5]), "elementwise_loss": np.array([0.5])},
        ],
        {"loss:sum": 3.5},
    )
    out = resp.deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 3.5}
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [0.5]

    seqs = [wire.Sequence([4, 5], [-0.25, -0.5], "stop"), wire.Sequence([6], [-1.0], "length")]
    sample = resp.deserialize_sample_response(wire.sample_response(seqs, [float("nan"), -3.0]))
    assert [s.tokens for s in sample.sequences] == [[4, 5], [6]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].logprobs == [-0.25, -0.5]
    assert sample.prompt_logprobs == [None, -3.0]


def test_garbage_is_a_wire_error() -> None:
    with pytest.raises(wire.WireError):
        wire.read_forward_backward(b"\x0a\xff\xff")
