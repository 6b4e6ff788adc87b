"""gpu_bench's correctness check: the GPU engine against the reference ops on the same weights (greedy tokens
and one prefill's logits), and, where a float32 copy of the weights fits, both against a float32 oracle."""
from __future__ import annotations

from shapes import prompts, weight_bytes


def check_against_reference(model, engine, cfg) -> dict:
    import torch
    from engc.runtime.executor import Executor
    from engc.runtime.ops_reference import REFERENCE_OPS
    from engc.runtime.sampling import SamplingParams
    ref_exec = Executor(model.executor.program, model.executor.weights, REFERENCE_OPS)
    ids_list = prompts(2, 40, cfg.vocab_size, 11)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(ids, p) for ids in ids_list]
    engine.run_to_completion()
    # the reference engine: same weights, plain-torch ops on the GPU, no graphs
    ref_engine = type(engine)(model.__class__(**{**model.__dict__, "executor": ref_exec, "step_facts": None}),
                              engine.config.__class__(num_blocks=64, cuda_graphs=False))
    ref_engine.runner.executor = _Eager(ref_exec, model.device)
    ref_seqs = [ref_engine.add_request(ids, p) for ids in ids_list]
    ref_engine.run_to_completion()
    agree = [sum(a == b for a, b in zip(s.output_ids, r.output_ids)) / 16 for s, r in zip(seqs, ref_seqs)]
    firsts = [(s.output_ids[:6], r.output_ids[:6]) for s, r in zip(seqs, ref_seqs)]
    inputs = _prefill_inputs(torch.tensor(ids_list[0]))
    with torch.inference_mode():
        a = engine.runner.executor.forward(inputs, [_small_cache(t) for t in engine.kv.layers])
        b = _Eager(ref_exec, model.device).forward(inputs, [_small_cache(t) for t in engine.kv.layers])
    res = {"greedy_token_agreement_vs_bf16_reference": agree, "first_tokens_engine_vs_reference": firsts,
           "prefill_logits_max_rel_err_vs_bf16_reference": _rel_err(a, b),
           "prefill_top1_agreement_vs_bf16_reference": _top1(a, b)}
    if weight_bytes(cfg)[1] > 3e9:
        return res  # an 8B float32 copy does not fit beside the KV cache: the oracle runs on the 1B shape
    # the float32 oracle: the same weights upcast, reference ops; how far is each bf16 path from it?
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in model.executor.weights.items()}
    kv_c = [_small_cache(t, torch.float32) for t in engine.kv.layers]
    with torch.inference_mode():
        c = _Eager(Executor(model.executor.program, fp32, REFERENCE_OPS), model.device).forward(inputs, kv_c)
    del fp32
    return {**res, "gpu_bf16_vs_fp32_oracle_max_rel_err": _rel_err(a, c),
            "reference_bf16_vs_fp32_oracle_max_rel_err": _rel_err(b, c),
            "gpu_bf16_top1_vs_fp32_oracle": _top1(a, c), "reference_bf16_top1_vs_fp32_oracle": _top1(b, c)}


def _prefill_inputs(ids) -> dict:
    """The executor's inputs of one prefill of ids in a fresh cache (blocks 0, 1, ...)."""
    import torch
    n = len(ids)
    return {"input_ids": ids, "positions": torch.arange(n), "slot_mapping": torch.arange(n),
            "block_tables": torch.arange((n + 15) // 16, dtype=torch.int32)[None],
            "context_lens": torch.tensor([n], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, n], dtype=torch.int32),
            "logits_indices": torch.arange(n)}


def _rel_err(x, ref) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def _top1(x, ref) -> float:
    return float((x.argmax(-1) == ref.argmax(-1)).float().mean())


def _small_cache(layer, dtype=None):
    """A zeroed 8-block cache like `layer`: a tensor, or the (codes, scales) of a quantized KV cache
    (whose codes keep their dtype: the float32 oracle then runs the same quantized-cache program)."""
    import torch
    if isinstance(layer, tuple):
        return tuple(torch.zeros_like(t[:, :8]) for t in layer)
    return torch.zeros_like(layer[:, :8], dtype=dtype)


class _Eager:
    """An executor run eagerly on the model's device, with the engine's executor interface."""
    step_tokens = None
    draws_in_graph = False

    def __init__(self, executor, device):
        self.executor, self.device = executor, device

    def forward(self, inputs, kv, fill=None, draws=None):
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if fill is not None:  # the engine's overlapped step: rows whose input id is still on the device
            fill.apply(inputs["input_ids"], fill.rows.to(self.device), fill.src.to(self.device))
        return self.executor.forward(inputs, kv)

    def keep_tokens(self, tokens):
        pass
