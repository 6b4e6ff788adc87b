"""The commands that look at a built bundle without serving it: inspect (its manifest), verify (its bytes),
eval (its perplexity) and bench (its speed on this machine)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from engc.cli.options import device_option
from engc.errors import UserError


@click.command()
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


@click.command()
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


@click.command(name="eval")
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


@click.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@device_option
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
