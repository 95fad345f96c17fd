"""A model in TorchModuleTool's shape without the base class, pydantic or torch: numpy only, its
schemas plain JSON Schema. And a plain function."""

import os

import numpy as np


class Spectrum:
    """The power spectrum of a windowed signal (the window is the model's weights)."""

    description = "Power spectrum of a signal of 8 samples, windowed by the model's own window."
    args_schema = {
        "type": "object",
        "properties": {"signal": {"type": "array", "items": {"type": "number"}, "minItems": 8, "maxItems": 8}},
        "required": ["signal"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {"power": {"type": "array", "items": {"type": "number"}}},
    }
    batch_size = 4

    def __init__(self, window):
        self.window = window

    @classmethod
    def from_pretrained(cls, path):
        return cls(np.loadtxt(os.path.join(path, "window.txt")))

    def preprocess(self, batch):
        for item in batch:
            if len(item["signal"]) != len(self.window):
                raise ValueError(f"a signal has {len(item['signal'])} samples; this model takes {len(self.window)}")
        return np.array([item["signal"] for item in batch], dtype=np.float64) * self.window

    def _forward(self, x):
        return np.abs(np.fft.rfft(x, axis=1)) ** 2

    def postprocess(self, y):
        return [{"power": row} for row in y]


def dot(a: list[float], b: list[float]) -> float:
    """The dot product of two vectors of the same length."""
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} and {len(b)}")
    return float(np.dot(a, b))
