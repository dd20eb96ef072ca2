"""Deep Compression (Han, Mao and Dally, ICLR 2016): pruning, trained quantization and
Huffman coding of a trained network, a compressed model file, and inference from it.

    from minidl.compression import CompressionSettings, deep_compress, read, CompressedRunner
    result = deep_compress(net, dataset, {"name": "lenet5", "input_shape": [1, 28, 28],
                                          "num_classes": 10, "width": None},
                           CompressionSettings(prune="conv=0.6,fc=0.92", bits="conv=8,fc=5"),
                           out="lenet5.mdc")
    print(result.table())
    logits = CompressedRunner(read("lenet5.mdc")).predict(x)
"""

from .container import CompressedModel, CompressedModelError, read, write
from .inference import CompressedRunner, plan_inference
from .pipeline import (
    CompressionResult,
    CompressionSettings,
    Retraining,
    RetrainOptimizer,
    deep_compress,
)

__all__ = ["CompressedModel", "CompressedModelError", "CompressedRunner", "CompressionResult",
           "CompressionSettings", "RetrainOptimizer", "Retraining", "deep_compress",
           "plan_inference", "read", "write"]
