"""`attnserve serve`: serve an exported artifact over HTTP.

Usage:
    attnserve serve --model artifacts/default [--host 127.0.0.1] [--port 8000]
                    [--device auto|cpu|cuda] [--max-batch-size 32] ...

Every flag is also an environment variable: --max-batch-size is ATTNSERVE_MAX_BATCH_SIZE.
Flags given on the command line win over the environment.
"""

from __future__ import annotations

import argparse

# (flag, settings field, type, help); defaults live in service/settings.py.
OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--model", "model", str, "artifact directory to serve"),
    ("--host", "host", str, "address to bind (default 127.0.0.1)"),
    ("--port", "port", int, "port to bind (default 8000)"),
    ("--served-model-name", "served_model_name", str,
     "model name in the API and metrics (default: the artifact's)"),
    ("--max-batch-size", "max_batch_size", int, "sequences per decode step (default 32)"),
    ("--max-batch-tokens", "max_batch_tokens", int,
     "prompt + max_new_tokens summed over the running batch (default 16384)"),
    ("--max-queued-requests", "max_queued_requests", int,
     "requests waiting to join the batch before 429 (default 128)"),
    ("--max-input-tokens", "max_input_tokens", int,
     "longest prompt (default max_total_tokens - 1)"),
    ("--max-total-tokens", "max_total_tokens", int,
     "prompt + max_new_tokens (default the model's context length)"),
    ("--max-new-tokens", "max_new_tokens", int,
     "upper bound on max_new_tokens (default max_total_tokens - 1)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body (default 1 MiB)"),
    ("--drain-timeout", "drain_timeout", float,
     "seconds to let in-flight requests finish on SIGTERM (default 30)"),
    ("--intra-op-threads", "intra_op_threads", int,
     "ONNX Runtime intra-op threads, 0 = all cores (default 0)"),
    ("--attention-max-concurrent", "attention_max_concurrent", int,
     "/attention requests computed at once (default 1)"),
    ("--attention-max-queued", "attention_max_queued", int,
     "/attention requests waiting for a slot before 429 (default 4)"),
    ("--attention-threads", "attention_threads", int,
     "ONNX Runtime threads of the attention session, 0 = all cores (default 1)"),
    ("--kv-cache-memory-mb", "kv_cache_memory_mb", float,
     "KV cache budget in MiB: tokens held at once, prompt + max_new_tokens reserved per "
     "request (default: max_batch_tokens)"),
    ("--prefix-cache-memory-mb", "prefix_cache_memory_mb", float,
     "prefix cache block store in MiB (default 64)"),
    ("--prefix-block-size", "prefix_block_size", int, "tokens per prefix-cache block (16)"),
    ("--float32-pass-tokens", "float32_pass_tokens", int,
     "quantised artifacts: passes of at least this many tokens run on engine_float32.onnx, "
     "the graph's float32 twin (MatMulNBits is slower than a float32 GEMM there); 0: never "
     "(default: the artifact's, 512 for int4, 256 for gguf, 1024 for int8)"),
    ("--codes8-pass-rows", "codes8_pass_rows", int,
     "4-bit artifacts: passes of at least this many rows (below --float32-pass-tokens "
     "tokens) run on engine_codes8.onnx, the same weights as 8-bit codes (faster for many rows); "
     "0: never, and not loaded (default: the artifact's, 16)"),
    ("--prefill-chunk-tokens", "prefill_chunk_tokens", int,
     "prefill longer prompts in chunks of this many tokens between decode steps; 0: off "
     "(default 256)"),
    ("--speculative-model", "speculative_model", str,
     "speculative decoding: 'ngram' (prompt lookup) or the artifact directory of a smaller "
     "model with the same tokenizer (default off)"),
    ("--num-speculative-tokens", "num_speculative_tokens", int,
     "tokens drafted per verification pass (default 4)"),
    ("--prompt-lookup-max", "prompt_lookup_max", int,
     "longest n-gram matched by prompt lookup (default 4)"),
    ("--prompt-lookup-min", "prompt_lookup_min", int,
     "shortest n-gram matched by prompt lookup (default 2)"),
    ("--speculative-max-batch-rows", "speculative_max_batch_rows", int,
     "speculate only while at most this many sequences run (default 1)"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve an exported model over HTTP (FastAPI + ONNX Runtime)",
        description="Serve an artifact directory with continuous batching. Every option "
                    "can also be set as ATTNSERVE_<OPTION> in the environment.")
    for flag, dest, kind, text in OPTIONS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=text)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="auto: CUDA when available, else CPU; cuda fails if absent")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default=None)
    parser.add_argument("--generation-config", choices=("auto", "off"), default=None,
                        help="auto (default): OpenAI requests take unset sampling fields "
                             "from the model's generation_config.json; off: ignore it")
    parser.add_argument("--engine-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="decode with the artifact's engine.onnx (in-place KV cache) when "
                             "it has one and runs on CPU (default); --no-engine-graph: "
                             "always model.onnx")
    parser.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="newcomers' prompts and prompt chunks ride in the running rows' "
                             "decode pass (engine_mixed.onnx; default on); --no-mixed-steps: "
                             "engine.onnx, faster plain steps, joins cost a pass each")
    parser.add_argument("--adaptive-prefill-chunks", action=argparse.BooleanOptionalAction,
                        default=None, help="size each prefill chunk to cost about one decode "
                                           "step of the running rows (default on); "
                                           "--no-adaptive-prefill-chunks: fixed chunks of "
                                           "--prefill-chunk-tokens")
    parser.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                        default=None, help="stop proposing for a while where speculation "
                                           "does not pay, by measured cost (default on); "
                                           "--no-speculative-adaptive: propose every step")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="reuse cached keys/values of shared prompt "
                                           "prefixes (engine.onnx; default on)")
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction,
                        default=None, help="once loaded, move the packed weights into 2 MiB "
                                           "pages: fewer TLB misses a decode step (Linux "
                                           "6.1+; default on)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.artifact.loader import open_artifact
    from service.settings import Settings

    fields = [dest for _, dest, _, _ in OPTIONS] + ["device", "log_level", "engine_graph",
                                                "prefix_caching", "generation_config",
                                                "adaptive_prefill_chunks", "mixed_steps",
                                                "speculative_adaptive", "huge_pages"]
    overrides = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        if first["type"] == "missing":
            raise ValueError(f"--{name.replace('_', '-')} (or ATTNSERVE_{name.upper()}) "
                             "is required") from None
        raise ValueError(f"invalid setting {name}: {first['msg']}") from None
    artifact = open_artifact(settings)

    from service.server import serve

    return serve(settings, artifact)
