"""The proxy's ``vllm-sha256`` prompt hashes against vLLM's own ``hash_block_tokens`` (vLLM
0.33.0 from the test-only env, in a child process): the hashes precise routing looks up are
the ones vLLM's KV events carry."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from agentserving.core.hashing import ChunkHasher
from testkit.vllm_env import vllm_env_dir

ENV_DIR = vllm_env_dir()
pytestmark = pytest.mark.skipif(ENV_DIR is None, reason="vLLM test env not installed (run "
                                "scripts/vllm-test-env.sh, which `make test` does)")

CHILD = textwrap.dedent("""
    import json, sys
    from testkit.vllm_env import enter_vllm_env
    enter_vllm_env(sys.argv[1])
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as k
    k.init_none_hash(sha256)
    out = []
    for tokens, salt in json.loads(sys.stdin.read()):
        parent, chain = None, []
        for start in range(0, len(tokens) - len(tokens) % 128, 128):
            extra = (salt,) if salt and start == 0 else None
            parent = k.hash_block_tokens(sha256, parent, tokens[start:start + 128], extra)
            chain.append("%x" % k.maybe_convert_block_hash(parent))
        out.append(chain)
    print(json.dumps(out))
""")


def test_prompt_hashes_equal_vllms_block_hashes():
    rng = random.Random(7)
    cases = [([rng.randrange(32000) for _ in range(n)], salt)
             for n, salt in ((127, None), (128, None), (1000, None), (700, "tenant-a"))]
    out = subprocess.run([sys.executable, "-c", CHILD, str(ENV_DIR)], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONHASHSEED": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [ChunkHasher("vllm-sha256", 128, cache_salt=salt).hashes(tokens)
            for tokens, salt in cases]
    assert ours == theirs
    assert [len(c) for c in ours] == [0, 1, 7, 5]
