"""Stand-in for ``sglang.srt.utils.common.MultiprocessingSerializer`` (ForkingPickler, as SGLang's)."""

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        if output_str:
            raise NotImplementedError("the fake serializes to bytes only")
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        return buf.getvalue()

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)
