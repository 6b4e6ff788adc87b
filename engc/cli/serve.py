"""engc run: a bundle served over HTTP. Its heavy imports (torch, the server) wait until the port is bound and
the engine's process spawned, so that they overlap the engine's load."""
from __future__ import annotations

from pathlib import Path

import click

from engc.cli.options import TP_HELP, device_option
from engc.runtime.config import EngineConfig


@click.command()
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
@device_option
@click.option("--tp", default=None, type=click.IntRange(1),
              help=TP_HELP + ", spawned here; under torchrun (RANK, WORLD_SIZE set) rank 0 serves.")
def run(bundle, host, port, api_key, served_model_name, max_batch_size, max_prefill_tokens,
        cache_max_entry_count, num_blocks, no_prefix_cache, max_waiting, max_body_bytes, max_context, engine_process,
        device, tp):
    """Serve BUNDLE over HTTP with OpenAI- and Anthropic-compatible APIs (see docs/serving.md)."""
    from engc.runtime.engine_spawn import kill, runs_apart, spawn_engine
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
    child = None
    try:
        child = spawn_engine(str(bundle), config, device, tp) if runs_apart(config) else None
        from engc.runtime.server.app import serve
        serve(str(bundle), config, sock, host, served_model_name, api_key, device, max_body_bytes, tp, child)
    except BaseException:   # whatever fails here (an import, a refusal, Ctrl-C): the engine's process with it
        if child is not None:
            kill(child.process)
        raise
