"""The Tinker wire formats the server reads and writes besides JSON.

The SDK (`tinker` 0.38) sends `forward_backward` as a protobuf `ForwardBackwardRequest` and asks
for `ForwardBackwardOutput` and `SampleResponse` results as protobuf (`Accept:
application/x-protobuf`); everything else is JSON. The message classes come from the SDK's own
generated module (`tinker.proto.tinker_public_pb2`: the schema, not server code), so the server
and the SDK cannot disagree about field numbers.

Tensors: a `Tensor` is dense little-endian bytes plus a shape, or sparse CSR (2-D); a
`BatchedTensor` packs one array per datum into one buffer with byte `offsets` (n + 1 int64) and
the per-datum `trailing_shape` (the leading axis is implied by each slice's size).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_PB = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64,
       np.dtype(np.int32): pb.DTYPE_INT32}
STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A request the server cannot decode (the client's fault: reported as a user error)."""


@dataclasses.dataclass
class Datum:
    tokens: np.ndarray  # int32 [T]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs by name, dense
    # provenance (`Datum.with_provenance`): (model_input runs, target_tokens runs), each run
    # (kind "prompt" | "sampled", sequence_id, offset, length); None when not sent
    spans: tuple[list, list] | None = None


@dataclasses.dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def tensor_to_numpy(msg: pb.Tensor, what: str) -> np.ndarray:
    if msg.dtype not in _NP:
        raise WireError(f"{what}: unsupported tensor dtype {msg.dtype}")
    dt = _NP[msg.dtype]
    shape = tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"{what}: a sparse CSR tensor must be 2-D, got shape {list(shape)}")
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dt)
        crow = np.frombuffer(csr.crow_indices, np.int64)
        col = np.frombuffer(csr.col_indices, np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{what}: inconsistent sparse CSR indices for shape {list(shape)}")
        out = np.zeros(shape, dt)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    flat = np.frombuffer(msg.dense, dt)
    if shape and int(np.prod(shape)) != flat.size:
        raise WireError(f"{what}: {flat.size} values do not fill shape {list(shape)}")
    return flat.reshape(shape) if shape else flat


def parse_forward_backward(body: bytes, forward_only_default: bool = False
                           ) -> ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})") from e
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: model input chunks of type {kind!r} are not "
                                "supported (token chunks only)")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        tokens = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
        inputs = {k: tensor_to_numpy(v, f"datum {i} {k}") for k, v in d.loss_fn_inputs.items()}
        spans = None
        if len(d.model_input_spans) or len(d.loss_fn_input_spans):
            spans = (_spans(d.model_input_spans), _spans(d.loss_fn_input_spans))
        data.append(Datum(tokens=tokens, inputs=inputs, spans=spans))
    return ForwardBackwardRequest(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn,
                                  config=config, forward_only=msg.forward_only or
                                  forward_only_default, data=data)


def _spans(msgs) -> list[tuple[str, str, int, int]]:
    """Provenance runs as (kind, sequence_id, offset, length); kind "prompt" or "sampled"."""
    out = []
    for m in msgs:
        arm = m.WhichOneof("span")
        if arm is None:
            raise WireError("a provenance span is neither prompt_tokens nor sampled_tokens")
        run = getattr(m, arm)
        out.append(("sampled" if arm == "sampled_tokens" else "prompt", run.sequence_id,
                    int(run.offset), int(run.length)))
    return out


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    dt = np.dtype(arrays[0].dtype)
    bt = pb.BatchedTensor(dtype=_PB[dt], trailing_shape=list(arrays[0].shape[1:]))
    sizes = [a.nbytes for a in arrays]
    bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tobytes()
    bt.data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return bt


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]],
                                   metrics: dict[str, float]) -> bytes:
    """`outputs[i]`: datum i's arrays by field name (the same fields for every datum)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    if outputs:
        rec = msg.loss_fn_outputs.add(num_datums=len(outputs))
        for name in outputs[0]:
            rec.fields[name].CopyFrom(_batched([o[name] for o in outputs]))
    return msg.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: np.ndarray | None = None) -> bytes:
    """`sequences`: (tokens, logprobs, stop reason "stop" | "length") per sample."""
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        msg.sequences.add(stop_reason=STOP_REASONS[reason],
                          tokens=np.asarray(tokens, np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
