"""MXFP4 (compressed-tensors ``mxfp4-pack-quantized``): the numpy/torch ``codec`` beside the ``triton`` decoder.

Imports nothing: the converter's worker processes import ``codec`` without loading torch.
"""
