"""meshplan: plan and run one ONNX model on many devices."""

__version__ = "0.1.0"
