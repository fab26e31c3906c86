"""Seed 000's vLLM-Ascend command line (``seed000_serve.txt``, verbatim from the seed) parsed,
and the AgentServing spec that expresses it. Shared by the operator's unit tests and the e2e
dry run (importable without a package: no relative imports)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

SEED = Path(__file__).with_name("seed000_serve.txt")


def seed_command() -> tuple[dict[str, str], list[str], list[str]]:
    """(exported env, `vllm serve` argv, memory API URLs) from the seed's excerpt."""
    text = SEED.read_text()
    env = dict(re.findall(r"^export (\w+)=\"?([^\"\n]*)\"?$", text, re.M))
    serve = re.search(r"^vllm serve .*?(?=2>&1)", text, re.M | re.S).group(0)
    argv = shlex.split(serve.replace("\\\n", " "))
    urls = re.findall(r"curl -s -X POST (\S+)", text)
    return env, argv, urls


def flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
                out[k] = v
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a] = argv[i + 1]
                i += 1
            else:
                out[a] = None
        i += 1
    return out


# Flags the operator renders from the spec; every other seed flag goes through spec.engine.args
OPERATOR_FLAGS = {"--host", "--port", "--tensor-parallel-size", "--served-model-name",
                  "--max-model-len", "--no-enable-prefix-caching", "--load-format",
                  "--kv-transfer-config"}


def seed_spec(engine: str) -> dict:
    env, argv, _ = seed_command()
    f = flags(argv[3:])
    args: list[str] = []
    for k, v in f.items():
        if k not in OPERATOR_FLAGS:
            args += [k] + ([v] if v is not None else [])
    accel = "ascend" if engine == "vllm-ascend" else "nvidia"
    pool = {"accelerator": {"type": accel, "count": 16}, "tensorParallelSize": 16}
    return {
        "model": {"name": argv[2], "servedName": f["--served-model-name"],
                  "maxContext": int(f["--max-model-len"]), "source": "dummy"},
        "engine": {"type": engine, "args": args,
                   "env": [{"name": k, "value": v} for k, v in env.items()
                           if k != "LMCACHE_CONFIG_FILE"]},
        "prefill": pool, "decode": pool,
        "kvCache": {"chunkSize": 256, "cpuGiB": 100, "diskGiB": 500,
                    "hashScheme": "lmcache-ascend" if engine == "vllm-ascend"
                    else "lmcache-builtin"},
    }


