"""The commands that run the compiler: build (a checkpoint into a bundle), tune (kernel configs for a build to
take) and quantize (a checkpoint into an int4 one)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from engc.errors import UserError


@click.command()
@click.argument("src")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Bundle folder to write.")
@click.option("--arch", default="cpu", show_default=True,
              help="Comma list of targets: cpu, sm80, sm86, sm89, sm90 (GPU kernels are compiled ahead of time).")
@click.option("--dtype", default="auto", show_default=True,
              help="float32, bfloat16 or float16; auto = float32 for cpu-only bundles, bfloat16 otherwise.")
@click.option("--kernel-cache", default=None, envvar="ENGC_KERNEL_CACHE", type=click.Path(file_okay=False),
              help="Folder of compiled kernels to reuse and fill (keyed by shapes, dtype, arch, sources).")
@click.option("--quant", default="auto", show_default=True,
              help="auto = as the checkpoint is (float, or AWQ/GPTQ int4; a GGUF dequantized); fp8 = W8A8 float8 "
                   "projections and float8 MoE experts (GPU archs sm89+); keep = a GGUF's Q4_0/Q4_1/Q4_K "
                   "projections stay 4-bit (see docs/quantization.md).")
@click.option("--kv-cache", default="auto", show_default=True,
              help="auto = the model dtype; int8 or fp8 (e4m3, sm89+) = KV cache stored in 1 byte a value plus "
                   "a float32 scale per token and KV head: about half the memory, twice the cached tokens.")
@click.option("--tune", "tune_file", default=None, type=click.Path(path_type=Path),
              help='JSON tune-table entries to build with, {"sm90/op/variant/bucket": {"FIELD": value}} '
                   "(e.g. configs measured on your GPU); recorded in the manifest.")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1),
              help="Tensor-parallel ranks (GPUs): one weight file a rank, heads and MLP columns split "
                   "across them; serve with engc run (see docs/deploy.md).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
def build(src, out, arch, dtype, kernel_cache, quant, kv_cache, tune_file, tp, as_json):
    """Build a bundle from SRC: a Hugging Face folder, a .gguf file, or 'default'."""
    from engc.bundle.manifest import parse_archs
    from engc.compiler.build import BuildOptions
    from engc.compiler.build import build as build_bundle
    from engc.compiler.tune import read_tune_file
    from engc.progress import Progress
    opts = BuildOptions(archs=tuple(parse_archs(arch)), dtype=dtype, kernel_cache=kernel_cache, quant=quant,
                        kv_cache=kv_cache, tune=read_tune_file(tune_file) if tune_file else None, tp=tp)
    summary = build_bundle(src, out, opts, Progress(enabled=not as_json))
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(f"built {summary['bundle']}: {summary['model']} ({summary['family']}, {summary['dtype']}, "
                   f"archs {','.join(summary['archs'])}, {summary['kernels']} kernels, "
                   + (f"{summary['tp']} ranks, " if summary["tp"] > 1 else "") +
                   f"{summary['bytes'] / 1e6:.1f} MB) in {summary['seconds']}s")


@click.command(name="tune")
@click.argument("src", required=False)
@click.option("--prepare", "prepare_dir", default=None, type=click.Path(path_type=Path),
              help="Folder to write SRC's candidate kernels to, compiled here for --arch (no GPU needed); "
                   "carry it to the GPU machine for --from.")
@click.option("--from", "from_dir", default=None, type=click.Path(path_type=Path),
              help="A --prepare folder: load its kernels on this machine's GPU, check and time them, write -o.")
@click.option("-o", "--out", default=None, type=click.Path(path_type=Path), help="Tune file to write (JSON).")
@click.option("--arch", default="sm90", show_default=True, help="--prepare: the GPU arch to compile for.")
@click.option("--sms", default=None, type=click.IntRange(1),
              help="--prepare: multiprocessors of the GPU (split-K targets); default 132 for sm90, 108 for sm80.")
@click.option("--ops", default="gemv,silu_gemv", show_default=True,
              help="Comma list: gemv (plain projections at batch 1: route to cuBLAS or a GEMV class), "
                   "silu_gemv (the SiLU-fused down GEMV's tile), moe (an MoE model's expert GEMMs: a tile per "
                   "class, decode T=1,4, grouped T=32,64,256, prefill T=4096).")
@click.option("--dtype", default="auto", show_default=True, help="bfloat16 or float16; auto = bfloat16.")
@click.option("--budget-s", default=150.0, show_default=True, type=click.FloatRange(1),
              help="Seconds of timing; past it only the table's choice and cuBLAS are timed.")
@click.option("--margin", default=0.03, show_default=True, type=click.FloatRange(0, 0.5),
              help="A config replaces the table's only if faster by more than this fraction.")
def tune_(src, prepare_dir, from_dir, out, arch, sms, ops, dtype, budget_s, margin):
    """Time GEMV (and, --ops moe, MoE expert GEMM) configs for a model on the GPU it will serve on; write those
    that beat engc's tune table (or a kernel's untuned defaults) as a file for `engc build --tune`. The kernels
    timed are compiled where the bundle is built, as it ships them:

    \b
      engc tune SRC --prepare DIR [--arch sm90]     # build machine (no GPU)
      engc tune --from DIR -o tune.json             # GPU machine (carry DIR there)
      engc tune SRC -o tune.json                    # both, on a GPU machine that also builds

    SRC as for build; of an HF folder only config.json is read. The times are per kernel (cold L2): time the
    bundle built with the file end to end before keeping it."""
    from engc.compiler.tune.search import TuneOptions, prepare, summary, tune, tune_from
    opts = TuneOptions(ops=tuple(o.strip() for o in ops.split(",") if o.strip()), dtype=dtype,
                       budget_s=budget_s, margin=margin)
    given = click.get_current_context().get_parameter_source
    if prepare_dir and from_dir:
        raise UserError("--prepare and --from are the two halves of a tune (build machine, GPU machine): give one")
    if from_dir:
        if src:
            raise UserError(f"--from {from_dir} holds the model's plan already: drop SRC ({src})")
        fixed = [f"--{n}" for n in ("arch", "sms", "ops", "dtype") if given(n).name != "DEFAULT"]
        if fixed:
            raise UserError(f"{', '.join(fixed)}: chosen at --prepare; --from takes -o, --budget-s and --margin")
    elif not src:
        raise UserError("give SRC (with --prepare DIR, or -o FILE on a GPU machine that also builds) or --from DIR")
    if prepare_dir:
        if out:
            raise UserError("--prepare writes a folder of kernels, not a tune file: drop -o, then run "
                            f"engc tune --from {prepare_dir} -o FILE on the GPU")
        timing = [f"--{n.replace('_', '-')}" for n in ("budget_s", "margin") if given(n).name != "DEFAULT"]
        if timing:
            raise UserError(f"{', '.join(timing)}: for the timing, on the GPU: give it to engc tune --from")
        doc = prepare(src, prepare_dir, opts, arch, sms)
        size = sum(p.stat().st_size for p in prepare_dir.rglob("*") if p.is_file())
        n = sum(len(s["candidates"]) for s in doc["shapes"])
        click.echo(f"prepared {prepare_dir}: {n} candidates of {len(doc['shapes'])} shapes, {len(doc['files'])} "
                   f"kernels ({size / 1e6:.1f} MB), {doc['arch']}, {doc['sms']} multiprocessors, Triton "
                   f"{doc['triton']}; on the GPU: engc tune --from {prepare_dir} -o tune.json")
        return
    if not out:
        raise UserError("-o FILE: the tune file to write is missing")
    if from_dir:
        result = tune_from(from_dir, out, opts)
    else:
        if given("arch").name != "DEFAULT" or sms:
            raise UserError("--arch and --sms are for --prepare; without it the GPU here decides them")
        result = tune(src, out, opts)
    for line in summary(result, out):
        click.echo(line)


@click.command()
@click.argument("src")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Checkpoint folder to write.")
@click.option("--method", default="awq", show_default=True, help="awq, gptq or rtn (round to nearest).")
@click.option("--bits", default=4, show_default=True, type=int)
@click.option("--group-size", default=128, show_default=True, type=int, help="32, 64 or 128.")
@click.option("--calib", default=None,
              help="Calibration text or JSONL file (default: engc's corpus of general English prose from five "
                   "sources, docs/quantization.md).")
@click.option("--calib-samples", default=64, show_default=True, type=int)
@click.option("--calib-seqlen", default=256, show_default=True, type=int)
@click.option("--act-order/--no-act-order", default=None,
              help="GPTQ: quantize columns in decreasing Hessian order (default on for gptq; its groups stay in "
                   "channel order, so the bundle runs no slower).")
@click.option("--damp", default=0.01, show_default=True, type=float, help="GPTQ: Hessian dampening.")
@click.option("--lm-head", is_flag=True,
              help="Also quantize the lm_head, same method and group size (quantization_config lm_head: true; "
                   "a tied embedding stays float). Costs some perplexity: see docs/quantization.md.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
def quantize(src, out, method, bits, group_size, calib, calib_samples, calib_seqlen, act_order, damp, lm_head,
             as_json):
    """Quantize SRC to int4 one layer at a time; writes an AutoAWQ (awq) or GPTQ (gptq, rtn) checkpoint."""
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    from engc.progress import Progress
    opts = QuantOptions(method=method, bits=bits, group_size=group_size, calib=calib,
                        calib_samples=calib_samples, calib_seqlen=calib_seqlen, act_order=act_order,
                        damp=damp, lm_head=lm_head).validate()
    summary = quantize_checkpoint(src, out, opts, Progress(enabled=not as_json))
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(f"quantized {summary['model']} -> {summary['out']}: {method} int{bits} g{group_size}"
                   f"{' + lm_head' if lm_head else ''} "
                   f"({summary['format']} layout), {summary['layers']} layers in {summary['seconds']}s; "
                   f"peak RSS {summary['peak_rss_mb']:.0f} MB (one layer's weights: "
                   f"{summary['layer_weights_mb']:.0f} MB)")
        calib = summary["calibration"]
        if calib:
            click.echo(f"calibration: {calib['tokens']} tokens ({calib_samples} x {calib_seqlen}) of "
                       f"{calib['corpus']}, {calib['corpus_tokens']} tokens")
