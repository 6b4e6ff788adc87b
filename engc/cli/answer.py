"""The commands that answer in the terminal, generate (one prompt) and chat (a conversation), and the sampling
options they share."""
from __future__ import annotations

import json
from pathlib import Path

import click

from engc.cli.options import device_option, tp_option
from engc.errors import UserError


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


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="The prompt; sent through the chat template unless --raw.")
@click.option("--raw", is_flag=True, help="Send the prompt as plain text, without the chat template.")
@device_option
@tp_option
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


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="System prompt.")
@device_option
@tp_option
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
