"""engc quantize: walk a checkpoint one decoder layer at a time, in bounded memory.

Per layer: load its float weights from the checkpoint, run the calibration activations through it
(layer.py), let the method choose the int4 weights (rtn.py, awq.py, gptq.py), write that layer's
shard, compute the next layer's input through the *quantized* layer, drop everything else. The peak is
one layer's weights plus the activations of the calibration set, whatever the depth of the model.
The layers are read under Llama's names as the build reads them (frontend/layouts.py) and written back in
the source's names and layout (source_layout.py).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engc.atomic import atomic_folder
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.decoder import _rope_table, head_source, resolve_config
from engc.compiler.frontend.families import family_of
from engc.compiler.frontend.layouts import STACKED_EXPERTS, llama_names, text_part
from engc.compiler.frontend.mla import interleaved
from engc.compiler.quantize.awq import awq_attention, awq_layer
from engc.compiler.quantize.calibration import calibration_samples
from engc.compiler.quantize.experts import (MoeMlp, awq_experts, gptq_experts, moe_linears, shared_expert,
                                              shared_linears)
from engc.compiler.quantize.formats import to_awq, to_gptq
from engc.compiler.quantize.gptq import Hessian, gptq_quantize
from engc.compiler.quantize.head import quantize_head
from engc.compiler.quantize.layer import DecoderLayer, batched
from engc.compiler.quantize.mla_layer import MLP_LINEARS, MlaLayer, attention_linears, gptq_stages
from engc.compiler.quantize.options import QuantOptions
from engc.compiler.quantize.rtn import quantize_rtn
from engc.compiler.quantize.source_layout import SourceNames, source_layer
from engc.errors import UserError
from engc.progress import Progress

# GPTQ's true-sequential stages: projections quantized together, and how to get their input from x
GPTQ_STAGES = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), lambda L, x: L.attn_in(x)),
    (("self_attn.o_proj",), lambda L, x: L.attn_context(L.attn_in(x))),
    (("mlp.gate_proj", "mlp.up_proj"), lambda L, x: L.mlp_input(x)),
    (("mlp.down_proj",), lambda L, x: L.mlp_act(L.mlp_input(x))),
)


def quantize_checkpoint(src: str, out: Path, opts: QuantOptions, progress: Progress | None = None) -> dict:
    from engc.compiler.build import read_source
    progress = progress or Progress(enabled=False)
    opts.validate()
    started, start_rss = time.monotonic(), current_rss_mb()
    refuse_quantized_config(Path(src) / "config.json")  # before read_source, which may not read its method
    source = read_source(src)
    refuse_quantized(source)
    cfg = resolve_config(source.hf_config)
    if family_of(source.hf_config).layout in STACKED_EXPERTS:
        raise UserError(f"engc quantize does not write {cfg.family}'s stacked experts as int4 (no int4 checkpoint "
                        "layout holds them); build the float checkpoint, with --quant fp8 for 8-bit experts")
    names = SourceNames.of(source)
    ckpt = llama_view(source, cfg)
    check_shapes(cfg, opts.group_size, opts.lm_head)
    x, calib = None, {}
    if opts.method != "rtn":
        with progress.step("tokenize calibration text"):
            ids = calibration_samples(ckpt.tokenizer_files["tokenizer.json"], opts.calib,
                                      opts.calib_samples, opts.calib_seqlen, calib)
        x = first_layer_input(ckpt, cfg, ids)
    # the build's rope tables: a partial rotary's padded with zeros, the local layers' own base (Gemma 3)
    rope = (_rope_table(cfg, cfg.rope_theta, cfg.rope_scaling),
            _rope_table(cfg, cfg.local_rope_theta, None) if cfg.local_rope_theta else None)
    out = Path(out).resolve()
    head = head_source(ckpt, cfg)
    # the source's tensors outside the layers (a multimodal checkpoint's vision tower too), as they are;
    # --lm-head: the head is written quantized instead
    rest_names = [n for n in source.names() if not names.is_layer_tensor(n)
                  and not (opts.lm_head and head == "lm_head.weight" and n == names.head + "weight")]
    shards = cfg.num_layers + opts.lm_head   # and the rest's, counted once written (_write_rest)
    index, layer_bytes, layer_rss = {}, 0, []
    with atomic_folder(out) as tmp:
        bar = progress.bar(f"quantize {opts.method} g{opts.group_size}", total=cfg.num_layers)
        for i in range(cfg.num_layers):
            tensors, x, nbytes = quantize_layer(ckpt, cfg, rope, i, x, opts, names)
            layer_bytes = max(layer_bytes, nbytes)
            shard = f"model-{i + 1:05d}.safetensors"
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            index.update({name: shard for name in tensors})
            del tensors
            release_freed_memory()
            layer_rss.append(round(anonymous_rss_mb(), 1))  # flat across layers unless something leaks
            bar.advance()
        bar.close()
        if opts.lm_head:  # one more "layer": the head is loaded, quantized, written and freed (head.py)
            with progress.step(f"quantize lm_head ({'rtn' if opts.method == 'rtn' else 'gptq'})"):
                norm = ckpt.get("model.norm.weight").float()
                tensors = quantize_head(ckpt.get(head), norm + 1 if cfg.norm_unit_offset else norm, x,
                                        cfg.rms_norm_eps, opts, pack_of(opts))
            shard = f"model-{shards:05d}.safetensors"
            save_file({f"{names.head}{k}": t.contiguous() for k, t in tensors.items()}, str(tmp / shard),
                      metadata={"format": "pt"})
            index.update({f"{names.head}{k}": shard for k in tensors})
            del tensors
            release_freed_memory()
        del x
        _write_rest(tmp, source, rest_names, shards, index)
        write_metadata(tmp, source, opts, index, float_modules(cfg, source.hf_config))
    return {"out": str(out), "model": ckpt.name, "method": opts.method, "bits": opts.bits,
            "group_size": opts.group_size, "format": opts.format, "layers": cfg.num_layers, "lm_head": opts.lm_head,
            "layer_weights_mb": round(layer_bytes / 2**20, 1), "start_rss_mb": round(start_rss, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1), "layer_end_rss_mb": layer_rss,
            "seconds": round(time.monotonic() - started, 1), "calibration": calib}


def first_layer_input(ckpt: Checkpoint, cfg, ids: torch.Tensor) -> torch.Tensor:
    """The calibration windows' embeddings [samples, seqlen, hidden] in float32, as the first layer reads them."""
    embed = ckpt.get("model.embed_tokens.weight")
    x = embed[ids].float()  # rows first: a float32 copy of a 128k-vocab embedding is 4 layers' worth
    if cfg.embed_scale:   # Gemma: as HF scales it, by sqrt(hidden_size) rounded to the embedding's dtype
        x *= torch.tensor(cfg.embed_scale, dtype=embed.dtype).float()
    return x


def llama_view(source: Checkpoint, cfg) -> Checkpoint:
    """The source as the build reads it: a multimodal checkpoint's text part, under Llama's names."""
    text = text_part(source) if family_of(source.hf_config).text_config else source
    return llama_names(text, family_of(text.hf_config).layout, cfg, cfg.rotary_dim or cfg.head_dim,
                       cfg.rope_attention_factor)


def quantize_layer(ckpt: Checkpoint, cfg, rope, i: int, x, opts: QuantOptions, names: SourceNames):
    """Layer i of the view ckpt quantized: (its tensors under the source's names, the next layer's input,
    the bytes of its float32 weights)."""
    prefix = f"model.layers.{i}."
    dtypes, weights = {}, {}
    for n in ckpt.names():  # one source tensor at a time, kept only as float32
        if n.startswith(prefix):
            t = ckpt.get(n)
            dtypes[n[len(prefix):]], weights[n[len(prefix):]] = t.dtype, t.float()
            del t
    nbytes = sum(t.numel() * 4 for t in weights.values())
    layer, linears = calibration_layer(ckpt.hf_config, cfg, rope, i, weights, dtypes)
    attn_stages = gptq_stages(cfg) if cfg.kv_lora_rank else GPTQ_STAGES[:2]
    missing = [n for n in linears if n + ".weight" not in layer.w]
    if missing:
        raise UserError(f"checkpoint {ckpt.name} is missing tensor '{prefix}{missing[0]}.weight'")
    # kept as QuantizedWeights (uint8 codes) until the layer is done: the source layout may join them
    keep = lambda qw: qw  # noqa: E731
    with torch.no_grad():
        if opts.method == "gptq" and layer.moe is not None:   # attention's stages, then expert by expert
            quantized = {**gptq_layer(layer, x, opts, keep, attn_stages), **gptq_experts(layer, x, opts, keep)}
        elif opts.method == "gptq":
            quantized = gptq_layer(layer, x, opts, keep, attn_stages + GPTQ_STAGES[2:])
        else:
            if opts.method == "awq" and layer.moe is not None:   # the attention's scales, then the experts'
                awq_attention(layer, x, opts.group_size, opts.awq_grid)
                awq_experts(layer, x, opts.group_size, opts.awq_grid)
            elif opts.method == "awq":
                awq_layer(layer, x, opts.group_size, opts.awq_grid)
            quantized = {}
            for n in linears:
                # popped: the float weight is freed once quantized, before its dequantized copy exists
                quantized[n] = qw = quantize_rtn(layer.w.pop(n + ".weight"), opts.group_size)
                if x is not None:  # calibrated: the next layer's input comes through the quantized layer
                    layer.w[n + ".weight"] = qw.dequantize()
                del qw
        if x is not None:
            x = batched(layer.forward, x)
    floats = {key: t for key, t in layer.w.items()   # norms and biases, AWQ's folded scales included
              if key.rsplit(".", 1)[0] not in linears or key.endswith(".bias")}
    del layer
    quantized, floats = source_layer(names, cfg, quantized, floats, dtypes)
    out = names.layer(i)
    tensors = {out + key: t.contiguous() for key, t in floats.items()}
    pack = pack_of(opts)
    for n in list(quantized):   # popped as packed: never a projection's codes and its packing both a layer long
        for key, t in pack(quantized.pop(n)).items():
            tensors[f"{out}{n}.{key}"] = t
    return tensors, x, nbytes


def calibration_layer(hf: dict, cfg, rope, i: int, weights: dict, dtypes: dict):
    """(layer i as the quantizer computes it, the projections it quantizes) over weights, the layer's float32
    tensors under Llama's names (dtypes: their source dtypes). rope: the global and local rope tables. DeepSeek's
    latent attention is mla_layer.py's; an MoE layer's MLP is MoeMlp over each expert's projections, which
    moe_linears names (splitting fused experts in weights)."""
    family = family_of(hf)
    attention = attention_linears(cfg)
    moe = moe_linears(hf, i, weights, dtypes, attention)
    if cfg.kv_lora_rank:
        layer = MlaLayer(cfg, weights, rope[0], i, interleaved(hf, family))
    else:
        layer = DecoderLayer(cfg, weights, rope[0], i, rope[1], family.qk_norm_projection)
    if moe:
        layer.moe = MoeMlp(hf, moe)
    return layer, moe or attention + MLP_LINEARS


def pack_of(opts: QuantOptions):
    return to_awq if opts.format == "awq" else to_gptq


def gptq_layer(layer: DecoderLayer, x: torch.Tensor, opts: QuantOptions, pack, stages=GPTQ_STAGES) -> dict:
    packed = {}
    for names, input_of in stages:
        width = layer.w[names[0] + ".weight"].shape[1]
        hessian = Hessian(width)
        for rows in range(0, x.shape[0], 8):  # activations a few sequences at a time
            hessian.add(input_of(layer, x[rows:rows + 8]))
        for n in names:
            qw = gptq_quantize(layer.w[n + ".weight"], hessian.H, opts.group_size, opts.damp, opts.act_order,
                               opts.static_groups)
            packed[n] = pack(qw)
            layer.w[n + ".weight"] = qw.dequantize()  # later stages see this stage quantized
            del qw
        del hessian
    return packed


def refuse_quantized_config(config: Path) -> None:
    try:
        qc = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return  # read_source reports a broken config.json
    if qc:
        method = qc.get("quant_method", "unknown method") if isinstance(qc, dict) else "unknown method"
        raise UserError(f"{config.parent.name} is already quantized ({method}); quantize its float checkpoint instead")


def refuse_quantized(ckpt: Checkpoint) -> None:
    qc = ckpt.hf_config.get("quantization_config")
    if qc or any(n.endswith(".qweight") for n in ckpt.names()):
        method = (qc or {}).get("quant_method", "int4")
        raise UserError(f"{ckpt.name} is already quantized ({method}); quantize its float checkpoint instead")


def check_shapes(cfg, group_size: int, lm_head: bool = False) -> None:
    """A group size need not divide the widths (the last group is then short, see rtn.pad_groups);
    packing needs multiples of 8."""
    for what, dim in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
                      ("num_heads * head_dim", cfg.q_size), ("num_kv_heads * head_dim", cfg.kv_size),
                      ("moe_intermediate_size", cfg.moe_intermediate_size), ("q_lora_rank", cfg.q_lora_rank),
                      ("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                      ("num_heads * v_head_dim", cfg.num_heads * cfg.v_head_dim)):
        if dim % 8:
            raise UserError(f"{what} {dim} is not a multiple of 8, which packing int4 weights needs")
    if lm_head and cfg.vocab_size % 8:
        raise UserError(f"--lm-head: vocab_size {cfg.vocab_size} is not a multiple of 8, and both int4 layouts "
                        "pack the lm_head's outputs 8 to a word (qzeros; AWQ's qweight too)")


def float_modules(cfg, hf: dict) -> list[str]:
    """The modules of the written checkpoint that engc quantize keeps float, as AutoAWQ and GPTQModel name such
    exclusions (quantization_config's modules_to_not_convert, matched as parts of module names): DeepSeek's
    kv_b_proj (small, and split per head at build: mla_layer.py), Qwen2-MoE's sigmoid gate of the shared expert
    (one output row) and a shared expert the engc int4 layout cannot hold (experts.shared_linears)."""
    shared = shared_expert(hf)
    keep = ["kv_b_proj"] if cfg.kv_lora_rank else []
    if shared and not shared_linears(hf):
        keep.append(shared[0].split(".")[1])   # "shared_expert" covers its gate too
    elif shared and shared[0] == "mlp.shared_expert.":
        keep.append("shared_expert_gate")
    return keep


REST_SHARD_BYTES = 1 << 30


def _write_rest(folder: Path, source: Checkpoint, rest: list[str], written: int, index: dict) -> None:
    """The tensors outside the layers, as they are, in shards of up to REST_SHARD_BYTES (a larger tensor, an
    embedding, alone): a shard is in memory while it is written, and a vision tower's hundreds of small tensors
    become a few files, not one each. Then every shard gets its name, model-<i>-of-<n>, n known at last."""
    group, size = {}, 0

    def flush():
        nonlocal group, size, written
        if group:
            written += 1
            save_file(group, str(folder / f"model-{written:05d}.safetensors"), metadata={"format": "pt"})
            index.update({name: f"model-{written:05d}.safetensors" for name in group})
            group, size = {}, 0
            release_freed_memory()
    for name in rest:
        t = source.get(name).contiguous()
        if size + t.numel() * t.element_size() > REST_SHARD_BYTES:
            flush()
        group[name] = t
        size += t.numel() * t.element_size()
        del t
        if size >= REST_SHARD_BYTES:   # written before the next is loaded: two embeddings are never in memory
            flush()
    flush()
    final = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{written:05d}.safetensors" for i in range(1, written + 1)}
    for old, new in final.items():
        (folder / old).rename(folder / new)
    index.update({name: final[shard] for name, shard in index.items()})


def write_metadata(folder: Path, ckpt: Checkpoint, opts: QuantOptions, index: dict,
                   keep_float: list[str] = ()) -> None:
    qc = quantization_config(opts, keep_float)
    config = dict(ckpt.hf_config, quantization_config=qc)
    if opts.lm_head:  # the head is written explicitly: transformers must not re-tie it to the embedding
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):   # a multimodal config's language model says it too
            config["text_config"] = dict(config["text_config"], tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if opts.format == "gptq":
        (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2, sort_keys=True) + "\n")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict(sorted(index.items()))}, indent=2) + "\n")
    for name, data in ckpt.tokenizer_files.items():
        (folder / name).write_bytes(data)


def quantization_config(opts: QuantOptions, keep_float: list[str] = ()) -> dict:
    meta = {"quantizer": ["engc"], "method": opts.method}
    keep = {"modules_to_not_convert": list(keep_float)} if keep_float else {}
    if opts.format == "awq":
        # "lm_head" as vLLM's AWQ configs read it; AutoAWQ itself never quantizes the head
        return {"quant_method": "awq", "bits": opts.bits, "group_size": opts.group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None, "meta": meta, **keep,
                **({"lm_head": True} if opts.lm_head else {})}
    return {"quant_method": "gptq", "bits": opts.bits, "group_size": opts.group_size,
            "desc_act": opts.act_order, "sym": False, "true_sequential": True, "static_groups": opts.act_order and opts.static_groups,
            "damp_percent": opts.damp, "checkpoint_format": "gptq", "lm_head": opts.lm_head, "meta": meta, **keep}


def release_freed_memory() -> None:
    """Hands freed heap pages back to the OS: glibc keeps a layer's worth of freed blocks per arena
    otherwise, and the peak would creep up with depth instead of staying at one layer."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def current_rss_mb() -> float:
    return _status_mb("VmRSS:")


def anonymous_rss_mb() -> float:
    """Resident memory the quantizer itself holds. VmRSS also counts the checkpoint's pages mapped from
    disk: each layer read maps in that layer's file bytes, which stay resident (clean page cache the
    kernel reclaims at will), so VmRSS climbs by one layer's file size a layer while the heap stays flat."""
    return _status_mb("RssAnon:")


def peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: a child forked from a big process (a test runner) inherits the parent's
    # ru_maxrss across exec, while VmHWM belongs to this address space alone.
    return _status_mb("VmHWM:")
