"""``python -m bench proxy_replicas --quick`` end to end: after a scale-out, three replicas
that share nothing lose sessions to the new pod, while shared records and prompt hashing both
keep them on their KV."""

from __future__ import annotations

import json

from testkit.servers import import_bench

bench = import_bench("proxy_replicas_bench")


def test_shared_state_and_prompt_hashes_keep_sessions_on_their_kv(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "proxy_replicas.json"
    assert bench.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    configs = json.loads(out.read_text())["configs"]
    assert set(configs) == set(bench.CONFIGS)
    followed = {name: r["later_turns_on_previous_pod"] for name, r in configs.items()}
    assert followed["plain"] < 0.8, followed  # the replicas that never saw a session guess
    for name in ("shared", "prompt-hash"):
        assert followed[name] > followed["plain"] + 0.15, followed
        assert configs[name]["cached_share"] > configs["plain"]["cached_share"], configs
    assert all(r["turns"] == 8 * 4 for r in configs.values())
