"""A scientist's model as the original Nomad hosts it: a `TorchModuleTool` subclass over a tiny
torch network whose fixed weights are read from the model directory.

Inputs whose first value is a marker exercise the model host's fault handling:
  55  the batch takes 0.5 s (so that later calls queue behind it and form a full batch),
  77  a batch of more than 4 runs out of memory (torch.OutOfMemoryError),
  -99 this input raises ValueError,
  -66 the process dies (os._exit(3)) unless the file named by TOY_SCIFM_ONCE exists, which it
      creates first: the first host dies, the one started after it answers,
  -77 the process always dies (os._exit(3)),
  88  each input of the batch takes 40 GiB of device memory for a moment (a real allocation: on a
      GPU, a batch beyond its memory raises torch.OutOfMemoryError).
"""

import json
import os
import time

import torch
from pydantic import BaseModel, Field

from nomad.fm_base_tool import TorchModuleTool

try:  # Spans of the model's own, where its environment has OpenTelemetry.
    from opentelemetry import trace

    tracer = trace.get_tracer("toy_scifm")
except ImportError:
    tracer = None


class PointIn(BaseModel):
    values: list[float] = Field(description="Four features of one point.", min_length=4, max_length=4)
    steps: int = Field(1, ge=1, le=8, description="How many times the map is applied.")


class PointOut(BaseModel):
    prediction: list[float]
    norm: float


class TinyMap(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(weight))
            self.layer.bias.copy_(torch.tensor(bias))

    def forward(self, x, steps):
        for step in range(int(steps.max())):
            # Each row stops after its own number of steps.
            active = (steps > step).unsqueeze(1)
            x = torch.where(active, torch.tanh(self.layer(x)), x)
        return x


class ToySurrogate(TorchModuleTool[PointIn, PointOut, tuple, torch.Tensor]):
    description: str = "A tiny surrogate: maps four features through a fixed tanh layer, `steps` times."
    args_schema: type[PointIn] = PointIn
    output_schema: type[PointOut] = PointOut
    batch_size: int = 8

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        with open(os.path.join(pretrained_model_name_or_path, "weights.json")) as f:
            weights = json.load(f)
        return cls(fm=TinyMap(weights["weight"], weights["bias"]))

    def preprocess(self, batch):
        firsts = [args.values[0] for args in batch]
        if 55 in firsts:
            time.sleep(0.5)
        if 77 in firsts and len(batch) > 4:
            raise torch.OutOfMemoryError(f"simulated CUDA out of memory: a batch of {len(batch)} is over 4")
        if -99 in firsts:
            raise ValueError("the value -99 is out of this model's domain")
        if -77 in firsts:
            os._exit(3)
        if 88 in firsts:
            held = torch.empty(len(batch) * (40 << 30), dtype=torch.uint8, device=self.device)
            del held
        if -66 in firsts:
            once = os.environ["TOY_SCIFM_ONCE"]
            if not os.path.exists(once):
                open(once, "w").close()
                os._exit(3)
        print(f"toy_scifm: a batch of {len(batch)}", flush=True)
        x = torch.tensor([args.values for args in batch], dtype=torch.float32, device=self.device)
        steps = torch.tensor([args.steps for args in batch], device=self.device)
        return x, steps

    def _forward(self, model_input):
        x, steps = model_input
        if tracer is None:
            return self.fm(x, steps).to("cpu")
        with tracer.start_as_current_span("toy_scifm.forward") as span:
            span.set_attribute("toy_scifm.batch", int(x.shape[0]))
            return self.fm(x, steps).to("cpu")

    def postprocess(self, model_output):
        for row in model_output:
            yield PointOut(prediction=row.tolist(), norm=float(row.norm()))
