"""Encoding the engine's messages for the wire: msgpack through msgspec, typed on decode.

msgspec encodes a ``msgspec.Struct`` (and a dataclass such as :class:`~minillm.sampling_params.SamplingParams`)
straight to msgpack bytes, and decodes them back into the declared type, checking every field's type as it goes. So
a message that arrives is either the right object or a ``msgspec.ValidationError`` that names the bad field; no
``pickle`` of arbitrary objects crosses the process boundary.

vLLM counterpart: ``vllm/v1/serial_utils.py`` (``MsgpackEncoder``, ``MsgpackDecoder``), which adds zero-copy
tensor frames for multimodal inputs; the messages here carry only ints, floats and strings.
"""
from __future__ import annotations

from typing import Any

import msgspec


class MsgpackEncoder:
    """Encodes messages to msgpack bytes (one reusable encoder: msgspec keeps its buffers)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Decodes msgpack bytes into ``t`` (a Struct, a dataclass, a list of them, or ``Any`` for plain values)."""

    def __init__(self, t: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(t)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)
