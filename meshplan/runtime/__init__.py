"""Running a plan: per-rank programs in onnxruntime, boundary tensors over MPI or in memory."""
