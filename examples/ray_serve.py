"""``cbgen serve`` as Ray Serve replicas behind one route (OpenAI-compatible API).

    .venv/bin/python examples/ray_serve.py                        # 2 replicas x 1 thread, local Ray
    .venv/bin/python examples/ray_serve.py --replicas 4 --address auto --api-key KEY

Each replica loads the model and runs its own engine (``cbgen.frontends.ray_serve``); Ray Serve
spreads the requests over them. Clients talk to ``http://HOST:PORT/v1`` as to ``cbgen
serve``. ``deploy()`` is what the tests call.
"""

from __future__ import annotations

import argparse
import signal
import threading

import ray
from ray import serve

from cbgen.core.config import EngineConfig
from cbgen.frontends.ray_serve import application


def deploy(
    model: str = "smollm2",
    *,
    replicas: int = 2,
    threads: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    **options,
) -> str:
    """Start the replicas (and Ray, when this process has none) and return the API's URL."""
    if not ray.is_initialized():
        ray.init(address=address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(
        application(model, replicas=replicas, threads=threads, **options),
        name="cbgen",
        route_prefix="/",
    )
    return f"http://{host}:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPUs) per replica")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--address", help="a Ray cluster's address (default: a local Ray)")
    parser.add_argument("--api-key", help="required from clients (needed off loopback)")
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    args = parser.parse_args()
    url = deploy(
        args.model,
        replicas=args.replicas,
        threads=args.threads,
        host=args.host,
        port=args.port,
        address=args.address,
        api_key=args.api_key,
        config=EngineConfig(max_num_seqs=args.max_num_seqs),
    )
    print(f"cbgen on Ray Serve: {args.replicas} replicas at {url} (Ctrl-C stops)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()


if __name__ == "__main__":
    main()
