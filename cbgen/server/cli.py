"""``python -m cbgen serve``: load a model, start the online engine, serve it over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from ..config import EngineConfig

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name, HF folder or .gguf file")
    parser.add_argument("--served-model-name", help="the name clients pass (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CBGEN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $CBGEN_API_KEY)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: memory budget)")
    parser.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 past it)"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from ..models import load_model
    from ..online import Engine
    from .app import create_app

    logging.getLogger("cbgen").setLevel(getattr(logging, args.log_level.upper()))
    if not _is_loopback(args.host) and not args.api_key:
        logger.warning(
            "cbgen serve: binding %s without an API key: anyone who can reach it can use it",
            args.host,
        )
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    engine = Engine(model, tokenizer, config)
    try:
        app = create_app(
            engine,
            tokenizer,
            args.served_model_name or args.model,
            api_key=args.api_key or None,
            max_body_bytes=args.max_body_bytes,
        )
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.close()
    return 0
