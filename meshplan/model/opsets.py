"""The ONNX opset meshplan assumes for a model that names none, and builds its own
models (probes, timing and transfer kernels) with."""

DEFAULT_OPSET = 17
