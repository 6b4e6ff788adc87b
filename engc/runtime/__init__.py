"""The runtime: loads a bundle and serves it. Imports neither the compiler, nor triton, nor transformers."""
