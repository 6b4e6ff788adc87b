"""engc: an ahead-of-time compiler for LLM inference engines, and the thin runtime that serves them."""
__version__ = "0.1.0"


def __getattr__(name):
    # Keep `import engc` cheap: the runtime loads torch only when the API is used.
    if name == "LLM":
        from engc.llm import LLM
        return LLM
    if name == "SamplingParams":
        from engc.runtime.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
