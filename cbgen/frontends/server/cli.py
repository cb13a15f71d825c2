"""``python -m cbgen serve``: load a model, start the online engine, serve it over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ...core.config import EngineConfig
from ..args.lora import add_lora_arguments, lora_modules
from ..args.parallel import add_parallel_arguments, parallel_settings
from ..args.precision import add_precision_arguments, load_model_for
from ..args.speculative import add_speculative_arguments, speculative_config
from .guard import LOOPBACK_HOSTS
from .native_memory import HeapTrimmer, bound_native_memory
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name, HF folder or .gguf file")
    parser.add_argument("--served-model-name", help="the name clients pass (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        nargs="+",
        action=_KeysAction,
        default=os.environ.get("CBGEN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ routes, for any of the KEYs "
        "(default: $CBGEN_API_KEY)",
    )
    add_precision_arguments(parser)
    add_speculative_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: memory budget)")
    parser.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 past it)"
    )
    limits = parser.add_argument_group("production limits (see the README)")
    limits.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests added but not started before calls get 429 (default 1024)",
    )
    limits.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 20,
        help="prompt tokens of those requests before calls get 429 (default 1048576)",
    )
    limits.add_argument(
        "--max-tokens-limit", type=int, help="largest max_tokens a call may ask (default: context)"
    )
    limits.add_argument(
        "--max-choices", type=int, default=128, help="prompts x n per call (default 128)"
    )
    limits.add_argument(
        "--max-unread-tokens",
        type=int,
        default=4096,
        help="tokens a stream may leave unread before its request is aborted (default 4096)",
    )
    limits.add_argument(
        "--stream-timeout",
        type=float,
        default=60.0,
        help="seconds a client may leave a stream unread before it is aborted (default 60)",
    )
    limits.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="browser origins allowed to call the API (CORS); others get 403 (default: none)",
    )
    limits.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running calls get to finish after SIGTERM (default 30)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection gets to send its request head (default 10)",
    )
    limits.add_argument(
        "--fair-share-choices",
        type=int,
        default=8,
        help="choices of one call past this many run one priority lower (default 8)",
    )
    limits.add_argument(
        "--client-fair-share",
        type=int,
        default=16,
        help="a client (a call's user, or its API key when several are given) with this many "
        "requests unfinished adds more one priority lower; 0 turns it off (default 16)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body gets to arrive after its head; 408 past it (default 30)",
    )
    limits.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="idle keep-alive seconds (default 5)"
    )
    limits.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="connections and tasks at once; 503 past it (default 1024)",
    )
    limits.add_argument(
        "--keep-native-caches",
        action="store_true",
        help="leave oneDNN's primitive cache at 1,024 shapes and the heap untrimmed, instead "
        "of capping the cache at 128 and trimming the heap when the engine goes idle",
    )
    limits.add_argument(
        "--commit-kv-cache",
        action="store_true",
        help="make the whole KV cache resident at start (memory held from the first call, a "
        "flat RSS after) instead of page by page as blocks are first used",
    )
    add_lora_arguments(parser, runtime_updates=True)
    chat = parser.add_argument_group("tools and reasoning (see docs/serving.md)")
    chat.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="read the model's own tool calls for tool_choice 'auto' in this format",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone turns it on",
    )
    chat.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split a chat answer's thinking into reasoning_content",
    )
    chat.add_argument(
        "--chat-template",
        help="a Jinja chat template file to use instead of the tokenizer's "
        "(e.g. one that renders tools)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


class _KeysAction(argparse.Action):
    """``--api-key KEY [KEY ...]``: one key as a string, several as a list."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:

    from ..online import Engine
    from .lifecycle import make_server

    logging.getLogger("cbgen").setLevel(getattr(logging, args.log_level.upper()))
    if not _is_loopback(args.host) and not args.api_key:
        logger.warning(
            "cbgen serve: binding %s without an API key: anyone who can reach it can use it",
            args.host,
        )
    try:
        adapters = lora_modules(args)  # before the model loads: a name given twice
    except ValueError as exc:
        return _refuse(exc)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return _refuse(ValueError("--enable-auto-tool-choice needs --tool-call-parser"))
    if not args.keep_native_caches:
        bound_native_memory()  # before the model runs: oneDNN reads its cache size once
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            return _refuse(ValueError(f"--chat-template: {exc}"))
    model, tokenizer = load_model_for(args)
    if template is not None:
        tokenizer.chat_template = template
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative=speculative_config(args),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        **parallel_settings(args),
    )
    engine = Engine(
        model,
        tokenizer,
        config,
        max_unread_tokens=args.max_unread_tokens,
        stream_timeout=args.stream_timeout,
    )
    app = None
    trimmer = None
    if args.commit_kv_cache:
        engine.core.commit_cache_memory()  # before the loop starts: resident from now on
    if not args.keep_native_caches:
        trimmer = HeapTrimmer(lambda: engine.num_unfinished > 0).start()
    try:
        try:
            app = _create_app(args, engine, tokenizer, adapters)
        except ValueError as exc:  # an adapter that cannot be loaded, named with the reason
            return _refuse(exc)
        server = make_server(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            drain_timeout=args.drain_timeout,
            header_timeout=args.header_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
            limit_concurrency=args.limit_concurrency,
        )
        server.run()
    finally:
        if trimmer is not None:
            trimmer.close()
        if app is not None:
            app.state.cbgen.close()  # the tokenizer pool
        engine.close()
    return 0


def _create_app(
    args: argparse.Namespace, engine: Any, tokenizer: Any, adapters: dict[str, str]
) -> Any:
    """``create_app`` with the flags' settings; ``ValueError`` for an adapter that cannot
    be loaded."""
    from .app import create_app

    allowed_hosts = None
    if not args.api_key and not _is_loopback(args.host):
        allowed_hosts = {args.host, *LOOPBACK_HOSTS}
    return create_app(
        engine,
        tokenizer,
        args.served_model_name or args.model,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_choices=args.max_choices,
        max_tokens_limit=args.max_tokens_limit,
        allowed_origins=args.allowed_origins,
        allowed_hosts=allowed_hosts,
        body_timeout=args.body_timeout,
        fair_share_choices=args.fair_share_choices,
        client_fair_share=args.client_fair_share or None,
        lora_modules=adapters,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def _refuse(exc: Exception) -> int:
    """A start refused for a reason the flags can fix: the reason, no traceback."""
    print(f"cbgen serve: {exc}", file=sys.stderr)
    return 2
