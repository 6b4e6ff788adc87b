"""engc.LLM: offline batch generation from a bundle, for scripts and notebooks."""
from __future__ import annotations

from dataclasses import dataclass

from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.tp import load_rank
from engc.runtime.sampling import SamplingParams


@dataclass
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str


class LLM:
    """A bundle loaded for batch generation. device: "auto" (the GPU when there is one, as the CLI),
    "cuda" or "cpu". generate's default SamplingParams sample at temperature 1.0, as the OpenAI API
    does; pass SamplingParams(temperature=0) for greedy, reproducible answers. A tensor-parallel bundle
    starts its other ranks' processes here (tp: checked against the bundle's; under torchrun every
    process makes the LLM and the ranks but 0 serve as workers, then exit); close() stops them."""

    def __init__(self, bundle: str, device: str = "auto", engine: EngineConfig = EngineConfig(),
                 tp: int | None = None):
        self.model = load_rank(str(bundle), device, tp)
        self.engine = Engine(self.model, engine)
        self.tokenizer = self.model.tokenizer

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None,
                 chat: bool = False) -> list[Completion]:
        """All prompts run as one continuously batched workload; results keep the prompts' order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        seqs = [self.engine.add_request(self.encode(p, chat), params) for p in prompts]
        self.engine.run_to_completion()
        return [Completion(p, s.output_text, list(s.output_ids), len(s.prompt_ids), s.finish_reason)
                for p, s in zip(prompts, seqs)]

    def close(self) -> None:
        """Stops a tensor-parallel bundle's worker processes (also done at exit)."""
        if self.model.tp is not None:
            self.model.tp.close()

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)
