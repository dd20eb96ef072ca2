"""Files and other tools' formats: checkpoints, PyTorch twins, ONNX, safetensors, memory_viz
snapshots.
"""
