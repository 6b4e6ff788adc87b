"""engc quantize: AWQ, GPTQ and RTN int4 quantization, one decoder layer at a time.

rtn.py holds the asymmetric uint4 group math every method shares; awq.py and gptq.py decide what the
weights are before that math runs; layer.py is a plain-torch decoder layer for calibration; stream.py
walks the checkpoint layer by layer; formats.py writes the AutoAWQ GEMM and GPTQ checkpoint layouts.
"""
from engc.compiler.quantize.options import METHODS, QuantOptions

__all__ = ["METHODS", "QuantOptions"]
